"""Prometheus metrics (DESIGN.md §Operations), on a registry of crossbar's own.

Every crossbar service owns one :class:`Metrics`; nothing is registered globally, so
several crossbars (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The collectors crossbar updates. Label values are config names, status codes
    and fixed reason kinds only, so cardinality stays bounded."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "crossbar_requests", "Proxied requests by route, host and status code.",
            ("route", "host", "code"), registry=r,
        )
        self.duration = Histogram(
            "crossbar_request_duration_seconds", "Time from request received to answer ended.",
            ("route", "host"), buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttfb = Histogram(
            "crossbar_time_to_first_byte_seconds", "Time from request sent upstream to response headers.",
            ("route", "host"), buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.inflight = Gauge(
            "crossbar_inflight_requests", "Requests in flight to a host.", ("route", "host"), registry=r,
        )
        self.host_healthy = Gauge(
            "crossbar_host_healthy", "1 when the host is in rotation, else 0.", ("host",), registry=r,
        )
        self.models_loaded = Gauge(
            "crossbar_host_models_loaded", "Models resident on the host at its last good poll.",
            ("host",), registry=r,
        )
        self.poll_duration = Histogram(
            "crossbar_poll_duration_seconds", "Duration of one health poll of one host.",
            ("host", "result"), buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30), registry=r,
        )
        self.mark_downs = Counter(
            "crossbar_mark_downs", "Hosts taken out of rotation by a failed request.",
            ("host", "reason"), registry=r,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)
