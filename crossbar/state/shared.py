"""Counts shared by the worker processes of one crossbar (docs/design.md §Workers).

With ``workers: N`` every worker is a whole crossbar, yet room, least-busy, the queue,
status and metrics must see the fleet: requests in flight to a host from *any* worker.
:class:`SharedCounts` is a file mapped into every worker's memory (``mmap``): one row
of 64-bit cells per process, each process writing only its own row, readers summing
the column. No locks are needed (a cell is written by one process only; an aligned
8-byte store is atomic on the platforms crossbar runs on), and a read is a few memory
loads, cheap enough for every choice.

Cells are addressed by names derived from the config alone (``host``, ``route\\0host``,
``q\\0route`` ...): :func:`cell_map` gives every worker with the same config the same
cell for the same name, whatever order things happened in.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import Iterable

__all__ = ["CELLS", "SharedCounts", "cell_map"]

CELLS = 4096
"""Cells per process row: room for every name a config of hundreds of hosts and
routes derives."""

_CELL = 8


def cell_map(names: Iterable[str], cells: int = CELLS) -> dict[str, int]:
    """A cell index (``0 <= index < cells``) for each of ``names``, the same for the
    same set of names in every process: each name hashes to a cell, collisions probe
    to the next free one in sorted-name order.

    :raises ValueError: more names than cells.
    """
    unique = sorted(set(names))
    if len(unique) > cells:
        raise ValueError(f"{len(unique)} shared counters, at most {cells}")
    taken: dict[int, str] = {}
    out: dict[str, int] = {}
    for name in unique:
        cell = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=4).digest(), "big") % cells
        while cell in taken:
            cell = (cell + 1) % cells
        taken[cell] = name
        out[name] = cell
    return out


def create_file(path: str, size: int) -> None:
    """Create (or clear) the file at ``path``, ``size`` bytes of zeros, mode 0600, its
    disk space allocated: a sparse file's first write to a page of its map on a full disk
    would be a SIGBUS in every worker, not an error at start-up.

    :raises OSError: the file cannot be made (e.g. ``ENOSPC``)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def map_file(path: str, size: int | None = None) -> mmap.mmap:
    """A shared read-write map of the file at ``path``: its first ``size`` bytes, or the
    whole file when ``size`` is None.

    :raises OSError: the file cannot be opened; :raises ValueError: it is empty."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size if size is None else size)
    finally:
        os.close(fd)


class SharedCounts:
    """Rows of counters in a shared file, one row per process.

    :param path: the file (created and sized by :meth:`create`).
    :param rows: how many processes share it.
    :param row: this process's row (``0 <= row < rows``).
    """

    def __init__(self, path: str, rows: int, row: int) -> None:
        if not 0 <= row < rows:
            raise ValueError(f"row {row} outside 0..{rows - 1}")
        self.path = path
        self.rows = rows
        self.row = row
        self._map = map_file(path, rows * CELLS * _CELL)
        self._cells = memoryview(self._map).cast("q")

    @staticmethod
    def create(path: str, rows: int) -> None:
        """Create (or clear) the file at ``path`` for ``rows`` processes, all zero, its
        disk space allocated.

        :raises OSError: the file cannot be made (e.g. ``ENOSPC``)."""
        create_file(path, rows * CELLS * _CELL)

    def set(self, cell: int, value: int) -> None:
        """Write ``value`` into ``cell`` of this process's row."""
        self._cells[self.row * CELLS + cell] = value

    def get(self, cell: int, row: int | None = None) -> int:
        """``cell`` of ``row`` (default: this process's)."""
        return int(self._cells[(self.row if row is None else row) * CELLS + cell])

    def total(self, cell: int) -> int:
        """The sum of ``cell`` over every row: the fleet's count."""
        cells = self._cells
        return sum(cells[r * CELLS + cell] for r in range(self.rows))

    def smallest(self, cell: int) -> int | None:
        """The smallest non-zero value of ``cell`` over every row, or None."""
        cells = self._cells
        values = [cells[r * CELLS + cell] for r in range(self.rows)]
        positive = [v for v in values if v > 0]
        return min(positive) if positive else None

    def clear_row(self, row: int | None = None) -> None:
        """Zero every cell of ``row`` (default: this process's): a worker that starts
        (or restarts) counts nothing in flight yet."""
        start = (self.row if row is None else row) * CELLS
        self._cells[start:start + CELLS] = memoryview(bytes(CELLS * _CELL)).cast("q")
