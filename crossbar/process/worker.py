"""One worker process of a crossbar with ``workers: N`` (docs/design.md §Workers).

The supervisor (:mod:`crossbar.process.supervisor`) starts each worker as
``python -m crossbar.process.worker --config FILE --snapshot SNAPSHOT --row I --rows N+1
--shared PATH --limits PATH --heartbeat SECONDS [--shared-listener]`` with:

- ``SNAPSHOT``: the config text the supervisor validated last (``FILE`` only names it
  in messages and anchors relative ``tls`` paths): a worker started or reloaded later
  runs what the supervisor accepted, never a file edited since without a SIGHUP;

- fd 3: the listening socket the supervisor opened for it (the worker adopts it with
  ``reactor.adoptStreamPort``): its own ``SO_REUSEPORT`` socket for a TCP listener, or
  with ``--shared-listener`` (a ``systemd:`` socket) the one every worker accepts on
  (:class:`~crossbar.process.listen.WorkerListeners`);
- fd 0: commands from the supervisor, one per line: ``drain`` (SIGTERM's drain),
  ``hurry`` (a second signal: end the drain now), ``reload`` (SIGHUP: load the
  snapshot again), ``host-drain HEX`` / ``host-undrain HEX`` (a host, its name's
  UTF-8 in hex, is drained or undrained in every worker). End of file
  (the supervisor is gone) drains too;
- fd 1: its log, one JSON object per line (:mod:`crossbar.ops.jsonlog`) with a ``worker``
  field: the supervisor's own standard output when it logs JSON there too (written
  straight through, nothing relayed), else a pipe whose lines the supervisor logs as
  its own. With ``--log text``: twistd's text lines, as the supervisor's text log
  shows them (``[namespace#level worker=N]``), to the supervisor's own standard output
  (its text log); with ``--log batched-text`` to a pipe whose bytes the supervisor
  appends to its log file unread, in batches (:class:`BatchedLines`: a warning or worse
  at once, the rest within 50 ms) (nothing is decoded and logged again per line);
- fd 4: ``ready`` once the worker listens and its first poll round is done, and
  ``alive`` every ``--heartbeat`` seconds (:data:`HEARTBEAT` in production) from its
  reactor (a worker whose reactor is wedged or stopped goes silent, and the supervisor
  replaces it); ``host-drain HEX`` / ``host-undrain HEX`` when this worker was asked to
  drain a host (``POST /_crossbar/hosts/<name>/drain``): the supervisor tells every
  worker, and keeps the set for the workers it starts later.

Signals sent to a worker itself: SIGTERM or SIGINT drain it (the same drain as the
``drain`` command: both together are one drain, as under systemd's
``KillMode=control-group``; only ``hurry`` ends a drain early); SIGHUP reloads this
worker alone (from the snapshot too).

Each worker is a whole :class:`~crossbar.process.service.CrossbarService` (poller, proxy,
operations) whose counts are published to, and read from, the shared counters
(:class:`~crossbar.state.worker_counts.WorkerCounts`), and whose client keys' limits are
counted in the ``--limits`` file (:class:`~crossbar.state.box_limits.BoxLimits`). Workers run in their own process group, so a Ctrl-C
at a terminal reaches the supervisor only, which tells each worker once.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import socket
import sys
from types import FrameType
from typing import IO, Any, Callable, cast

from twisted.internet import fdesc
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ReactorNotRunning
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IReadDescriptor, IStreamServerEndpoint
from twisted.internet.main import CONNECTION_DONE
from twisted.internet.task import LoopingCall
from twisted.logger import ILogObserver, Logger, LogLevel, globalLogBeginner, textFileLogObserver
from zope.interface import implementer

from crossbar.config import ConfigError, one_line, parse_config, read_config_text
from crossbar.process.heartbeat import HEARTBEAT, LISTEN_FD, STATUS_FD, host_line, parse_host_line
from crossbar.process.reload import SIGHUPReload
from crossbar.process.service import CrossbarService
from crossbar.state.box_limits import BoxLimits
from crossbar.state.shared import SharedCounts
from crossbar.state.worker_counts import WorkerCounts
from crossbar.compat.twisted import cache_log_timestamps, lean_dispatch

__all__ = ["AdoptedEndpoint", "BatchedLines", "json_observer", "main", "text_observer"]


_log = Logger(namespace="crossbar.worker")


@implementer(IStreamServerEndpoint)
class AdoptedEndpoint:
    """A server endpoint for a listening socket opened by another process.

    :param reactor: provides ``IReactorSocket.adoptStreamPort``.
    :param fd: the listening socket's file descriptor (its family is read from it).
    :param shared: other processes accept on the same socket.
    """

    def __init__(self, reactor: Any, fd: int, shared: bool = False) -> None:
        self._reactor = reactor
        self._fd = fd
        self._shared = shared

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        probe = socket.socket(fileno=self._fd)
        family = probe.family
        probe.detach()  # the fd stays open: the port adopts (a copy of) it
        fdesc.setNonBlocking(self._fd)  # as adoptStreamPort requires: accept until EAGAIN
        port = self._reactor.adoptStreamPort(self._fd, family, protocolFactory)
        # On a shared socket every worker is woken for a new connection; one accept each
        # per wake-up (not Twisted's default of up to 100) spreads a burst over the
        # workers a little. A socket of its own keeps Twisted's default.
        if self._shared and hasattr(port, "numberAccepts"):
            port.numberAccepts = 1
        return succeed(port)


@implementer(IReadDescriptor)
class _Commands:
    """Reads command lines on ``fd`` and calls ``handle(command)``; ``handle("eof")``
    when the supervisor closes it."""

    def __init__(self, fd: int, handle: Callable[[str], None]) -> None:
        self._fd = fd
        self._handle = handle
        self._buffer = b""
        fdesc.setNonBlocking(fd)

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "crossbar-worker-commands"

    def doRead(self) -> Any:
        try:
            data = os.read(self._fd, 4096)
        except BlockingIOError:
            return None
        except OSError:
            return CONNECTION_DONE
        if not data:
            return CONNECTION_DONE
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._handle(line.decode("ascii", "replace").strip())
        return None

    def connectionLost(self, reason: Any) -> None:
        self._handle("eof")


def json_observer(row: int, out: IO[str] | None = None) -> ILogObserver:
    """JSON lines (:mod:`crossbar.ops.jsonlog`) on ``out`` (default: standard output),
    each with ``"worker": row``."""
    from crossbar.ops import jsonlog

    write = jsonlog.observer_to(sys.stdout if out is None else out)

    @implementer(ILogObserver)
    def tagged(event: dict[str, Any]) -> None:  # every line says which worker wrote it
        event["worker"] = row
        write(event)

    return tagged


class BatchedLines:
    """A text file for a :class:`~twisted.logger.FileLogObserver` that writes the lines
    it is given to ``out`` together: ``delay`` seconds after the first of a batch (on
    ``clock``), or at once when ``most`` characters wait, or on :meth:`write_now`. The
    observer's ``flush`` after each line does nothing: fewer writes, and the supervisor
    that appends them to its log file wakes up once a batch instead of once a request."""

    def __init__(self, out: IO[str], clock: Any, delay: float = 0.05, most: int = 32768) -> None:
        self._out = out
        self._clock = clock
        self._delay = delay
        self._most = most
        self._parts: list[str] = []
        self._size = 0
        self._call: Any = None

    def write(self, text: str) -> None:
        self._parts.append(text)
        self._size += len(text)
        if self._size >= self._most:
            self.write_now()
        elif self._call is None:
            self._call = self._clock.callLater(self._delay, self.write_now)

    def flush(self) -> None:
        """Nothing: the batch is written when it is due."""

    def write_now(self) -> None:
        """Write what waits (the reactor's shutdown and an exit do too)."""
        if self._call is not None:
            if self._call.active():
                self._call.cancel()
            self._call = None
        if self._parts:
            text, self._parts, self._size = "".join(self._parts), [], 0
            try:
                self._out.write(text)
                self._out.flush()
            except (OSError, ValueError):
                pass  # the supervisor is gone: nobody reads it


def text_observer(row: int, out: IO[str] | None = None, batch: BatchedLines | None = None) -> ILogObserver:
    """twistd's text lines on ``out`` (default: standard output), each as the
    supervisor's text log shows a worker's line: ``[namespace#level worker=N]``, or a
    legacy event's ``[system worker=N]`` (its time stamp formatted once a second,
    touchpoint 6). With ``batch`` (writing to ``out``), lines are written in batches;
    a warning or worse at once, with what waits before it."""
    cache_log_timestamps()
    write = textFileLogObserver(cast(IO[str], batch) if batch is not None else sys.stdout if out is None else out)
    tag = f" worker={row}"
    urgent = frozenset({LogLevel.warn, LogLevel.error, LogLevel.critical})

    @implementer(ILogObserver)
    def tagged(event: dict[str, Any]) -> None:
        event["worker"] = row
        system = event.get("log_system")
        if system is None:
            level = event.get("log_level")
            event["log_system"] = f"{event.get('log_namespace', '-')}#{'-' if level is None else level.name}{tag}"
        else:
            event["log_system"] = f"{one_line(str(system))}{tag}"
        write(event)
        if batch is not None and event.get("log_level") in urgent:
            batch.write_now()

    return tagged


def main(argv: list[str] | None = None) -> None:
    """Run one worker until it is told to drain (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m crossbar.process.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the config file's path (messages, relative tls paths)")
    parser.add_argument("--snapshot", required=True, help="the config text the supervisor validated")
    parser.add_argument("--row", type=int, required=True, help="this worker's row in the shared counters")
    parser.add_argument("--rows", type=int, required=True, help="rows in the shared counters")
    parser.add_argument("--shared", required=True, help="the shared counters' file")
    parser.add_argument("--limits", help="the key limits' shared file (without: limits per worker)")
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT, help="seconds between 'alive' lines")
    parser.add_argument("--shared-listener", action="store_true", help="fd 3 is shared with the other workers")
    parser.add_argument("--log", choices=("json", "text", "batched-text"), default="json",
                        help="fd 1 gets JSON lines (default) or twistd's text lines (each at once, or in batches)")
    args = parser.parse_args(argv)
    os.setpgrp()  # a terminal's Ctrl-C goes to the supervisor, which tells us once

    from twisted.internet import reactor as global_reactor

    reactor: Any = global_reactor  # the running reactor: posix, with threads and signals
    batch = BatchedLines(sys.stdout, reactor) if args.log == "batched-text" else None
    if batch is not None:
        atexit.register(batch.write_now)
        reactor.addSystemEventTrigger("after", "shutdown", batch.write_now)
    globalLogBeginner.beginLoggingTo(
        [json_observer(args.row) if args.log == "json" else text_observer(args.row, batch=batch)],
        redirectStandardIO=False)

    try:
        # The supervisor validated this text and logged its warnings once for every worker.
        config = parse_config(read_config_text(args.snapshot), args.config)
        limits = BoxLimits(args.limits, args.rows, args.row, config) if args.limits else None
        counts = WorkerCounts(SharedCounts(args.shared, args.rows, args.row), config, limits)
    except (ConfigError, OSError, ValueError) as e:
        _log.critical("worker cannot start: {error}", error=str(e))
        raise SystemExit(1) from None
    # Signals are the worker's own (not the service's): SIGTERM/SIGINT are the drain,
    # never the "second signal" that ends it (only the supervisor's ``hurry`` does), so
    # systemd's KillMode=control-group (SIGTERM to every process) plus the supervisor's
    # ``drain`` command make one drain, not an aborted one.
    service = CrossbarService(
        config, reactor, environ={}, handle_signals=False,
        listen=AdoptedEndpoint(reactor, LISTEN_FD, shared=args.shared_listener), worker_counts=counts,
    )

    def reload() -> bool:
        try:
            text = read_config_text(args.snapshot)
        except ConfigError as e:
            _log.error("reload refused, keeping the running config: {error}", error=str(e))
            return False
        return service.reload(text=text, said=True)  # the supervisor warned once for every worker

    SIGHUPReload(reload, reactor).setServiceParent(service)

    def drain() -> None:
        try:
            reactor.stop()  # the drain is stopService
        except ReactorNotRunning:
            pass  # already draining: a signal and the supervisor's command are one drain

    def command(name: str) -> None:
        if name in ("drain", "eof"):
            drain()
        elif name == "hurry":
            service.hurry()
        elif name == "reload":
            reload()
        elif name:
            try:
                drained = parse_host_line(name)
            except ValueError:
                _log.warn("bad supervisor command {command!r}", command=name)
                return
            if drained is None:
                _log.warn("unknown supervisor command {command!r}", command=name)
            else:
                service.runtime.drain_host(*drained, tell=False)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        reactor.callFromThread(drain)

    def status(line: bytes) -> None:
        try:
            os.write(STATUS_FD, line)
        except OSError:
            pass  # no supervisor listening (run by hand)

    def ready(_: object) -> None:
        status(b"ready\n")

    def drain_changed(host: str, draining: bool) -> None:
        status(host_line(host, draining).encode("ascii") + b"\n")

    service.runtime.on_drain_change = drain_changed

    heartbeat = LoopingCall(status, b"alive\n")
    heartbeat.clock = reactor

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    reactor.addReader(_Commands(0, command))
    def start() -> None:
        try:
            service.startService()
        except Exception:
            # A worker that cannot listen or start serves nobody: exit, and the
            # supervisor starts another (with a back-off if this keeps happening).
            _log.failure("worker cannot start")
            if batch is not None:
                batch.write_now()
            os._exit(1)

    reactor.callWhenRunning(start)
    reactor.callWhenRunning(heartbeat.start, args.heartbeat)
    lean_dispatch(reactor)  # no log.callWithLogger layers per ready descriptor
    reactor.callWhenRunning(lambda: service.when_ready().addCallbacks(ready, lambda f: None))
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    reactor.run(installSignalHandlers=False)


if __name__ == "__main__":
    main()
