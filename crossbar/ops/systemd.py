"""systemd service notification (docs/design.md §Operations): ``READY=1``, ``WATCHDOG=1``,
``STOPPING=1`` and ``STATUS=`` over ``$NOTIFY_SOCKET``.

The protocol (``sd_notify(3)``) is one datagram of newline-separated ``KEY=value``
assignments sent to the ``AF_UNIX`` datagram socket named by ``$NOTIFY_SOCKET``; a name
starting with ``@`` is in the abstract namespace. It is small enough to speak directly:
:class:`Notifier` sends with a non-blocking stdlib socket (never blocking the reactor;
a datagram that cannot be sent at once is dropped and logged, as ``sd_notify`` would
fail). No PyPI package was a better fit: ``systemd-python`` needs libsystemd's C
headers, ``sdnotify`` has had no release since 2017 and blocks.

:class:`SystemdNotifier` is the service that says when: ``READY=1`` once the web
service listens and the first poll round is done, ``WATCHDOG=1`` from a reactor
``LoopingCall`` every half ``$WATCHDOG_USEC`` (so a wedged reactor gets the process
restarted), ``STOPPING=1`` when the drain starts, and ``STATUS=`` with the number of
healthy hosts whenever it changes.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Mapping

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

__all__ = ["Notifier", "SystemdNotifier", "watchdog_interval"]

_log = Logger(namespace="crossbar.systemd")


class Notifier:
    """Sends ``sd_notify`` datagrams to ``address`` (``$NOTIFY_SOCKET``).

    :param address: a filesystem path, or ``@name`` for the abstract namespace.
    """

    def __init__(self, address: str) -> None:
        if not address or address[0] not in "/@":
            raise ValueError(f"NOTIFY_SOCKET must be an absolute path or start with '@', not {address!r}")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Notifier | None:
        """A notifier for ``$NOTIFY_SOCKET``, or None when it is unset or empty."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if not address:
            return None
        return cls(address)

    def notify(self, **fields: str) -> bool:
        """Send one datagram of ``KEY=value`` lines (keys upper-case as given), e.g.
        ``notify(READY="1", STATUS="2/2 hosts healthy")``. Newlines in values are
        replaced by spaces. Returns whether the datagram was sent; never raises."""
        lines = [f"{key}={' '.join(str(value).splitlines())}" for key, value in fields.items()]
        try:
            self._sock.sendto("\n".join(lines).encode("utf-8"), self.address)
        except OSError as e:
            _log.warn("sd_notify to {address} failed: {error}", address=self.address.replace("\0", "@"), error=e)
            return False
        return True

    def close(self) -> None:
        self._sock.close()


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, or None when
    the watchdog is off (unset, not a positive integer, or ``$WATCHDOG_PID`` names
    another process)."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    watchdog_pid = env.get("WATCHDOG_PID", "")
    if watchdog_pid and watchdog_pid != str(os.getpid() if pid is None else pid):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    return value / 2 / 1_000_000


class SystemdNotifier(Service):
    """Tells systemd how crossbar is doing (see the module docstring).

    :param notifier: where datagrams go.
    :param clock: the reactor (the watchdog runs on it).
    :param ready: fires when crossbar is listening and its first poll round is done.
    :param healthy: host name -> healthy, read for ``STATUS=`` lines.
    :param noun: what ``healthy`` counts, for those lines (the supervisor counts
        ``workers ready``).
    :param watchdog: seconds between ``WATCHDOG=1`` pings, or None for no watchdog.
    """

    def __init__(
        self,
        notifier: Notifier,
        clock: IReactorTime,
        ready: Callable[[], Deferred[object]],
        healthy: Callable[[], Mapping[str, bool]],
        watchdog: float | None,
        noun: str = "hosts healthy",
    ) -> None:
        self.noun = noun
        self.notifier = notifier
        self.clock = clock
        self._ready = ready
        self._healthy = healthy
        self.watchdog = watchdog
        self._loop: LoopingCall | None = None
        self._waiting: Deferred[object] | None = None
        self._last_status: str | None = None
        self.is_ready = False
        self.stopping = False

    def status_line(self) -> str:
        """The ``STATUS=`` text, e.g. ``serving; 2/3 hosts healthy``."""
        healthy = self._healthy()
        up = sum(1 for ok in healthy.values() if ok)
        state = "draining" if self.stopping else ("serving" if self.is_ready else "starting")
        return f"{state}; {up}/{len(healthy)} {self.noun}"

    def startService(self) -> None:
        super().startService()
        if self.watchdog is not None:
            loop = LoopingCall(self.notifier.notify, WATCHDOG="1")
            loop.clock = self.clock
            self._loop = loop
            loop.start(self.watchdog, now=True)
        self._send_status()
        waiting = self._ready()
        self._waiting = waiting
        waiting.addCallbacks(self._on_ready, lambda f: None)

    def _on_ready(self, _: object) -> None:
        self._waiting = None
        if not self.running or self.stopping:
            return
        self.is_ready = True
        status = self.status_line()
        self._last_status = status
        self.notifier.notify(READY="1", STATUS=status, MAINPID=str(os.getpid()))

    def _send_status(self) -> None:
        status = self.status_line()
        if status != self._last_status:
            self._last_status = status
            self.notifier.notify(STATUS=status)

    def health_changed(self) -> None:
        """Send a ``STATUS=`` line if the healthy-host count changed (call after polls)."""
        if self.running:
            self._send_status()

    def draining(self) -> None:
        """The drain started: ``STOPPING=1``."""
        if self.stopping:
            return
        self.stopping = True
        status = self.status_line()
        self._last_status = status
        self.notifier.notify(STOPPING="1", STATUS=status)

    def stopService(self) -> Deferred[object] | None:
        super().stopService()
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            waiting.cancel()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        return None
