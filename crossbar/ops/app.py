"""The operations app under ``/_crossbar`` (DESIGN.md §Operations), built on Klein.

``status`` and ``metrics`` show topology and need the ops token when one is configured;
the probes (``livez``, ``readyz``, ``healthz``) stay open and say nothing but ok / not.
Readiness is read from memory only: a burst of probes touches no host.
"""

from __future__ import annotations

import hmac
import json
from datetime import datetime, timezone
from typing import Any

from klein import Klein
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource

from crossbar.state.worker_counts import AFFINITY_OUTCOMES
from crossbar.ops.metrics import CONTENT_TYPE_LATEST, Metrics
from crossbar.errors import json_error_bytes
from crossbar.state.runtime import Runtime

__all__ = ["OpsApp", "rfc3339"]


def rfc3339(seconds: float | None) -> str | None:
    """POSIX seconds as an RFC 3339 UTC timestamp (``2026-11-29T21:17:03.123Z``), or None."""
    if seconds is None:
        return None
    stamp = datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


class OpsApp:
    """``/_crossbar/...``: status, metrics and probes, read from ``runtime`` (so a
    reload, a drain and every request are seen at once).

    :param runtime: the shared state (config, health table, in-flight counts, draining).
    :param metrics: the Prometheus collectors.
    """

    app = Klein()

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self._runtime = runtime
        self._metrics = metrics

    def resource(self) -> IResource:
        """The Klein resource to mount at ``/_crossbar``."""
        return self.app.resource()

    def _json(self, request: IRequest, code: int, doc: Any) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Cache-Control", b"no-store")
        return json.dumps(doc).encode("utf-8")

    def _error(self, request: IRequest, code: int, message: str) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", b"application/json")
        return json_error_bytes(message)

    def _authorized(self, request: IRequest) -> bool:
        token = self._runtime.config.ops.token
        if token is None:
            return True
        scheme, _, credentials = (request.getHeader(b"authorization") or b"").partition(b" ")
        # The scheme is case-insensitive (RFC 9110 §11.1); the token is compared in
        # constant time.
        ok = hmac.compare_digest(credentials.strip(), token.encode("utf-8"))
        return scheme.lower() == b"bearer" and ok

    @app.route("/status", methods=["GET"])
    def status(self, request: IRequest) -> bytes:
        """``GET /_crossbar/status``: hosts and routes as JSON (token required when set)."""
        if not self._authorized(request):
            request.setHeader(b"WWW-Authenticate", b'Bearer realm="crossbar"')
            return self._error(request, 401, "unauthorized")
        runtime = self._runtime
        config = runtime.config
        hosts = {}
        for name, s in runtime.table.all().items():
            host = config.hosts.get(name)
            hosts[name] = {
                "url": host.url if host is not None else None,
                "healthy": s.healthy,
                "loaded": list(s.loaded),
                "loading": list(s.loading),
                "available": list(s.available),
                "last_ok": rfc3339(s.last_ok),
                "last_err": s.last_err,
                "consecutive": s.consecutive,
                "failures": s.failures,
                "inflight": runtime.inflight.host(name),
                "weight": host.weight if host is not None else None,
                "max_inflight": host.max_inflight if host is not None else None,
            }
        routes = {}
        for name, route in config.routes.items():
            oldest = runtime.oldest_wait(name)
            routes[name] = {
                "hosts": list(route.hosts),
                "primary": route.primary,
                "queued": runtime.queued(name),
                "oldest_wait_s": None if oldest is None else round(oldest, 3),
                "affinity": {
                    "key": route.affinity.key,
                    "balance": route.affinity.balance,
                    **{outcome: runtime.affinity(name, outcome) for outcome in AFFINITY_OUTCOMES},
                },
            }
        return self._json(request, 200, {"hosts": hosts, "routes": routes})

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        """``GET /_crossbar/metrics``: the Prometheus text exposition (token required when set)."""
        if not self._authorized(request):
            request.setHeader(b"WWW-Authenticate", b'Bearer realm="crossbar"')
            return self._error(request, 401, "unauthorized")
        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode("ascii"))
        return self._metrics.render()

    @app.route("/livez", methods=["GET", "HEAD"])
    def livez(self, request: IRequest) -> bytes:
        """``GET /_crossbar/livez``: 200 while the process serves."""
        return self._json(request, 200, {"status": "ok"})

    @app.route("/readyz", methods=["GET", "HEAD"])
    @app.route("/healthz", methods=["GET", "HEAD"])
    def readyz(self, request: IRequest) -> bytes:
        """``GET /_crossbar/readyz`` (and ``healthz``): 200 when ready, else 503."""
        if self._runtime.ready:
            return self._json(request, 200, {"status": "ready"})
        return self._json(request, 503, {"status": "not ready"})

    @app.handle_errors(Exception)
    def on_error(self, request: IRequest, failure: Any) -> bytes:
        """Any error in the ops app: a JSON 404, 405 or 500, never a traceback."""
        from werkzeug.exceptions import MethodNotAllowed, NotFound

        if failure.check(NotFound):
            return self._error(request, 404, "not found")
        if failure.check(MethodNotAllowed):
            return self._error(request, 405, "method not allowed")
        return self._error(request, 500, "internal error")
