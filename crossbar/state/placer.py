"""The commands of a route's ``placement`` (docs/design.md §Where models live, rules 4-6).

:class:`Placer` acts after each recorded poll, never on a timer of its own: it settles
the loads crossbar caused with what the poll showed (rule 1), unloads the models of the
polled host that fell idle (rule 4) and loads each ``keep_loaded`` model that no healthy
host of its route holds (rule 5). At most one command is in flight per host, bounded by
``timeouts.first_byte``; a host whose command failed gets the next one only after its
next poll (rule 6: retried at the next poll, never in a loop). Its :meth:`tick` (every
:data:`TICK` seconds) only drops the loads older than ``timeouts.first_byte`` and wakes
the requests waiting on a ``placement`` route (a spread is due after ``spread_after``,
rule 3).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.config import one_line
from crossbar.hosts.commands import CommandFailed, ModelCommands
from crossbar.hosts.placement import evicted, idle_models, keep_targets
from crossbar.state.runtime import Runtime
from crossbar.upstream.failures import describe_failure

__all__ = ["Placer", "TICK"]

TICK = 0.25
"""Seconds between two looks at the waiting requests of ``placement`` routes."""


class Placer:
    """Loads and unloads models on the router-mode hosts of ``placement`` routes.

    :param runtime: the shared state (config, health table, in-flight counts, the
        loads crossbar caused: ``runtime.placement``).
    :param commands: sends the commands (:class:`~crossbar.hosts.commands.HTTPModelCommands`).
    :param clock: the reactor (bounds the commands).
    :ivar busy: host -> its command in flight.
    """

    _log = Logger(namespace="crossbar.placement")

    def __init__(self, runtime: Runtime, commands: ModelCommands, clock: IReactorTime) -> None:
        self.runtime = runtime
        self.commands = commands
        self.clock = clock
        self.busy: dict[str, Deferred[None]] = {}
        self._cooling: set[str] = set()
        self._ticks = LoopingCall(self.tick)
        self._ticks.clock = clock

    def start(self) -> None:
        """Run :meth:`tick` every :data:`TICK` s while some route has ``placement`` (after
        start-up, and again after each reload): a fleet without it pays no timer."""
        wanted = any(r.placement is not None for r in self.runtime.config.routes.values())
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
            runtime.placement.polled(host, status, self.clock.seconds() - took, health.interval + health.timeout,
                                     runtime.inflight.host_model)
        self.act(host)

    def act(self, polled: str | None = None) -> None:
        """Rules 4 and 5 now: unload the idle models of ``polled`` (one command), load
        the kept models nobody holds (one command per host)."""
        runtime = self.runtime
        config = runtime.config
        routes = [r for r in config.routes.values() if r.placement is not None]
        if not routes:
            return
        placement = runtime.placement
        statuses = placement.overlay(runtime.table.all(), {m for r in routes if r.placement is not None
                                                           for m in r.placement.keep_loaded})
        now = self.clock.seconds()
        for route in routes:
            targets = keep_targets(route, config.hosts, statuses, set(self.busy) | self._cooling,
                                   runtime.inflight.host, runtime.inflight.host_model, placement.last_use,
                                   runtime.drained)
            for model, host in targets:
                self._send(host, "load", model, "keep")
        if polled is None or polled in self.busy or polled in self._cooling:
            return
        status = statuses.get(polled)
        if status is None or not status.healthy or not status.router or polled not in config.hosts:
            return
        idle_after = [r.placement.idle_unload for r in routes
                      if polled in r.hosts and r.placement is not None and r.placement.idle_unload is not None]
        if not idle_after:
            return
        kept = {m for r in routes if polled in r.hosts and r.placement is not None for m in r.placement.keep_loaded}
        idle = [m for m in idle_models(polled, status, min(idle_after), kept, now, runtime.inflight.host_model,
                                       placement.idle_since) if not placement.others_unloading(polled, m)]
        if idle:
            self._send(polled, "unload", idle[0], "idle")

    def _send(self, name: str, action: str, model: str, reason: str) -> None:
        """One command to host ``name``, counted and bounded (rule 6)."""
        runtime = self.runtime
        host = runtime.config.hosts.get(name)
        if host is None or name in self.busy:
            return
        if action == "load":
            status = runtime.placement.overlay(runtime.table.all()).get(name)
            evicts = None if status is None else evicted(name, host, status, runtime.placement.last_use)
            runtime.placement.started(name, model, reason, evicts)
        else:
            runtime.placement.unloading_started(name, model)
        self._log.info("host {host}: {action} {model} ({reason})", host=name, action=action, model=one_line(model),
                       reason=reason)
        try:
            d = self.commands.send(host, action, model)
        except Exception:
            d = Deferred()
            d.errback(Failure())
        self.busy[name] = d
        d.addTimeout(runtime.config.timeouts.first_byte, self.clock)

        def done(result: Any) -> None:
            if self.busy.get(name) is d:
                del self.busy[name]
            if not isinstance(result, Failure) and action == "unload":
                runtime.placement.unloaded(name, model, reason)
            if isinstance(result, Failure):
                reason_text = result.value.reason if isinstance(result.value, CommandFailed) else describe_failure(result)
                self._log.warn("host {host}: {action} {model} failed: {reason} (again after its next poll)",
                               host=name, action=action, model=one_line(model), reason=one_line(reason_text))
                if action == "load":
                    runtime.placement.drop(name, model)
                else:
                    runtime.placement.unloading_ended(name, model)
                self._cooling.add(name)
                runtime.queues.wake()

        d.addBoth(done)

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
        busy, self.busy = self.busy, {}
        for d in busy.values():
            d.cancel()
