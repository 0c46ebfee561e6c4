"""The operations app under ``/_crossbar`` (docs/design.md §Operations), built on Klein.

``status``, ``metrics`` and the dashboard's data (``dashboard.json``, the ``events``
stream) show topology and need the ops token when one is configured; the host actions
(``hosts/<name>/drain``, ``undrain``) are refused (403) unless a token is configured.
The dashboard's page itself (``/_crossbar/``, :mod:`crossbar.ops.dashboard`) holds no
data and is served to anyone. The probes (``livez``, ``readyz``, ``healthz``) stay open
and say nothing but ok / not. Readiness is read from memory only: a burst of probes
touches no host.
"""

from __future__ import annotations

import hmac
import json
from datetime import datetime, timezone
from typing import Any

from klein import Klein
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.task import LoopingCall
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource

from crossbar.state.worker_counts import AFFINITY_OUTCOMES
from crossbar.ops.hostview import host_view, key_view, leaving, leaving_view
from crossbar.ops.dashboard import CSP, load_static, snapshot
from crossbar.ops.metrics import CONTENT_TYPE_LATEST, Metrics
from crossbar.ops.recent import RecentRequests
from crossbar.errors import error_headers, json_error_bytes
from crossbar.config import Host, Route
from crossbar.hosts.health import HostStatus
from crossbar.hosts.placement import unlisted_keeps
from crossbar.state.placement import Move
from crossbar.state.runtime import Runtime

__all__ = ["EVENT_INTERVAL", "OpsApp", "rfc3339", "route_placement"]

EVENT_INTERVAL = 1.0
"""Seconds between two events of the dashboard's stream (docs/design.md: at least every 2 s)."""


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
    :param recent: the recent requests and token figures (the dashboard's data).
    :param clock: the reactor (``IReactorTime``) the event stream is timed by.
    """

    app = Klein()

    def __init__(
        self, runtime: Runtime, metrics: Metrics, recent: RecentRequests | None = None, clock: Any = None,
    ) -> None:
        self._runtime = runtime
        self._metrics = metrics
        self._recent = recent if recent is not None else RecentRequests(runtime.now)
        if clock is None:
            from twisted.internet import reactor as clock
        self._clock = clock
        self._static = load_static()
        self._login_page = self._static[""][0].replace(b"<body>", b'<body data-login="required">', 1)

    def resource(self) -> IResource:
        """The Klein resource to mount at ``/_crossbar``."""
        return self.app.resource()

    def _json(self, request: IRequest, code: int, doc: Any) -> bytes:
        request.setResponseCode(code)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Cache-Control", b"no-store")
        return json.dumps(doc).encode("utf-8")

    def _error(self, request: IRequest, code: int, message: str) -> bytes:
        """crossbar's error answer (docs/design.md rule 9), as the proxy writes it."""
        request.setResponseCode(code)
        for name, value in error_headers(code):
            request.setHeader(name, value)
        return json_error_bytes(code, message)

    def _unauthorized(self, request: IRequest) -> bytes:
        request.setHeader(b"WWW-Authenticate", b'Bearer realm="crossbar"')
        return self._error(request, 401, "unauthorized")

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
    def status(self, request: IRequest) -> bytes | Deferred[bytes]:
        """``GET /_crossbar/status``: hosts and routes as JSON (token required when set;
        with ``cluster.redis`` after a read of the fleet's token figures, bounded)."""
        if not self._authorized(request):
            return self._unauthorized(request)
        return self._runtime.tokens.fresh().addCallback(lambda _: self._status(request))

    def _status(self, request: IRequest) -> bytes:
        runtime = self._runtime
        config = runtime.config
        window = runtime.tokens.window()  # §What the answers say: the last minute
        hosts = {}
        for name, s in runtime.table.all().items():
            host = config.hosts.get(name)
            hosts[name] = {
                "url": host.url.url if host is not None else None,
                **host_view(runtime, name, s),
                "last_ok": rfc3339(s.last_ok),
                "consecutive": s.consecutive,
                "failures": s.failures,
                "weight": host.weight if host is not None else None,
                "tokens_per_s": window.generated_per_second(name),
                "cached_share": window.cached_share("h", name),
                **_placement(runtime, name, host, s),
            }
        for name, n in sorted(leaving(runtime).items()):
            # Removed by a reload, still answering: shown until its last request ends.
            hosts[name] = {
                "url": None, **leaving_view(n), "last_ok": None, "consecutive": 0, "failures": 0,
                "weight": None, "tokens_per_s": 0.0, "cached_share": None,
                "models_max": None, "models": {}, "last_load": None, "last_unload": None,
            }
        routes = {}
        for name, route in config.routes.items():
            oldest = runtime.oldest_wait(name)
            routes[name] = {
                "hosts": list(route.hosts),
                "primary": route.primary,
                "queued": runtime.queued(name),
                "oldest_wait_s": None if oldest is None else round(oldest, 3),
                "cached_share": window.cached_share("r", name),
                "affinity": {
                    "key": route.affinity.key,
                    "balance": route.affinity.balance,
                    **{outcome: runtime.affinity(name, outcome) for outcome in AFFINITY_OUTCOMES},
                },
                "keys": key_view(runtime, route),
                "waiting": runtime.queues.status(name),  # per key, this process's queue (§Access)
                "placement": route_placement(runtime, route),
            }
        doc: dict[str, Any] = {"hosts": hosts, "routes": routes}
        cluster = runtime.cluster
        if cluster is not None:  # docs/design.md §Several crossbars
            doc["cluster"] = {"shared": cluster.joined, "instances": cluster.instances()}
        return self._json(request, 200, doc)

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        """``GET /_crossbar/metrics``: the Prometheus text exposition (token required when set)."""
        if not self._authorized(request):
            return self._unauthorized(request)
        request.setHeader(b"Content-Type", CONTENT_TYPE_LATEST.encode("ascii"))
        return self._metrics.render()

    # -- host drain (docs/design.md §Operations) ----------------------------------------------

    @app.route("/hosts/<name>/drain", methods=["POST"])
    def drain(self, request: IRequest, name: str) -> bytes:
        """``POST /_crossbar/hosts/<name>/drain``: the host takes no new requests while
        its in-flight ones finish (403 without ``ops.token``; 401 without it given)."""
        return self._host_action(request, name, True)

    @app.route("/hosts/<name>/undrain", methods=["POST"])
    def undrain(self, request: IRequest, name: str) -> bytes:
        """``POST /_crossbar/hosts/<name>/undrain``: the host takes requests again."""
        return self._host_action(request, name, False)

    def _host_action(self, request: IRequest, name: str, draining: bool) -> bytes:
        runtime = self._runtime
        if runtime.config.ops.token is None:
            return self._error(request, 403, "host actions need ops.token in the config")
        if not self._authorized(request):
            return self._unauthorized(request)
        if not runtime.drain_host(name, draining):
            return self._error(request, 404, "no such host")
        return self._json(request, 200, {"host": name, "draining": draining, "inflight": runtime.inflight.host(name)})

    # -- the dashboard (crossbar.ops.dashboard) -------------------------------------------

    def _page(self, request: IRequest, path: str) -> bytes:
        body, kind = self._static[path]
        if path == "" and self._runtime.config.ops.token is not None:
            # The page asks for the token before it asks for any data (which a 401 would
            # only tell it, with an error in the browser's console).
            body = self._login_page
        request.setHeader(b"Content-Type", kind.encode("ascii"))
        request.setHeader(b"Content-Security-Policy", CSP.encode("ascii"))
        request.setHeader(b"X-Content-Type-Options", b"nosniff")
        request.setHeader(b"Referrer-Policy", b"no-referrer")
        request.setHeader(b"X-Frame-Options", b"DENY")
        request.setHeader(b"Cache-Control", b"no-cache")
        return body

    @app.route("/", methods=["GET", "HEAD"])
    def dashboard(self, request: IRequest) -> bytes:
        """``GET /_crossbar/``: the dashboard's page (no data: that needs the token)."""
        return self._page(request, "")

    @app.route("/app.js", methods=["GET", "HEAD"])
    def dashboard_script(self, request: IRequest) -> bytes:
        """The dashboard's script."""
        return self._page(request, "app.js")

    @app.route("/style.css", methods=["GET", "HEAD"])
    def dashboard_style(self, request: IRequest) -> bytes:
        """The dashboard's style sheet."""
        return self._page(request, "style.css")

    @app.route("/favicon.svg", methods=["GET", "HEAD"])
    def dashboard_icon(self, request: IRequest) -> bytes:
        """The dashboard's icon."""
        return self._page(request, "favicon.svg")

    def _fresh(self) -> Deferred[None]:
        """Fires when the dashboard's recent entries and the token figures are as fresh
        as they get (with ``cluster.redis``: both read from Redis, side by side)."""
        both = gatherResults([self._recent.fresh(), self._runtime.tokens.fresh()])
        return both.addCallback(lambda _: None)

    def _snapshot_bytes(self) -> bytes:
        return json.dumps(snapshot(self._runtime, self._recent), separators=(",", ":")).encode("utf-8")

    @app.route("/dashboard.json", methods=["GET"])
    def dashboard_data(self, request: IRequest) -> bytes | Deferred[bytes]:
        """``GET /_crossbar/dashboard.json``: the dashboard's data once (token required
        when set; with ``cluster.redis`` after a read of Redis, bounded)."""
        if not self._authorized(request):
            return self._unauthorized(request)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Cache-Control", b"no-store")
        return self._fresh().addCallback(lambda _: self._snapshot_bytes())

    @app.route("/events", methods=["GET"])
    def events(self, request: IRequest) -> Any:
        """``GET /_crossbar/events``: the dashboard's data as server-sent events, one
        every :data:`EVENT_INTERVAL` seconds, until the client leaves or crossbar
        drains (token required when set: the page reads it with ``fetch``, which can
        send the header, not with ``EventSource``)."""
        if not self._authorized(request):
            return self._unauthorized(request)
        request.setHeader(b"Content-Type", b"text/event-stream")
        request.setHeader(b"Cache-Control", b"no-store")
        request.setHeader(b"X-Accel-Buffering", b"no")
        loop: LoopingCall

        def stop(_: object = None) -> None:
            if loop.running:
                loop.stop()

        done: Deferred[None] = Deferred(canceller=stop)

        def send() -> Deferred[None]:
            # Draining: the page reconnects, to another instance. The token changed by a
            # reload: the page reconnects and is asked for the new one.
            if self._runtime.draining or not self._authorized(request):
                stop()
                done.callback(None)
                return succeed(None)
            return self._fresh().addCallback(write)

        def write(_: object) -> None:
            if not loop.running:
                return
            try:
                request.write(b"data: " + self._snapshot_bytes() + b"\n\n")
            except Exception:
                stop()  # the client is gone: Klein cancels ``done``

        loop = LoopingCall(send)
        loop.clock = self._clock
        loop.start(EVENT_INTERVAL, now=True)
        return done

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
        from werkzeug.routing import RequestRedirect

        if failure.check(RequestRedirect) and request.path == b"/_crossbar":
            # The dashboard's address without its slash: its relative links need it.
            request.setResponseCode(308)
            request.setHeader(b"Location", b"/_crossbar/")
            request.setHeader(b"Content-Type", b"application/json")
            return json.dumps({"location": "/_crossbar/"}).encode("utf-8")
        if failure.check(NotFound):
            return self._error(request, 404, "not found")
        if failure.check(MethodNotAllowed):
            return self._error(request, 405, "method not allowed")
        return self._error(request, 500, "internal error")


def _move(move: Move | None) -> dict[str, object] | None:
    return None if move is None else {"model": move.model, "reason": move.reason, "at": rfc3339(move.at)}


def route_placement(runtime: Runtime, route: Route) -> dict[str, object] | None:
    """A route's ``placement`` in the status (docs/design.md §Where models live, rules 5
    and 7): its ``keep_loaded`` models and those of them no host of the route lists
    (``unlisted``: crossbar can load them nowhere; empty until every host of the route
    had a good poll); None without ``placement``."""
    if route.placement is None:
        return None
    return {"keep_loaded": list(route.placement.keep_loaded),
            "unlisted": unlisted_keeps(route, runtime.table.all()) or []}


def _placement(runtime: Runtime, name: str, host: Host | None, status: HostStatus) -> dict[str, object]:
    """Where models live (docs/design.md §Where models live, rule 7): a router-mode host's
    ``models_max``, per loaded model its requests in flight, last use (the last request
    crossbar sent it there) and whether an unload of it there is under way (rule 4: it
    takes no request meanwhile), and the last load and unload crossbar caused there with
    their reason."""
    placement = runtime.placement
    return {
        "models_max": host.models_max if host is not None and status.router else None,
        "models": {m: {"inflight": runtime.inflight.host_model(name, m),
                       "last_use": rfc3339(placement.last_use(name, m)),
                       "unloading": (name, m) in placement.unloading or placement.others_unloading(name, m)}
                   for m in status.loaded} if status.router else {},
        "last_load": _move(placement.last_load.get(name)),
        "last_unload": _move(placement.last_unload.get(name)),
    }

