"""Key limits across the workers of one box (docs/design.md §Access, §Workers).

With ``workers: N`` and no ``cluster.redis``, a key's ``requests_per_minute``,
``tokens_per_minute`` and ``tokens_per_day`` hold for the box, not per worker: each
worker counts what it admitted and what its answers spent into its own row of a file
mapped into every worker's memory (``mmap``, like
:class:`~crossbar.state.shared.SharedCounts`), and the worker checking a request sums
every row. Nothing waits on another process: a check reads a few cells per worker.

Each (route, key) with limits has a *slot* in every row (:func:`limit_slot_map`: the
same slot for the same config in every worker), of :data:`SLOT_CELLS` 64-bit cells:

- a tag (a hash of the route and key): a row's slot counts for a key only while its
  tag is that key's, so a slot that changed hands with a reload never lends its counts
  to another key (the worker writing next clears it first);
- the tokens of one UTC day: ``day << 40 | tokens``;
- a ring of :data:`RING` per-second buckets of admitted requests and one of spent
  tokens, each ``second << 32 | count``: a bucket stamped second ``s`` counts while
  ``now < s + 61`` (a second after its start + 60, so a sliding minute never admits
  more than the limit; the ``Retry-After`` is up to a second longer than an exact
  window's);
- for each ring, its minute's total as of the worker's last write, ``second << 32 |
  total``: a reader takes it and subtracts only the buckets that have left the minute
  since (none for a worker busy this second), so a check does not sum 61 buckets per
  worker. The per-second buckets themselves are read only to say when a refused key
  may come back.

A cell carries its own stamp, so one aligned 8-byte store publishes it whole and a
reader needs no lock; each row is written by its own worker only. A worker that dies
leaves its row as it was (what it admitted keeps counting until it leaves the window)
and the worker started in its place goes on counting there.

The file is sized when the supervisor starts (:func:`limit_slots_for`: room for twice
the config's keys with limits, at least :data:`LIMIT_SLOTS`); a reload to more keys
with limits than that is refused (:func:`check_limit_room`).
"""

from __future__ import annotations

import hashlib
import os

from zope.interface import implementer

from crossbar.config import Config, ConfigError, KeyLimits
from crossbar.state.limits import MINUTE, ILimitCounts, ProcessCounts, Spending, to_midnight, utc_day
from crossbar.state.shared import cell_map, create_file, map_file

__all__ = [
    "LIMIT_SLOTS", "MAX_LIMIT_SLOTS", "RING", "SLOT_CELLS", "BoxLimits", "check_limit_room", "limit_slot_map",
    "limit_slots_for", "limited_keys",
]

RING = 64
"""Per-second buckets per key and kind: more than the 61 seconds a bucket counts."""
LIFE = int(MINUTE) + 1
"""Seconds after its own second's start that a bucket leaves the sliding minute."""
SLOT_CELLS = 4 + 2 * RING
"""Cells per (route, key) per row: tag, day, the two rings' totals, the requests ring,
the tokens ring."""
LIMIT_SLOTS = 256
"""The fewest (route, key) slots the file is made with (room for keys a reload adds)."""
MAX_LIMIT_SLOTS = 4096
"""The most keys with limits a config with workers may have (each slot is ~1 KiB per
worker)."""

_CELL = 8
_TAG, _DAY, _REQUESTS, _TOKENS = 0, 1, 4, 4 + RING
_TOTAL = {_REQUESTS: 2, _TOKENS: 3}
"""A ring's offset -> the offset of its minute's total."""
_LOW32 = (1 << 32) - 1
_LOW40 = (1 << 40) - 1


def limited_keys(config: Config) -> list[tuple[str, str]]:
    """Every (route, key) of ``config`` that has ``limits``."""
    return [(route.name, name) for route in config.routes.values() for name, key in route.keys.items() if key.limits]


def limit_slots_for(config: Config) -> int:
    """The slots to make the file with for ``config``: twice its keys with limits, at
    least :data:`LIMIT_SLOTS`, at most :data:`MAX_LIMIT_SLOTS`.

    :raises ConfigError: more keys with limits than :data:`MAX_LIMIT_SLOTS`.
    """
    needed = len(limited_keys(config))
    if needed > MAX_LIMIT_SLOTS:
        raise ConfigError(config.source, "workers", f"this config has {needed} keys with limits and workers count "
                          f"at most {MAX_LIMIT_SLOTS}: give fewer keys limits, or use workers: 1")
    return min(MAX_LIMIT_SLOTS, max(LIMIT_SLOTS, 2 * needed))


def check_limit_room(config: Config, slots: int) -> None:
    """A reload's ``config`` fits the file made with ``slots`` at start.

    :raises ConfigError: more keys with limits than ``slots``.
    """
    needed = len(limited_keys(config))
    if needed > slots:
        raise ConfigError(config.source, "workers", f"this config has {needed} keys with limits and the workers' "
                          f"shared memory was made for {slots} at start: restart crossbar to apply it")


def _name(route: str, key: str) -> str:
    return f"{route}\0{key}"


def _tag(route: str, key: str) -> int:
    """A non-zero 64-bit tag for (route, key)."""
    return int.from_bytes(hashlib.blake2b(_name(route, key).encode("utf-8"), digest_size=8).digest(), "big") | 1


def limit_slot_map(keys: list[tuple[str, str]], slots: int) -> dict[tuple[str, str], int]:
    """A slot for each (route, key) in ``keys``, the same in every process for the
    same keys; beyond ``slots`` keys, the first ``slots`` in sorted order get one."""
    names = {_name(route, key): (route, key) for route, key in keys}
    fitting = sorted(names)[:slots]
    return {names[name]: slot for name, slot in cell_map(fitting, slots).items()}


def _bump(cell: int, stamp: int, shift: int, add: int) -> int:
    """``cell`` (``stamp << shift | count``) with ``add`` more counted at ``stamp``
    (a cell of another stamp starts again from ``add``); the count saturates."""
    low = (1 << shift) - 1
    if cell >> shift == stamp:
        return (stamp << shift) | min(low, (cell & low) + add)
    return (stamp << shift) | min(low, add)


@implementer(ILimitCounts)
class BoxLimits:
    """What each (route, key) with limits was admitted and spent by every worker of the
    box (see the module doc): this worker writes its row, checks read every row.

    :param path: the file (made by :meth:`create`; its size gives the slots per row).
    :param rows: how many processes share it.
    :param row: this process's row (``0 <= row < rows``).
    :param config: the config whose keys are counted (see :meth:`configure`).
    :raises ValueError: a row outside the file, or a file of the wrong size.
    :raises OSError: the file cannot be opened.
    """

    def __init__(self, path: str, rows: int, row: int, config: Config) -> None:
        if not 0 <= row < rows:
            raise ValueError(f"row {row} outside 0..{rows - 1}")
        self.path = path
        self.rows = rows
        self.row = row
        size = os.stat(path).st_size
        per_slot = rows * SLOT_CELLS * _CELL
        if size == 0 or size % per_slot:
            raise ValueError(f"{path}: {size} bytes is no whole number of slots for {rows} rows")
        self._map = map_file(path, size)
        self.slots = size // per_slot
        self._cells = memoryview(self._map).cast("Q")
        self._slot: dict[tuple[str, str], int] = {}
        self._tags: dict[tuple[str, str], int] = {}
        self._alone = ProcessCounts()  # keys beyond the slots (a config the supervisor refuses)
        self.configure(config)

    @staticmethod
    def create(path: str, rows: int, slots: int) -> None:
        """Create (or clear) the file at ``path`` for ``rows`` processes and ``slots``
        keys, all zero, its disk space allocated.

        :raises OSError: the file cannot be made (e.g. ``ENOSPC``)."""
        create_file(path, rows * slots * SLOT_CELLS * _CELL)

    def configure(self, config: Config) -> None:
        """Count the keys with limits of ``config`` (a reload). A key that keeps its
        slot keeps its counts; what a row's slot counted for another key is cleared
        when this worker first writes it."""
        keys = limited_keys(config)
        self._slot = limit_slot_map(keys, self.slots)
        self._tags = {k: _tag(*k) for k in self._slot}

    def _base(self, row: int, slot: int) -> int:
        return (row * self.slots + slot) * SLOT_CELLS

    def _counting(self, route: str, key: str) -> list[int]:
        """The first cells of the rows whose slot counts for (route, key)."""
        slot = self._slot[(route, key)]
        tag = self._tags[(route, key)]
        cells = self._cells
        stride = self.slots * SLOT_CELLS
        first = slot * SLOT_CELLS
        return [b for b in range(first, first + self.rows * stride, stride) if cells[b] == tag]

    def _own(self, route: str, key: str) -> int:
        """The first cell of this worker's slot for (route, key), claimed for it."""
        base = self._base(self.row, self._slot[(route, key)])
        tag = self._tags[(route, key)]
        cells = self._cells
        if cells[base + _TAG] != tag:
            # Cleared before the tag says whose it is: no reader counts old cells for it.
            cells[base + 1:base + SLOT_CELLS] = memoryview(bytes((SLOT_CELLS - 1) * _CELL)).cast("Q")
            cells[base + _TAG] = tag
        return base

    def _minute(self, bases: list[int], ring: int, now: float) -> int:
        """The count in the sliding minute of ring ``ring`` (``_REQUESTS`` or
        ``_TOKENS``) over the rows at ``bases``: each row's total as of its last write,
        less its buckets that have left the minute since."""
        cells = self._cells
        current = int(now)
        total = 0
        for base in bases:
            head = cells[base + _TOTAL[ring]]
            written = head >> 32
            if current - written > MINUTE:
                continue  # its whole minute has passed
            count = head & _LOW32
            for second in range(written - int(MINUTE), current - int(MINUTE)):  # counted then, no longer
                cell = cells[base + ring + second % RING]
                if cell >> 32 == second:
                    count -= cell & _LOW32
            total += max(0, count)
        return total

    def _per_second(self, bases: list[int], ring: int, now: float) -> dict[int, int]:
        """The counts of ring ``ring`` in the sliding minute per second, over the rows
        at ``bases``."""
        edge = now - LIFE  # a bucket stamped s counts while s > now - 61
        per_second: dict[int, int] = {}
        for base in bases:
            for cell in self._cells[base + ring:base + ring + RING].tolist():
                second = cell >> 32
                if second > edge:
                    per_second[second] = per_second.get(second, 0) + (cell & _LOW32)
        return per_second

    def _add(self, base: int, ring: int, now: float, count: int) -> None:
        """Count ``count`` at ``now`` in ring ``ring`` of this worker's row at ``base``,
        and its minute's total."""
        cells = self._cells
        current = int(now)
        head = cells[base + _TOTAL[ring]]
        if head >> 32 == current:
            total = head & _LOW32
        else:  # a new second: the total of the buckets in its minute, this one included
            first = current - int(MINUTE)
            total = sum(cell & _LOW32 for cell in cells[base + ring:base + ring + RING].tolist()
                        if first <= cell >> 32 <= current)
        at = base + ring + current % RING
        cells[at] = _bump(cells[at], current, 32, count)
        cells[base + _TOTAL[ring]] = (current << 32) | min(_LOW32, total + count)

    def _day(self, bases: list[int], now: float) -> int:
        today = utc_day(now)
        cells = self._cells
        return sum(cells[b + _DAY] & _LOW40 for b in bases if cells[b + _DAY] >> 40 == today)

    @staticmethod
    def _until_below(per_second: dict[int, int], total: int, limit: int, now: float) -> float:
        """Seconds until the oldest buckets have left the minute and the rest is below ``limit``."""
        for second in sorted(per_second):
            total -= per_second[second]
            if total < limit:
                return max(0.0, second + LIFE - now)
        return float(LIFE)  # not reached: the newest bucket leaves too

    def wait(self, route: str, key: str, limits: KeyLimits, now: float) -> float:
        if (route, key) not in self._slot:
            return self._alone.wait(route, key, limits, now)
        bases = self._counting(route, key)
        wait = 0.0
        if limits.tokens_per_day is not None and self._day(bases, now) >= limits.tokens_per_day:
            wait = max(wait, to_midnight(now))
        for limit, ring in ((limits.tokens_per_minute, _TOKENS), (limits.requests_per_minute, _REQUESTS)):
            if limit is not None:
                total = self._minute(bases, ring, now)
                if total >= limit:
                    per_second = self._per_second(bases, ring, now)
                    wait = max(wait, self._until_below(per_second, sum(per_second.values()), limit, now))
        return wait

    def admit(self, route: str, key: str, now: float) -> None:
        if (route, key) not in self._slot:
            self._alone.admit(route, key, now)
            return
        self._add(self._own(route, key), _REQUESTS, now, 1)

    def spend(self, route: str, key: str, tokens: int, now: float) -> None:
        if (route, key) not in self._slot:
            self._alone.spend(route, key, tokens, now)
            return
        base = self._own(route, key)
        self._add(base, _TOKENS, now, tokens)
        self._cells[base + _DAY] = _bump(self._cells[base + _DAY], utc_day(now), 40, tokens)

    def spent(self, route: str, key: str, now: float) -> Spending:
        if (route, key) not in self._slot:
            return self._alone.spent(route, key, now)
        bases = self._counting(route, key)
        if not bases:
            return Spending(0, 0, 0)
        return Spending(self._minute(bases, _REQUESTS, now), self._minute(bases, _TOKENS, now), self._day(bases, now))

    def spending(self, now: float) -> dict[tuple[str, str], Spending]:
        """(route, key) -> what every worker admitted and spent, for the keys some
        worker has counted."""
        out = self._alone.spending(now)
        for route, key in self._slot:
            bases = self._counting(route, key)
            if bases:
                out[(route, key)] = Spending(
                    self._minute(bases, _REQUESTS, now), self._minute(bases, _TOKENS, now), self._day(bases, now),
                )
        return out
