"""The lines a supervisor and its workers exchange (docs/design.md §Workers).

Shared by :mod:`crossbar.process.supervisor` and :mod:`crossbar.process.worker`, so
neither imports the other. A worker reads commands on fd 0 and writes its status on
:data:`STATUS_FD`, one ASCII line each:

- commands: ``drain``, ``hurry``, ``reload``, and :func:`host_line`;
- status: ``ready``, ``alive`` every :data:`HEARTBEAT` seconds, and :func:`host_line`
  when this worker was asked to drain or undrain a host.
"""

from __future__ import annotations

__all__ = ["HEARTBEAT", "LISTEN_FD", "STATUS_FD", "host_line", "parse_host_line"]

LISTEN_FD = 3
"""The worker's listening socket, opened by the supervisor."""

STATUS_FD = 4
"""Where a worker writes its status lines."""

HEARTBEAT = 5.0
"""Seconds between a worker's ``alive`` lines."""

_DRAIN, _UNDRAIN = "host-drain", "host-undrain"


def host_line(host: str, draining: bool) -> str:
    """The line that drains (or undrains) ``host``: ``host-drain HEX`` or
    ``host-undrain HEX``, the name's UTF-8 in hex (any name fits one ASCII line)."""
    return f"{_DRAIN if draining else _UNDRAIN} {host.encode('utf-8').hex()}"


def parse_host_line(line: str) -> tuple[str, bool] | None:
    """``(host, draining)`` of a :func:`host_line` (surrounding blanks ignored); None
    for any other line.

    :raises ValueError: a host line whose name is not hex of UTF-8.
    """
    verb, _, encoded = line.strip().partition(" ")
    if verb not in (_DRAIN, _UNDRAIN):
        return None
    return bytes.fromhex(encoded).decode("utf-8"), verb == _DRAIN
