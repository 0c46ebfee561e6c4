"""Web plumbing: the site, its request class, the root resource and the listener
(DESIGN.md §Shape).

:class:`CrossbarSite` is a ``twisted.web`` ``Site`` whose root (:class:`Root`) sends
``/_crossbar/...`` to the ops app and every other path to the proxy. Its requests are
:class:`CrossbarRequest` (bodies capped, no ``Server`` header), its connections
:class:`~crossbar.proxy.channel.HeadDeadlineChannel`. :class:`ListenService` listens on the
``listen`` endpoint while running.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from crossbar.proxy.access import check_key
from crossbar.proxy.channel import HeadDeadlineChannel
from crossbar.proxy.connections import OverLimit, connection_limit
from crossbar.proxy.cors import cors_headers
from crossbar.config import Config
from crossbar.ops.record import NO_ROUTE, RequestLog, RequestRecord
from crossbar.errors import json_error_bytes
from crossbar.proxy.request import CappedRequest
from crossbar.proxy.routing import split_route, split_target
from crossbar.state.runtime import Runtime

__all__ = ["METHODS", "CrossbarRequest", "CrossbarSite", "Root"]


METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS")
"""The methods crossbar serves, exact case; any other is refused 405 on the head
(DESIGN.md §The proxy, rule 9): ``trace`` as well as ``TRACE``, ``CONNECT``, ``BREW``."""

_ALLOW = b", ".join(METHODS)

_HOST_VALUE = re.compile(rb"\A[\x21-\x7e]*\Z")
"""A ``Host`` value: visible ASCII (RFC 9110 §7.2: a uri-host and port), empty allowed."""



class Root(Resource):
    """``/_crossbar/...`` goes to the ops app, every other path to the proxy."""

    def __init__(self, ops: IResource, proxy: IResource) -> None:
        super().__init__()
        self._ops = ops
        self._proxy = proxy

    def getChildWithDefault(self, path: bytes, request: Request) -> IResource:
        if path == b"_crossbar":
            try:  # klein decodes the path as UTF-8, and logs a traceback when it cannot
                unquote_to_bytes(request.path).decode("utf-8")
            except UnicodeDecodeError:
                return _JSONError(404, "not found")
            return self._ops
        return self._proxy


class _JSONError(Resource):
    """An answer of crossbar's own JSON error (DESIGN.md rule 9) for any method."""

    isLeaf = True

    def __init__(self, code: int, message: str) -> None:
        super().__init__()
        self._code = code
        self._body = json_error_bytes(message)

    def render(self, request: Request) -> bytes:
        request.setResponseCode(self._code)
        for name, value in cors_headers(request.requestHeaders):
            request.setHeader(name, value)
        request.setHeader(b"Content-Type", b"application/json")
        return self._body


class CrossbarRequest(CappedRequest):
    """A capped request that says no ``Server: TwistedWeb/x.y`` (crossbar's answers
    reveal no version), is checked against a keyed route's keys on its head (DESIGN.md
    §Access) and records what it refuses (DESIGN.md §The proxy, rule 8).

    :ivar config: the config current when the request head was complete: the request is
        checked and served under it alone, whatever a reload does meanwhile.
    :ivar key_name: the name of the client key the request presented on a keyed route,
        else "".
    """

    config: Config | None = None
    key_name = ""

    def gotLength(self, length: int | None) -> None:
        """On the head, in this order: the method (rule 9), the ``Host`` header (RFC 9112 §3.2: exactly one
        in HTTP/1.1, visible ASCII), an asterisk-form target (no route), the key
        (DESIGN.md §Access), then the body's size (rule 4): each refused at once."""
        site = getattr(self.channel, "site", None)
        if self.refused or not isinstance(site, CrossbarSite):
            return super().gotLength(length)
        self.config = config = site.runtime.config
        method, target = self.head_line()
        if method not in METHODS:
            return self.refuse(405, b"Method Not Allowed", "method not allowed", ((b"Allow", _ALLOW),))
        hosts = self.requestHeaders.getRawHeaders(b"host") or []
        version = self.channel.request_version() if isinstance(self.channel, HeadDeadlineChannel) else b""
        if len(hosts) > 1 or (not hosts and version == b"HTTP/1.1") or any(
                _HOST_VALUE.match(h) is None for h in hosts):
            return self.refuse(400, b"Bad Request", "bad host header")
        if target == b"*":
            return self.refuse(400, b"Bad Request", "missing route")
        verdict = check_key(config, method, target, self.requestHeaders.getRawHeaders(b"authorization"),
                            has_body=length != 0, x_api_key=self.requestHeaders.getRawHeaders(b"x-api-key"))
        if verdict is None:
            return self.refuse(401, b"Unauthorized", "invalid api key", ((b"WWW-Authenticate", b"Bearer"),))
        self.key_name = verdict
        super().gotLength(length)

    def render(self, resrc: IResource) -> None:
        self.responseHeaders.removeHeader(b"server")
        super().render(resrc)

    def head_line(self) -> tuple[bytes, bytes]:
        # On the head, before Twisted sets self.method and self.uri (after the body).
        channel = self.channel
        return channel.request_line() if isinstance(channel, HeadDeadlineChannel) else (self.method, self.uri)

    def refused_answer(self, code: int, body_bytes: int) -> None:
        site = getattr(self.channel, "site", None)
        if isinstance(site, CrossbarSite):
            method, target = self.head_line()
            site.record_early_answer(method, target, code, body_bytes, key=self.key_name)


class CrossbarSite(Site):
    """crossbar's ``Site``: HTTP/1.1 only (no HTTP/2), no Twisted access log (every
    answer is recorded by the proxy, or here for answers made before a resource is
    reached), no form parsing of bodies (a proxy forwards them as they are).

    :param root: the root resource.
    :param runtime: the shared state (its config names the routes for records).
    :param requests: where records go.
    """

    displayTracebacks = False
    noisy = False
    protocol = HeadDeadlineChannel  # type: ignore[assignment]

    def __init__(self, root: IResource, runtime: Runtime, requests: RequestLog) -> None:
        super().__init__(root, requestFactory=CrossbarRequest, parsePOSTFormSubmission=False)
        self.runtime = runtime
        self.requests = requests
        self.open_channels: set[HeadDeadlineChannel] = set()
        """Client connections now open (each channel adds and removes itself)."""
        self.max_connections = connection_limit()
        """Client connections this process keeps open at once (from ``RLIMIT_NOFILE``,
        :func:`~crossbar.proxy.connections.connection_limit`); one more is answered 503
        and closed at once (DESIGN.md §The proxy, rule 9)."""

    def buildProtocol(self, addr: Any) -> Any:
        if len(self.open_channels) >= self.max_connections:
            refuse = OverLimit()
            refuse.factory = self
            return refuse
        return super().buildProtocol(addr)

    def log(self, request: Any) -> None:
        pass

    def record_early_answer(self, method: bytes, uri: bytes, status: int, body_bytes: int, key: str = "") -> None:
        """Record an answer made before any resource saw the request: a 413 for a body
        over the limit, a 401, a 400 for a request Twisted cannot parse (``uri`` may be
        b""); ``key`` names the valid client key it presented, if any."""
        path, _ = split_target(uri)
        split = split_route(path) if path else None
        route, rest = NO_ROUTE, b""
        if split is not None and split[0] in self.runtime.config.routes:
            route, rest = split
        self.requests.write(RequestRecord(
            route=route, host="", method=method.decode("latin-1"), path=rest.decode("latin-1"),
            target=path.decode("latin-1"), status=status, bytes=body_bytes, duration=0.0, key=key,
        ))

    def stop_keep_alive(self) -> int:
        """Close every client connection with no request on it, and every other one
        right after its answer; returns how many were closed at once."""
        return sum(1 for channel in list(self.open_channels) if channel.close_when_idle())


