"""The proxy's resource: every request outside ``/_crossbar`` becomes one
:class:`~crossbar.proxy.exchange.Exchange` (docs/design.md §The proxy), started on the
request's :class:`~crossbar.proxy.head.RequestHead`; the drain (§Operations) waits for
them and aborts what is left.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.config import Config
from crossbar.errors import error_headers, json_error_bytes
from crossbar.ops.record import RequestLog
from crossbar.proxy.context import ProxyContext
from crossbar.paths import PathKind
from crossbar.proxy.exchange import Exchange
from crossbar.proxy.head import check_path
from crossbar.proxy.listing import ModelListing
from crossbar.proxy.phase import Phase
from crossbar.proxy.web import CrossbarRequest
from crossbar.state.runtime import Runtime
from crossbar.upstream.pools import UpstreamPools

__all__ = ["ProxyResource"]

_log = Logger(namespace="crossbar.proxy")


class ProxyResource(Resource):
    """The leaf resource that proxies every request outside ``/_crossbar``.

    :param runtime: the shared state: current config, health table, in-flight counts,
        active requests, draining.
    :param pools: upstream connections.
    :param clock: the reactor (timeouts are measured on it).
    :param requests: where each answered request's record goes (log line, metrics).
    """

    isLeaf = True

    def __init__(self, runtime: Runtime, pools: UpstreamPools, clock: IReactorTime, requests: RequestLog) -> None:
        super().__init__()
        self.runtime = runtime
        self.pools = pools
        self.clock = clock
        self.requests = requests
        self.context = ProxyContext(runtime, pools, clock, requests, self.mark_down)

    def render(self, request: Request) -> Any:
        """Start the request's :class:`Exchange` on its head; it answers asynchronously."""
        if not isinstance(request, CrossbarRequest) or request.head is None:  # not crossbar's site's: a wiring bug
            _log.error("no request head for {uri!r}", uri=request.path)
            request.setResponseCode(500)
            for name, value in error_headers(500):
                request.setHeader(name, value)
            return json_error_bytes(500, "internal error")
        head = request.head
        checked = check_path(head)  # rules 1-3
        exchange = (ModelListing if checked is PathKind.MODEL_LIST else Exchange)(self.context, request, head)
        try:
            exchange.start(checked)
        except Exception:
            exchange.on_bug(Failure())
        return NOT_DONE_YET

    def when_idle(self) -> Deferred[None]:
        """Fires once no request is being handled (at once if none is); cancellable."""
        return self.runtime.idle.wait()

    def abort_all(self, why: str = "crossbar is shutting down") -> None:
        """Abort every request still being handled (the end of a drain's grace): the
        waiting ones first, answered 503, so that no slot freed by an abort dispatches
        one of them."""
        for exchange in sorted(self.runtime.active, key=lambda e: e.phase is not Phase.QUEUED):
            exchange.abort(why)

    def mark_down(self, host: str, reason: str, started_with: Config) -> bool:
        """Take ``host`` out of rotation after a request to it really failed (rule 7),
        unless a reload changed that host's URL since the request started under
        ``started_with``: the failure was the old host's, and says nothing of the new one.
        Returns whether it was marked down."""
        current, old = self.runtime.config.hosts.get(host), started_with.hosts.get(host)
        if current is None or old is None or current.url != old.url:
            _log.info("not marking {host} down: its URL changed since the request started ({reason})",
                      host=host, reason=reason)
            return False
        self.runtime.table.mark_down(host, reason)
        return True
