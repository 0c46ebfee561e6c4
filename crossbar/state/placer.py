"""The commands of a route's ``placement`` (docs/design.md §Where models live, rules 4-6).

:class:`Placer` acts after each recorded poll, never on a timer of its own: it settles
the loads crossbar caused with what the poll showed (rule 1), unloads the models of the
polled host that fell idle (rule 4) and loads each ``keep_loaded`` model that no healthy
host of its route holds (rule 5). At most one command is in flight per host, bounded by
``timeouts.first_byte``; a host whose command failed gets the next one only after its
next poll (rule 6: retried at the next poll, never in a loop), and a failed or refused
unload waits another ``idle_unload`` (rule 4). A load counts as loading
from its command on, while the command is in flight too (rule 1), and as a load crossbar
caused once the host accepted it (rule 7); failures are counted (:attr:`Placer.on_failure`)
and logged by streak (:class:`~crossbar.state.placer_log.CommandLog`). Its :meth:`tick` (every
:data:`TICK` seconds) only drops the loads older than ``timeouts.first_byte`` and wakes
the requests waiting on a ``placement`` route (a spread is due after ``spread_after``,
rule 3).
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.config import one_line
from crossbar.hosts.commands import CommandFailed, ModelCommands
from crossbar.hosts.health import HostStatus
from crossbar.hosts.placement import evicted, idle_models, keep_targets, kept_ids, unlisted_keeps
from crossbar.state.placer_log import CommandLog
from crossbar.state.runtime import Runtime
from crossbar.upstream.failures import describe_failure

__all__ = ["Placer", "TICK", "command_failure"]

AGAIN_LOAD = "again after its next poll"
AGAIN_UNLOAD = "not again before another idle_unload"
"""What the log says of a failed load (rule 6) and of a failed or kept unload (rule 4)."""

TICK = 0.25
"""Seconds between two looks at the waiting requests of ``placement`` routes."""


class Placer:
    """Loads and unloads models on the router-mode hosts of ``placement`` routes.

    :param runtime: the shared state (config, health table, in-flight counts, the
        loads crossbar caused: ``runtime.placement``).
    :param commands: sends the commands (:class:`~crossbar.hosts.commands.HTTPModelCommands`).
    :param clock: the reactor (bounds the commands).
    :ivar busy: host -> its command in flight; :ivar sending: host -> that command's
        (action, model id).
    :ivar log: the streaks of failed and unseen commands, and what they log.
    :ivar on_failure: called with (host, action, failure class) for every command that
        failed (the metrics).
    """

    _log = Logger(namespace="crossbar.placement")

    def __init__(self, runtime: Runtime, commands: ModelCommands, clock: IReactorTime) -> None:
        self.runtime = runtime
        self.commands = commands
        self.clock = clock
        self.busy: dict[str, Deferred[Any]] = {}
        self.sending: dict[str, tuple[str, str]] = {}
        self._accepted: dict[tuple[str, str], float] = {}
        self.log = CommandLog()
        self.on_failure: Callable[[str, str, str], None] | None = None
        self._cooling: set[str] = set()
        self._ticks = LoopingCall(self.tick)
        self._ticks.clock = clock

    def start(self) -> None:
        """Run :meth:`tick` every :data:`TICK` s while some route has ``placement`` (after
        start-up, and again after each reload): a fleet without it pays no timer."""
        wanted = any(r.placement is not None for r in self.runtime.config.routes.values())
        self.log.forget(self.runtime.config.hosts)
        if wanted and not self._ticks.running:
            self._ticks.start(TICK, now=False)
        elif not wanted and self._ticks.running:
            self._ticks.stop()

    def polled(self, host: str, took: float, ok: bool) -> None:
        """A poll of ``host`` that took ``took`` seconds was recorded (``ok``: a good one)."""
        runtime = self.runtime
        self._cooling.discard(host)
        status = runtime.table.get(host)
        if ok and status is not None:
            health = runtime.config.health  # the others' polls show the load within a round
            started = self.clock.seconds() - took
            settled = runtime.placement.polled(
                host, status, started, health.interval + health.timeout,
                lambda h, m: runtime.inflight.host_model(h, m) or self._commanded(h, m, started))
            for model in settled.gone:
                self.log.accepted(host, "unload", model)
            for model in settled.kept:  # answered, yet still loaded: its idle time starts again (rule 4)
                self.log.failed(host, "unload", model, "the host answered it but still lists the model loaded",
                                AGAIN_UNLOAD)
                if self.on_failure is not None:
                    self.on_failure(host, "unload", "kept")
            for key in [k for k, at in self._accepted.items() if k[0] == host and at <= started]:
                del self._accepted[key]
            self.log.polled(host, status)
            self._check_keeps(host)
        self.act(host)

    def _commanded(self, host: str, model: str, started: float) -> int:
        """Rule 1: 1 while the load command for ``model`` is in flight to ``host``, or the
        host accepted it after the poll that started at ``started`` did (that poll could
        not show it loading yet); else 0. The mark still ends on the command's failure
        or after ``timeouts.first_byte``."""
        in_flight = self.sending.get(host) == ("load", model)
        return int(in_flight or self._accepted.get((host, model), float("-inf")) > started)

    def _check_keeps(self, host: str) -> None:
        """Rule 5: after a good poll of ``host``, warn of the ``keep_loaded`` models of its
        routes that no host of the route lists (once every host of it was polled)."""
        statuses = self.runtime.table.all()
        for route in self.runtime.config.routes.values():
            if route.placement is None or host not in route.hosts:
                continue
            missing = unlisted_keeps(route, statuses)
            if missing is not None:
                self.log.keep_unlisted(route.name, missing, route.placement.keep_loaded)

    def act(self, polled: str | None = None) -> None:
        """Rules 4 and 5 now: unload the idle models of ``polled`` (one command), load
        the kept models nobody holds (one command per host; each route looks after the
        loads the routes before it sent: two routes keeping one model load it once)."""
        runtime = self.runtime
        config = runtime.config
        routes = [r for r in config.routes.values() if r.placement is not None]
        if not routes:
            return
        placement = runtime.placement
        wanted = {m for r in routes if r.placement is not None for m in r.placement.keep_loaded}
        for route in routes:
            statuses = placement.overlay(runtime.table.all(), wanted)
            targets = keep_targets(route, config.hosts, statuses, set(self.busy) | self._cooling,
                                   runtime.inflight.host, runtime.inflight.host_model, placement.last_use,
                                   runtime.drained)
            for model, host in targets:
                self._send(host, "load", model, "keep")
        if polled is None or polled in self.busy or polled in self._cooling or runtime.draining:
            return  # a draining crossbar unloads nothing: a newer one may be using the models
        status = placement.overlay(runtime.table.all(), wanted).get(polled)
        if status is None or not status.healthy or not status.router or polled not in config.hosts:
            return
        idle_after = [r.placement.idle_unload for r in routes
                      if polled in r.hosts and r.placement is not None and r.placement.idle_unload is not None]
        if not idle_after:
            return
        kept = kept_ids((m for r in routes if polled in r.hosts and r.placement is not None
                         for m in r.placement.keep_loaded), [status])
        idle = [m for m in idle_models(polled, status, min(idle_after), kept, self.clock.seconds(),
                                       runtime.inflight.host_model, placement.idle_since)
                if not placement.others_unloading(polled, m) and not self._wanted(status, m)]
        if idle:
            self._claim(polled, idle[0])

    def _claim(self, name: str, model: str) -> None:
        """Rule 4: unload ``model`` on host ``name`` once this process has claimed the
        unload over the other workers or instances (only one sends it); the host takes
        no other command meanwhile."""
        claim = self.runtime.placement.claim_unload(name, model)
        self.busy[name] = claim

        def claimed(ok: bool) -> None:
            if self.busy.get(name) is not claim:
                return  # stopped meanwhile
            del self.busy[name]
            if ok:
                self._send(name, "unload", model, "idle")
                share = self.runtime.placement.share
                if share is not None and (name, model) not in self.runtime.placement.unloading:
                    share.publish_unloading(name, model, False)  # not sent (a reload removed the host): released
        claim.addCallbacks(claimed, lambda _: None)  # (cancelled by stop)

    def _wanted(self, status: HostStatus, model: str) -> bool:
        """Whether a request waiting in a queue wants ``model`` (an id of ``status``), by
        its id or an alias the host reports for it: such a model is in use, not idle
        (rule 4)."""
        waiting = self.runtime.queues.waiting_for
        return bool(waiting(model)) or any(waiting(a) for a, m in status.aliases.items() if m == model)

    def _send(self, name: str, action: str, model: str, reason: str) -> None:
        """One command to host ``name``, bounded by ``timeouts.first_byte`` (rule 6); a
        load counts as loading at once (rule 1), and as a load crossbar caused once the
        host accepted it (rule 7)."""
        runtime = self.runtime
        host = runtime.config.hosts.get(name)
        if host is None or name in self.busy:
            return
        if action == "load":
            status = runtime.placement.overlay(runtime.table.all()).get(name)
            evicts = None if status is None else evicted(name, host, status, runtime.placement.last_use)
            runtime.placement.command_started(name, model, reason, evicts)
        else:
            runtime.placement.unloading_started(name, model)
        if not self.log.quiet(name, action, model):
            self._log.info("host {host}: {action} {model} ({reason})", host=name, action=action,
                           model=one_line(model), reason=reason)
        try:
            d = self.commands.send(host, action, model)
        except Exception:
            d = Deferred()
            d.errback(Failure())
        self.busy[name] = d
        self.sending[name] = (action, model)
        bound = runtime.config.timeouts.first_byte
        d.addTimeout(bound, self.clock)
        d.addBoth(lambda result: self._done(name, d, action, model, reason, bound, result))

    def _done(self, name: str, d: Deferred[None], action: str, model: str, reason: str, bound: float,
              result: Any) -> None:
        """The command ``d`` to host ``name`` ended with ``result`` (None, or a failure
        after ``bound`` seconds at most): counted if the host accepted it, else logged
        (:class:`~crossbar.state.placer_log.CommandLog`), counted as failed and its mark
        ended; the host gets its next command after its next poll (rule 6)."""
        runtime = self.runtime
        if self.busy.get(name) is d:
            del self.busy[name]
            del self.sending[name]
        if not isinstance(result, Failure):
            if action == "load":
                self.log.accepted(name, action, model)
                self._accepted[(name, model)] = self.clock.seconds()
                runtime.placement.command_accepted(name, model, reason)
            else:
                runtime.placement.unloaded(name, model, reason)
            return
        if result.check(CancelledError):
            return  # crossbar is stopping (stop): no failure of the host's
        text, kind = command_failure(result, bound)
        self.log.failed(name, action, model, text, AGAIN_UNLOAD if action == "unload" else AGAIN_LOAD)
        if self.on_failure is not None:
            self.on_failure(name, action, kind)
        if action == "load":
            runtime.placement.drop(name, model)
        else:
            runtime.placement.unload_refused(name, model)  # not again before another idle_unload
        self._cooling.add(name)
        runtime.queues.wake()

    def tick(self) -> None:
        """Drop the loads older than ``timeouts.first_byte`` (rule 1), and let the
        requests waiting on a ``placement`` route look again (a spread may be due)."""
        runtime = self.runtime
        expired = runtime.placement.expire(runtime.config.timeouts.first_byte)
        waiting = any(r.placement is not None and runtime.queues.queued(r.name) for r in runtime.config.routes.values())
        if expired or waiting:
            runtime.queues.wake()

    def stop(self) -> None:
        """Stop the ticks and cancel the commands in flight (crossbar is stopping)."""
        if self._ticks.running:
            self._ticks.stop()
        busy, self.busy, self.sending = self.busy, {}, {}
        for d in busy.values():
            d.cancel()


def command_failure(failure: Failure, bound: float) -> tuple[str, str]:
    """(one line, class of :data:`~crossbar.hosts.commands.FAILURES`) for a failed
    command bounded by ``bound`` seconds (``timeouts.first_byte``)."""
    if failure.check(defer.TimeoutError):  # the bound cancelled it
        return f"no answer within {bound:g} s", "timeout"
    if isinstance(failure.value, CommandFailed):
        return failure.value.reason, failure.value.kind
    return describe_failure(failure), "error"
