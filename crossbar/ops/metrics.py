"""Prometheus metrics (docs/design.md §Operations), on a registry of crossbar's own.

Every crossbar service owns one :class:`Metrics`; nothing is registered globally, so
several crossbars (tests) can live in one process. Counters and histograms are updated
as things happen (by :class:`~crossbar.ops.record.RequestLog`, the poller, mark-downs);
live values -- requests in flight, host health, models loaded -- are read at scrape
time by :class:`LiveCollector` from the same objects status and choosing read, so no
gauge is ever set by hand and none can drift.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Collection, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from crossbar.compat.prometheus import adder, observer
from crossbar.hosts.health import HostStatus

__all__ = ["CONTENT_TYPE_LATEST", "FleetCounters", "LiveCollector", "Metrics", "adder", "observer"]

_SPEED_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000, 10000)
"""Tokens/s."""
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class LiveCollector(Collector):
    """Gauges read at scrape time.

    :param inflight: returns (route, host) -> requests in flight.
    :param hosts: returns host name -> its current :class:`HostStatus`.
    :param queued: returns route -> requests waiting in its queue.
    :param affinity: returns (route, outcome) -> requests dispatched with that
        affinity outcome (``home``, ``spill``, ``none``), a counter.
    :param restarts: with workers, returns how many the supervisor restarted.
    :param draining: returns the hosts being drained (``crossbar_host_draining``).
    """

    def __init__(
        self,
        inflight: Callable[[], Mapping[tuple[str, str], int]],
        hosts: Callable[[], Mapping[str, HostStatus]],
        queued: Callable[[], Mapping[str, int]],
        affinity: Callable[[], Mapping[tuple[str, str], int]],
        restarts: Callable[[], int] | None = None,
        draining: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self._draining = draining
        self._inflight = inflight
        self._hosts = hosts
        self._queued = queued
        self._affinity = affinity
        self._restarts = restarts

    def collect(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily(
            "crossbar_inflight_requests", "Requests in flight to a host.", labels=("route", "host")
        )
        for (route, host), count in sorted(self._inflight().items()):
            inflight.add_metric((route, host), count)
        healthy = GaugeMetricFamily("crossbar_host_healthy", "1 when the host is in rotation, else 0.", labels=("host",))
        loaded = GaugeMetricFamily(
            "crossbar_host_models_loaded", "Models resident on the host at its last good poll.", labels=("host",)
        )
        draining = GaugeMetricFamily(
            "crossbar_host_draining", "1 while the host is drained (takes no new requests), else 0.", labels=("host",)
        )
        drained = self._draining() if self._draining is not None else ()
        for name, status in self._hosts().items():
            healthy.add_metric((name,), 1 if status.healthy else 0)
            loaded.add_metric((name,), len(status.loaded))
            draining.add_metric((name,), 1 if name in drained else 0)
        queued = GaugeMetricFamily(
            "crossbar_queued_requests", "Requests waiting in a route's queue for a host with room.", labels=("route",)
        )
        for route, count in sorted(self._queued().items()):
            queued.add_metric((route,), count)
        affinity = CounterMetricFamily(
            "crossbar_affinity", "Requests dispatched by cache-affinity outcome.", labels=("route", "outcome")
        )
        for (route, outcome), count in sorted(self._affinity().items()):
            affinity.add_metric((route, outcome), count)
        families: list[Metric] = [inflight, healthy, loaded, draining, queued, affinity]
        if self._restarts is not None:
            restarts = CounterMetricFamily("crossbar_worker_restarts", "Worker processes restarted after dying.")
            restarts.add_metric((), self._restarts())
            families.append(restarts)
        return families

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: described by collect() at scrape time only


class FleetCounters(Collector):
    """Another collector's families, with some of its counters made the box's: a
    collector of this process (e.g. the cluster's ``crossbar_cluster_lost``, counted by
    each worker's own link to Redis) would give another value for each worker that
    answers, which Prometheus reads as a counter reset (docs/design.md §Workers:
    counters are summed over workers).

    :param inner: the collector whose families are passed on.
    :param totals: counter family name (without ``_total``) -> its value summed over
        every worker (:meth:`Runtime.counter <crossbar.state.runtime.Runtime.counter>`);
        such a family must have no labels (one sample).
    """

    def __init__(self, inner: Collector, totals: Mapping[str, Callable[[], int]]) -> None:
        self._inner = inner
        self._totals = totals

    def collect(self) -> Iterable[Metric]:
        for family in self._inner.collect():
            total = self._totals.get(family.name)
            if total is None or family.type != "counter":
                yield family
                continue
            summed = CounterMetricFamily(family.name, family.documentation)
            summed.add_metric((), total())
            yield summed

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic, like LiveCollector


class Metrics:
    """The collectors crossbar updates. Label values are config names, status codes
    and fixed reason kinds only, so cardinality stays bounded."""

    def __init__(self) -> None:
        self._live: list[Collector] = []
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "crossbar_requests", "Answered requests by route, host, status code, client key name and how the "
            "answer ended (complete; cut: the host died or went silent mid-answer, or a drain's grace ran out; "
            "client_gone: the client left first), so a cut 200 is not counted as a plain one.",
            ("route", "host", "code", "key", "ended"), registry=r,
        )
        self.duration = Histogram(
            "crossbar_request_duration_seconds", "Time from request received to answer ended.",
            ("route", "host"), buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttfb = Histogram(
            "crossbar_time_to_first_byte_seconds", "Time from request sent upstream to response headers.",
            ("route", "host"), buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.unfinished = Counter(
            "crossbar_unfinished_answers", "Answers that did not end cleanly: ended cut (the host died or went "
            "silent mid-answer, or a drain's grace ran out) or client_gone (the client left first, or took no "
            "byte for timeouts.client_stall).",
            ("route", "host", "ended"), registry=r,
        )
        self.tokens = Counter(
            "crossbar_tokens", "Tokens of complete answers as the hosts reported them: kind prompt (read, "
            "cache excluded), cached (prompt tokens from the cache), generated.",
            ("route", "host", "key", "model", "kind"), registry=r,
        )
        self.generation_speed = Histogram(
            "crossbar_generation_tokens_per_second", "Generation speed of complete answers (the host's timings).",
            ("host", "model"), buckets=_SPEED_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "crossbar_time_to_first_token_seconds", "Streamed answers: time from request sent upstream to the "
            "first body byte.", ("route", "host"), buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.queue_wait = Histogram(
            "crossbar_queue_wait_seconds", "Time a request waited in its route's queue for a host with room.",
            ("route",), buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.poll_duration = Histogram(
            "crossbar_poll_duration_seconds", "Duration of one health poll of one host.",
            ("host", "result"), buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30), registry=r,
        )
        self.model_loads = Counter(
            "crossbar_model_loads", "Loads crossbar caused on router-mode hosts (docs: where models live), by "
            "reason: request (a request made the host load its model), spread (after waiting spread_after), "
            "keep (keep_loaded).", ("host", "model", "reason"), registry=r,
        )
        self.model_unloads = Counter(
            "crossbar_model_unloads", "Unloads crossbar caused on router-mode hosts (answered, then shown gone by a "
            "poll), by reason (idle).",
            ("host", "model", "reason"), registry=r,
        )
        self.model_command_failures = Counter(
            "crossbar_model_command_failures", "Load and unload commands to router-mode hosts that failed "
            "(a load is retried at the host's next poll, an unload after another idle_unload), by action and "
            "failure: timeout (no answer within timeouts.first_byte), http_4xx, http_5xx, http_other (the host "
            "refused it), too_large (an answer over 64 KiB), connection, error, kept (an unload the host answered "
            "but still listed the model loaded two polls later).", ("host", "action", "failure"), registry=r,
        )
        self.model_load_seconds = Histogram(
            "crossbar_model_load_seconds", "Time from a load crossbar caused to the poll that shows the model loaded.",
            ("host", "model"), buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=r,
        )
        self.mark_downs = Counter(
            "crossbar_mark_downs", "Hosts taken out of rotation by a failed request.",
            ("host", "reason"), registry=r,
        )

    def watch(self, collector: Collector) -> None:
        """Read ``collector``'s live gauges at every scrape (with workers too: they
        read the shared counts, so each worker reports the box's)."""
        self._live.append(collector)
        self.registry.register(collector)

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector. With workers
        (``$PROMETHEUS_MULTIPROC_DIR`` set by the supervisor), counters and histograms
        are summed over every worker by prometheus_client's multiprocess mode, and the
        live gauges read the fleet's shared counts (docs/design.md §Workers)."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return generate_latest(self.registry)
        fleet = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(fleet, directory)
        for collector in self._live:
            fleet.register(collector)
        return generate_latest(fleet)
