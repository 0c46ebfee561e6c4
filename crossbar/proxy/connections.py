"""Bounds on client connections and file descriptors (docs/design.md §The proxy, rule 9):
connections beyond a bound are refused at once, the listen backlog
is not Twisted's 50, and running out of descriptors is logged at most once a minute.

The bound is derived from the process's descriptor limit (``RLIMIT_NOFILE``, raised by
``LimitNOFILE=`` in the systemd unit), not configured: each client connection may hold
one upstream connection too, and the rest is kept for polls, logs and files, so
:func:`connection_limit` is ``(soft limit - RESERVED_FDS) // 2``. A connection over it
gets ``503 {"error": "too many connections"}`` with ``Retry-After: 1`` and is closed,
instead of the process running out of descriptors and failing every new client.
"""

from __future__ import annotations

import resource
from typing import Any, Callable

from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import ILogObserver, LogEvent, Logger
from zope.interface import implementer

from crossbar.errors import raw_error_answer

__all__ = [
    "EMFILE_LOG_INTERVAL", "LISTEN_BACKLOG", "RESERVED_FDS", "OverLimit", "RateLimitedAcceptErrors",
    "connection_limit", "with_backlog",
]

LISTEN_BACKLOG = 1024
"""The listen backlog crossbar asks for (Twisted's default is 50; the kernel caps it at
``net.core.somaxconn``, 4096 on current Linux): a burst of clients waits in it instead
of being refused by the kernel."""

RESERVED_FDS = 64
"""Descriptors kept out of the connection bound: the listening sockets, poll
connections, log and metrics files, Twisted's own."""

EMFILE_LOG_INTERVAL = 60.0
"""Seconds between two log lines about refused connections (EMFILE and the like)."""

_BACKLOG_TYPES = ("tcp:", "tcp6:", "ssl:", "unix:")


def connection_limit(soft_limit: int | None = None) -> int:
    """The most client connections one crossbar process keeps open at once.

    :param soft_limit: the descriptor limit (default: this process's soft
        ``RLIMIT_NOFILE``; unlimited counts as 1,048,576).
    """
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit < 0:  # RLIM_INFINITY
        soft_limit = 1 << 20
    return max(16, (soft_limit - RESERVED_FDS) // 2)


def with_backlog(listen: str, backlog: int = LISTEN_BACKLOG) -> str:
    """``listen`` (a Twisted server endpoint string) with ``backlog=`` added for the
    types that take one (``tcp:``, ``tcp6:``, ``ssl:``, ``unix:``) unless it names
    one; a ``systemd:`` socket's backlog is systemd's (``Backlog=``)."""
    if not listen.startswith(_BACKLOG_TYPES) or "backlog=" in listen:
        return listen
    return f"{listen}:backlog={backlog}"


class OverLimit(Protocol):
    """The protocol of a connection over the bound: answers 503 at once and closes."""

    def connectionMade(self) -> None:
        transport: Any = self.transport
        transport.write(raw_error_answer(503, "too many connections")[0])
        transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        pass  # the request is not read


_ACCEPT_FORMATS = ("EMFILE", "Could not accept new connection", "Re-reserving EMFILE", "Could not reserve EMFILE",
                   "Could not re-reserve EMFILE")


@implementer(ILogObserver)
class RateLimitedAcceptErrors:
    """A log observer in front of ``observer`` that passes a listening port's events
    about connections it could not accept (EMFILE, ENFILE, ENOBUFS; Twisted logs one
    per refused connection) at most once per ``interval`` seconds, as one line saying
    how many there were; every other event passes unchanged."""

    _log = Logger(namespace="crossbar.listen")

    def __init__(self, observer: Callable[[LogEvent], None], clock: IReactorTime,
                 interval: float = EMFILE_LOG_INTERVAL) -> None:
        self._observer = observer
        self._clock = clock
        self._interval = interval
        self._last: float | None = None
        self.suppressed = 0
        """Accept errors not logged since the last line."""

    def __call__(self, event: LogEvent) -> None:
        text = str(event.get("log_format", ""))
        if not text.startswith(_ACCEPT_FORMATS):
            self._observer(event)
            return
        now = self._clock.seconds()
        if self._last is not None and now - self._last < self._interval:
            self.suppressed += 1
            return
        count, self.suppressed, self._last = self.suppressed + 1, 0, now
        self._observer(dict(
            event,
            log_format="refusing connections: out of file descriptors or buffers ({count} accept errors "
                       "since the last such line; next one in {interval:.0f} s at the earliest)",
            count=count, interval=self._interval, log_namespace="crossbar.listen",
        ))
