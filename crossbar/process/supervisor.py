"""The supervisor of a crossbar with ``workers: N`` (docs/design.md §Workers).

The twistd process opens the listening sockets before it drops privileges (so ports
below 1024 work), never accepts on them, and runs N worker processes
(:mod:`crossbar.process.worker`), each accepting on its own ``SO_REUSEPORT`` socket
(:class:`~crossbar.process.listen.WorkerListeners`): the kernel spreads connections,
a burst's too, evenly over the workers. A ``systemd:`` socket (socket activation) is
one socket and stays shared by every worker. It only supervises:

- a worker that dies is restarted (after a back-off when it dies young), logged and
  counted (``crossbar_worker_restarts_total``); its in-flight counts are cleared (what
  it admitted under a key's ``limits`` keeps counting for the box, and the supervisor
  keeps its share of every counter: affinity, tokens, Redis losses). A
  worker silent for :data:`STALL` seconds (:class:`WorkerTimings`; no ``alive`` line:
  its reactor wedged, or the process stopped) is killed, and so restarted; so is one
  not ready :data:`STARTUP` seconds after it was started (a start is judged by its own
  bound: on a loaded machine it takes longer than a wedged reactor is allowed);
- SIGTERM drains every worker at once (each runs its own drain: readiness 503,
  ``drain.delay``, ``drain.grace``); a second SIGTERM or Ctrl-C ends every drain now;
- a host drained through one worker (``POST /_crossbar/hosts/<name>/drain``) is
  drained in every worker: that worker tells this process, which tells every worker and
  keeps the set for workers it starts later (and across reloads, for hosts still
  configured);
- SIGHUP re-reads the config: an invalid file is logged and nothing changes, a valid
  one is written to a snapshot and reloaded from it by every worker. Workers only ever
  load the snapshot (the text the supervisor validated last): one restarted later runs
  what the others run, whatever the file says by then;
- under systemd, ``READY=1`` once every worker is ready, ``WATCHDOG=1`` from this
  process's reactor, ``STOPPING=1`` when the drain starts: one voice for the set.

Every socket stays open in this process, so a worker that dies loses no connection:
what the kernel gave its socket meanwhile waits in the backlog for its replacement
(a second or so; up to the back-off for one that keeps dying, and up to ``stall`` for
one that is wedged: the price of an even split). A unix socket is refused with
workers: Twisted's unix port of a worker that stops unlinks the socket's path and
shuts the shared socket down for every worker.

Every worker polls every host itself: the poll load is N x 2 requests per host per
``health.interval``. How workers' log lines reach this process's log:
:mod:`crossbar.process.workerlog`; the directory of the files shared with them (counts,
limits, metrics, the config snapshot): :mod:`crossbar.process.workerfiles`.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.config import Config, ConfigError
from crossbar.state.cells import RESTARTS
from crossbar.state.worker_counts import WorkerCounts, check_capacity
from crossbar.process.reload import REFUSED, SIGHUPReload, catch_second_stop_signal, next_config
from crossbar.state.drains import HostDrains
from crossbar.state.box_limits import check_limit_room, limit_slots_for
from crossbar.ops.systemd import Notifier, SystemdNotifier, watchdog_interval
from crossbar.waiting import Condition
from crossbar.process.listen import WorkerListeners
from crossbar.process.heartbeat import HEARTBEAT, host_line, parse_host_line
from crossbar.process.workerfiles import WorkerFiles
from crossbar.process.workerlog import WorkerLog

__all__ = ["Supervisor", "WorkerTimings", "WorkerProcess", "make_supervisor"]

_log = Logger(namespace="crossbar.supervisor")

STOP_MARGIN = 15.0
"""Seconds past ``drain.delay + drain.grace`` after which a worker that has not exited
is killed."""

STALL = 30.0
"""Seconds without a line from a ready worker's reactor (it sends ``alive`` every
:data:`crossbar.process.heartbeat.HEARTBEAT`) after which the supervisor kills it."""

STARTUP = 120.0
"""Seconds a worker may take from its start to its ``ready`` line before the supervisor
kills it (its imports and config come before its reactor says anything: a start on a
loaded 2-core machine took over 30 s, and killing it only starts the same again)."""


@dataclass(frozen=True)
class WorkerTimings:
    """The supervisor's waits, in seconds; the defaults are production's.

    :ivar stall: silence after which a ready worker is killed (:data:`STALL`).
    :ivar startup: time to ``ready`` after which a starting worker is killed (:data:`STARTUP`).
    :ivar heartbeat: how often a worker says ``alive`` (:data:`~crossbar.process.heartbeat.HEARTBEAT`).
    :ivar stop_margin: :data:`STOP_MARGIN`.
    :ivar young: a worker that dies sooner after its start is restarted after a
        growing back-off (from ``first_backoff``, doubling, up to ``max_backoff``).
    """

    stall: float = STALL
    startup: float = STARTUP
    heartbeat: float = HEARTBEAT
    stop_margin: float = STOP_MARGIN
    young: float = 10.0
    first_backoff: float = 0.5
    max_backoff: float = 30.0

    @classmethod
    def with_stall(cls, stall: float) -> WorkerTimings:
        """Production's timings with ``stall`` seconds (a worker says ``alive`` six
        times a ``stall``, as in production; a start keeps production's bound)."""
        return cls(stall=stall, heartbeat=stall / 6)


class WorkerProcess(ProcessProtocol):
    """The supervisor's end of one worker: its log, its readiness, its end.

    :param supervisor: who is told when it is ready or ended.
    :param index: the worker's number (its row in the shared counts).
    """

    def __init__(self, supervisor: Supervisor, index: int) -> None:
        self.supervisor = supervisor
        self.index = index
        self.ready = False
        self.ended = False
        self.killed = False
        self.started_at = 0.0
        self.heard_at = 0.0
        """Reactor seconds of its last status line (its start, before the first)."""
        self._buffers: dict[int, bytes] = {1: b"", 2: b"", 4: b""}

    def send(self, command: str) -> None:
        """Write a command line to the worker (``drain``, ``hurry``, ``reload``)."""
        if not self.ended and self.transport is not None:
            try:
                self.transport.writeToChild(0, command.encode("ascii") + b"\n")
            except Exception:
                pass  # it is exiting

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 1:
            self._buffers[1] = self.supervisor.log.received(self._buffers[1] + data, self.index)
            return
        *lines, self._buffers[childFD] = (self._buffers.get(childFD, b"") + data).split(b"\n")
        for line in lines:
            if childFD == 2:
                if line.strip():
                    _log.warn("worker {worker}: {line}", worker=self.index, line=line.decode("utf-8", "replace"))
            elif childFD == 4:
                self.heard_at = self.supervisor.reactor.seconds()
                if line.strip() == b"ready":
                    self.ready = True
                    self.supervisor.worker_ready(self)
                else:
                    try:
                        drained = parse_host_line(line.decode("ascii"))
                    except ValueError:
                        continue
                    if drained is not None:
                        self.supervisor.drain_host(*drained)

    def processEnded(self, reason: Failure) -> None:
        rest, self._buffers[1] = self._buffers[1], b""
        self.supervisor.log.ended(rest)  # its last line, cut short
        self.ended = True
        self.ready = False
        self.supervisor.worker_ended(self, reason)


class Supervisor(MultiService):
    """Runs ``config.workers`` worker processes on one listener (see the module doc).

    :param config: the validated config (``workers`` > 1).
    :param reactor: the reactor (``IReactorProcess``).
    :param environ: where ``NOTIFY_SOCKET``/``WATCHDOG_USEC`` and
        ``RUNTIME_DIRECTORY`` (systemd's, for the state directory; else the temporary
        directory) are read (default ``os.environ``).
    :param handle_signals: install the SIGHUP handler, and during a drain the
        second-signal handler (the twistd plugin does).
    :param log_through: whether this process logs JSON lines to its standard output.
    :param text_log: whether it logs twistd's text lines (what either means for the
        workers' lines: :class:`~crossbar.process.workerlog.WorkerLog`).
    :raises ConfigError: ``listen`` is not a valid endpoint, is ``ssl:`` (a worker
        adopts a plain socket: terminate TLS in front of crossbar, or run one worker)
        or a unix socket (see the module doc), or the config needs more shared
        counters than workers have (:func:`~crossbar.state.worker_counts.check_capacity`),
        or more keys with limits than workers can count
        (:func:`~crossbar.state.box_limits.limit_slots_for`).
    """

    def __init__(
        self, config: Config, reactor: Any, environ: Mapping[str, str] | None = None, handle_signals: bool = True,
        log_through: bool = False, timings: WorkerTimings = WorkerTimings(), text_log: bool = False,
    ) -> None:
        super().__init__()
        self.timings = timings
        self.log = WorkerLog(log_through, text_log)
        """Where the workers' standard output goes (chosen at start)."""
        self._environ = os.environ if environ is None else environ

        kind = config.listen.split(":", 1)[0].lower()
        if kind == "ssl":
            raise ConfigError(config.source, "workers",
                              "an ssl: listener needs workers: 1 (or TLS terminated in front of crossbar)")
        if kind == "unix" or (kind == "systemd" and "domain=unix" in config.listen.lower()):
            raise ConfigError(config.source, "workers",
                              "a unix socket listener needs workers: 1 (or a tcp: listener for workers)")
        check_capacity(config)
        self.limit_slots = limit_slots_for(config)
        """Keys with limits the workers' shared memory has room for (fixed at start)."""
        self.config = config
        self.reactor = reactor
        self.count = config.workers
        self.workers: list[WorkerProcess | None] = [None] * self.count
        self.restarts = 0
        self._young_deaths = [0] * self.count
        self._stopping = False
        self._hurried = False
        self.files = WorkerFiles()
        """The files shared with the workers, made once the listener is open."""
        self._stall_check: LoopingCall | None = None
        self._folded: Counter[str] = Counter()  # dead workers' shares of the counter cells
        self.drains = HostDrains(lambda: self.config.hosts)
        """Hosts drained at run time (every worker is told; see :meth:`drain_host`)."""
        self.counts: WorkerCounts | None = None
        self.web = WorkerListeners(reactor, config, self.count)
        self.web.setServiceParent(self)
        self._all_ended = Condition(lambda: all(w is None or w.ended for w in self.workers))
        self._all_ready = Condition(lambda: all(w is not None and w.ready for w in self.workers))
        self.systemd: SystemdNotifier | None = None
        notifier = Notifier.from_environment(environ)
        if notifier is not None:
            self.systemd = SystemdNotifier(
                notifier, reactor, ready=lambda: self._all_ready.wait(),  # type: ignore[arg-type,return-value]
                healthy=lambda: {str(i): bool(w and w.ready) for i, w in enumerate(self.workers)},
                watchdog=watchdog_interval(environ), noun="workers ready",
            )
            self.systemd.setServiceParent(self)
        self._handle_signals = handle_signals
        if handle_signals:
            SIGHUPReload(self.reload, reactor).setServiceParent(self)

    # -- start -----------------------------------------------------------------------

    def startService(self) -> None:
        self.log.choose()
        super().startService()
        # systemd's RuntimeDirectory= (contrib/systemd): never aged out by tmp cleaners
        runtime = self._environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None
        shared = self.files.make(self.config, runtime, self.count + 1, self.limit_slots)
        self.counts = WorkerCounts(shared, self.config)
        for index in range(self.count):
            self._spawn(index)
        self._stall_check = LoopingCall.withCount(self._kill_stalled)
        self._stall_check.clock = self.reactor
        self._stall_check.start(self.timings.stall / 6, now=False)

    def _kill_stalled(self, intervals: int) -> None:
        """Kill every ready worker silent for ``timings.stall`` seconds, and every
        starting one not ready ``timings.startup`` seconds after its start (it is then
        restarted).

        ``intervals``: check periods since the last check. More than one: this process
        was not running either (a loaded machine, a paused VM) and has not read what
        workers sent meanwhile, so nobody is judged until the next check."""
        if intervals > 1:
            return
        now = self.reactor.seconds()
        for process in self.workers:
            if process is None or process.ended or process.killed:
                continue
            if process.ready and now - process.heard_at >= self.timings.stall:
                _log.error("worker {worker} sent nothing for {seconds:.0f}s (wedged or stopped): killing it",
                           worker=process.index, seconds=now - process.heard_at)
            elif not process.ready and now - process.started_at >= self.timings.startup:
                _log.error("worker {worker} not ready {seconds:.0f}s after its start (wedged or stopped): "
                           "killing it", worker=process.index, seconds=now - process.started_at)
            else:
                continue
            process.killed = True
            try:
                process.transport.signalProcess("KILL")  # type: ignore[union-attr]
            except Exception:
                pass  # it has just exited

    def _spawn(self, index: int) -> None:
        if self._stopping or not self.web.running:
            return
        process = WorkerProcess(self, index)
        process.started_at = process.heard_at = self.reactor.seconds()
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # the supervisor speaks for the set
        env["PROMETHEUS_MULTIPROC_DIR"] = self.files.metrics
        argv = [
            sys.executable, "-m", "crossbar.process.worker", "--config", self.config.source,
            "--snapshot", self.files.snapshot,
            "--row", str(index), "--rows", str(self.count + 1), "--shared", self.files.counts,
            "--limits", self.files.limits,
            "--heartbeat", str(self.timings.heartbeat),
            "--log", self.log.mode,
        ] + (["--shared-listener"] if self.web.shared else [])
        try:
            self.reactor.spawnProcess(
                process, sys.executable, argv, env=env,
                childFDs={0: "w", 1: self.log.stdout, 2: "r", 3: self.web.fileno(index), 4: "r"},
            )
        except Exception as e:  # e.g. the interpreter gone after an upgrade, no file descriptors left
            self.workers[index] = None
            delay = self._backoff(index, young=True)
            _log.error("worker {worker} could not be started ({error}); trying again in {delay}s",
                       worker=index, error=f"{type(e).__name__}: {e}", delay=delay)
            self.reactor.callLater(delay, self._spawn, index)
            return
        self.workers[index] = process
        _log.info("worker {worker} started (pid {pid})", worker=index, pid=process.transport.pid)  # type: ignore[union-attr]
        for host in sorted(self.drains.drained):  # read once its reactor runs
            process.send(host_line(host, True))

    def drain_host(self, host: str, draining: bool) -> None:
        """A worker drained (or undrained) ``host``: every worker does, and workers
        started later are told (docs/design.md §Operations)."""
        if not self.drains.set(host, draining):
            return
        _log.info("host {host} {what} in every worker", host=host, what="drained" if draining else "undrained")
        for process in self.workers:
            if process is not None:
                process.send(host_line(host, draining))

    def _backoff(self, index: int, young: bool) -> float:
        """Seconds before worker ``index`` is started again: 0 after a long life, then
        0.5, 1, 2 ... up to 30 (``timings``) for one that keeps dying young."""
        self._young_deaths[index] = self._young_deaths[index] + 1 if young else 0
        timings = self.timings
        return min(timings.max_backoff, timings.first_backoff * 2 ** (self._young_deaths[index] - 1)) if young else 0.0

    def worker_ready(self, process: WorkerProcess) -> None:
        """A worker listens and has polled every host once."""
        _log.info("worker {worker} is ready", worker=process.index)
        self._young_deaths[process.index] = 0 if self.reactor.seconds() - process.started_at > self.timings.young else \
            self._young_deaths[process.index]
        self._all_ready.check()
        if self.systemd is not None:
            self.systemd.health_changed()

    def worker_ended(self, process: WorkerProcess, reason: Failure) -> None:
        """A worker exited: counted and restarted unless crossbar is stopping."""
        index = process.index
        if self.counts is not None:
            # Its counters (affinity outcomes, token totals, Redis losses): this process
            # keeps its share (they must never go down); the rest of its row (in flight,
            # waiting) is gone with it.
            for name in self.counts.counter_cells():
                self._folded[name] += self.counts.of_row(name, index)
            self.counts.shared.clear_row(index)
            self._publish_own()
        self._all_ended.check()
        if self.systemd is not None:
            self.systemd.health_changed()
        if self._stopping or self.workers[index] is not process:
            return
        self.restarts += 1
        self._publish_own()
        delay = self._backoff(index, young=self.reactor.seconds() - process.started_at < self.timings.young)
        _log.warn("worker {worker} died ({reason}); restarting it in {delay}s (restarts: {restarts})",
                  worker=index, reason=reason.getErrorMessage(), delay=delay, restarts=self.restarts)
        self.reactor.callLater(delay, self._spawn, index)

    def _publish_own(self) -> None:
        """This process's row: restarts, and the counters of dead workers."""
        if self.counts is not None:
            self.counts.publish(RESTARTS.cell(), self.restarts)
            for name, count in self._folded.items():
                self.counts.publish(name, count)

    # -- stop --------------------------------------------------------------------------

    def stopService(self) -> Deferred[Any]:
        """Drain every worker at once and wait for them to exit (killing any still
        running ``drain.delay + drain.grace`` + ``timings.stop_margin`` seconds later),
        then close the listener."""
        self._stopping = True
        if self._stall_check is not None and self._stall_check.running:
            self._stall_check.stop()
        if self.systemd is not None:
            self.systemd.draining()
        self._catch_second_signal()
        for process in self.workers:
            if process is not None:
                process.send("drain")
        drain = self.config.drain
        waited = self._all_ended.wait()
        waited.addTimeout(drain.delay + drain.grace + self.timings.stop_margin, self.reactor)
        waited.addErrback(self._kill_stragglers)
        waited.addBoth(lambda _: super(Supervisor, self).stopService())
        waited.addBoth(self._clean_up)
        return waited

    def _kill_stragglers(self, failure: Failure) -> None:
        failure.trap(TimeoutError)
        for process in self.workers:
            if process is not None and not process.ended:
                _log.warn("worker {worker} did not stop in time: killing it", worker=process.index)
                try:
                    process.transport.signalProcess("KILL")  # type: ignore[union-attr]
                except Exception:
                    pass

    def _clean_up(self, result: object) -> object:
        if self.systemd is not None:
            self.systemd.notifier.close()
        self.files.remove()
        return result

    def hurry(self) -> None:
        """A second stop signal: every worker ends its drain now."""
        if self._hurried:
            return
        self._hurried = True
        _log.warn("second stop signal: workers end their drain now")
        for process in self.workers:
            if process is not None:
                process.send("hurry")

    def _catch_second_signal(self) -> None:
        if self._handle_signals:
            catch_second_stop_signal(self.reactor, self.hurry)

    # -- reload --------------------------------------------------------------------------

    def reload(self) -> bool:
        """SIGHUP: validate the file here (:func:`~crossbar.process.reload.next_config`,
        with room in the shared counters and for its keys with limits), then have every
        worker reload it from the snapshot."""
        new = next_config(self.config, self.reactor, _log, check=self._check_room)
        if new is None:
            return False
        try:
            self.files.write_snapshot(new)
        except OSError as e:
            _log.error(REFUSED, error=f"cannot write the workers' snapshot: {e.strerror or e}")
            return False
        self.config = new
        self.drains.forget_removed()
        if self.counts is not None:
            self.counts.configure(self.config)
            self._publish_own()
        for process in self.workers:
            if process is not None:
                process.send("reload")
        return True

    def _check_room(self, config: Config) -> None:
        """``config`` fits the workers' shared memory (made at start).

        :raises ConfigError: it does not."""
        check_capacity(config)
        check_limit_room(config, self.limit_slots)

    def when_all_ready(self) -> Deferred[None]:
        """Fires once every worker has said it is ready."""
        return self._all_ready.wait()


def make_supervisor(
    config: Config, reactor: Any = None, handle_signals: bool = True, log_through: bool = False,
    timings: WorkerTimings = WorkerTimings(), text_log: bool = False,
) -> Supervisor:
    """The supervisor for ``config`` on ``reactor`` (default: the global one); see
    :class:`Supervisor` for ``log_through``, ``timings`` and ``text_log``."""
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
    return Supervisor(config, reactor, handle_signals=handle_signals, log_through=log_through, timings=timings,
                      text_log=text_log)
