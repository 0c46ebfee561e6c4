"""The running state of one crossbar: one source of truth for each runtime fact.

- the current :class:`~crossbar.config.Config`, one reference that a reload swaps (a
  request keeps the config it started with, so it is served under one config);
- the health table (and with it readiness: every host's first poll is in the table);
- requests in flight per host (:class:`~crossbar.inflight.Inflight`), read by status,
  metrics and choosing alike;
- the requests crossbar is handling (for the drain) and whether it is draining.

Status, metrics, readiness, systemd and the proxy all read these; nothing copies them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from crossbar.balance import Rotation
from crossbar.config import Config, Route
from crossbar.health import HealthTable
from crossbar.inflight import Inflight
from crossbar.queue import RouteQueues
from crossbar.waiting import Condition

__all__ = ["Runtime"]


class Runtime:
    """The facts crossbar's parts share (see the module docstring).

    :param config: the config to start with.
    :param now: POSIX seconds (``reactor.seconds``), for the health table.
    :ivar config: the current config; assign a new one to reload.
    :ivar table: the health table.
    :ivar inflight: requests in flight per host; a release wakes the queues.
    :ivar queues: the requests waiting for a host with room, per route.
    :ivar rotation: where round-robin among exact ties stands, per route.
    :ivar affinity_counts: (route, ``home``/``spill``/``none``) -> requests dispatched.
    :ivar key_inflight: (route, client key name) -> requests in flight or waiting.
    :ivar active: the requests being handled (proxy exchanges), until each ends.
    :ivar draining: a drain has started (DESIGN.md §Operations).
    :ivar idle: a :class:`Condition` that holds while no request is being handled.
    """

    def __init__(self, config: Config, now: Callable[[], float]) -> None:
        self.config = config
        health = config.health
        self.table = HealthTable(config.hosts, health.recovery_polls, health.failure_threshold, now)
        self.queues = RouteQueues(now)
        self.inflight = Inflight(on_release=self.queues.wake)
        self.rotation = Rotation()
        self.affinity_counts: Counter[tuple[str, str]] = Counter()
        self.key_inflight: Counter[tuple[str, str]] = Counter()
        self.active: set[Any] = set()
        self.draining = False
        self.idle = Condition(lambda: not self.active)

    def first_round_done(self) -> bool:
        """Every configured host's first poll has finished (or timed out)."""
        return all(s.polled for s in self.table.all().values())

    @property
    def ready(self) -> bool:
        """Readiness (DESIGN.md §Operations): every host's first poll is done, some
        host is healthy, and crossbar is not draining."""
        if self.draining:
            return False
        statuses = self.table.all().values()
        return all(s.polled for s in statuses) and any(s.healthy for s in statuses)

    def key_admits(self, route: Route, key: str) -> bool:
        """Whether a request with client key ``key`` of ``route`` may start: the key has
        fewer than its ``max_inflight`` requests in flight or waiting (DESIGN.md §Access;
        429 otherwise)."""
        settings = route.keys.get(key)
        limit = settings.max_inflight if settings is not None else None
        return limit is None or self.key_inflight[(route.name, key)] < limit

    def begin(self, exchange: Any) -> None:
        """``exchange`` is being handled (the drain waits for it; its key counts)."""
        self.active.add(exchange)
        if exchange.key:
            self.key_inflight[(exchange.route_name, exchange.key)] += 1

    def end(self, exchange: Any) -> None:
        """``exchange`` is over."""
        if exchange in self.active:
            self.active.discard(exchange)
            if exchange.key:
                self.key_inflight[(exchange.route_name, exchange.key)] -= 1
        self.idle.check()
