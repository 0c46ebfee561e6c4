"""What every request's :class:`~crossbar.proxy.exchange.Exchange` and its
:class:`~crossbar.proxy.leg.Leg` are given (docs/design.md §The proxy).

One :class:`ProxyContext`, made once by the proxy resource: the shared state, where
connections come from, the clock, where records go, and how a host is marked down. An
exchange and its legs are made with it and with what they serve; neither reaches back
into the resource nor into each other.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from twisted.internet.interfaces import IReactorTime

from crossbar.config import Config
from crossbar.ops.record import RequestLog
from crossbar.state.runtime import Runtime
from crossbar.upstream.pools import UpstreamPools

__all__ = ["ProxyContext"]


class ProxyContext(NamedTuple):
    """The proxy's shared parts.

    :ivar runtime: current config, health table, in-flight counts, queues, drain.
    :ivar pools: upstream connections.
    :ivar clock: the reactor (timeouts are measured on it).
    :ivar requests: where each answered request's record goes (log line, metrics).
    :ivar mark_down: ``mark_down(host, reason, started_with)``: take ``host`` out after a
        request to it really failed (rule 7), unless a reload changed the host's URL
        since the request started under ``started_with``; returns whether it did.
    """

    runtime: Runtime
    pools: UpstreamPools
    clock: IReactorTime
    requests: RequestLog
    mark_down: Callable[[str, str, Config], bool]
