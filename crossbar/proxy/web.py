"""Web plumbing: the site, its request class and the root resource (docs/design.md §Shape).

:class:`CrossbarSite` is a ``twisted.web`` ``Site`` whose root (:class:`Root`) sends
``/_crossbar/...`` to the ops app and every other path to the proxy. Its requests are
:class:`CrossbarRequest` (bodies capped, no ``Server`` header; the request head built
once as a :class:`~crossbar.proxy.head.RequestHead` and checked on the head), its
connections :class:`~crossbar.proxy.h1server.H1ServerChannel` (request heads parsed in C,
a :class:`~crossbar.proxy.channel.HeadDeadlineChannel` underneath).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site, version as _TWISTED_SERVER

from crossbar.errors import error_headers, json_error_bytes, phrase
from crossbar.ops.record import NO_ROUTE, RequestLog, RequestRecord
from crossbar.proxy.channel import HeadDeadlineChannel
from crossbar.proxy.h1server import H1ServerChannel
from crossbar.proxy.connections import OverLimit, connection_limit
from crossbar.proxy.cors import cors_headers
from crossbar.proxy.head import METHODS, Refusal, RequestHead, check_on_head
from crossbar.proxy.peek import NOTHING
from crossbar.proxy.ratelimit import key_limit_headers
from crossbar.proxy.request import CappedRequest
from crossbar.state.runtime import Runtime

__all__ = ["METHODS", "CrossbarRequest", "CrossbarSite", "Root"]


"""The reason phrases of the refusals made on the head."""



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
    """An answer of crossbar's own JSON error (docs/design.md rule 9) for any method."""

    isLeaf = True

    def __init__(self, code: int, message: str) -> None:
        super().__init__()
        self._code = code
        self._body = json_error_bytes(code, message)

    def render(self, request: Request) -> bytes:
        request.setResponseCode(self._code, phrase(self._code))
        for name, value in error_headers(self._code, cors_headers(request.requestHeaders)):
            request.setHeader(name, value)
        return self._body


class CrossbarRequest(CappedRequest):
    """A capped request that says no ``Server: TwistedWeb/x.y`` (crossbar's answers
    reveal no version), builds its :class:`~crossbar.proxy.head.RequestHead` once when
    the head is complete, applies the rules decided on the head
    (:func:`~crossbar.proxy.head.check_on_head`: ``Host``, no route, the key of
    docs/design.md §Access) and records what it refuses (docs/design.md §The proxy, rule 8).

    :ivar head: the request's head, parsed under the config current when it was
        complete (the request is checked and served under it alone, whatever a reload
        does meanwhile); its body and peek are added before the request is processed.
        None until the head is complete, and on a site that is not crossbar's.
    """

    head: RequestHead | None = None

    def gotLength(self, length: int | None) -> None:
        """On the head: build :attr:`head`, check it (each refusal answered at once),
        then the body's size (rule 4)."""
        site = getattr(self.channel, "site", None)
        if self.refused or not isinstance(site, CrossbarSite):
            return super().gotLength(length)
        head = self.head = RequestHead.parse(site.runtime.config, *self.head_line())
        channel = self.channel
        version = channel.request_version() if isinstance(channel, HeadDeadlineChannel) else b""
        headers = self.requestHeaders
        verdict = check_on_head(head, headers.getRawHeaders(b"host") or [], version,
                                headers.getRawHeaders(b"authorization"), has_body=length != 0,
                                x_api_key=headers.getRawHeaders(b"x-api-key"))
        if isinstance(verdict, Refusal):
            return self.refuse(verdict.code, verdict.message, verdict.headers)
        if verdict:
            self.head = head.with_key(verdict)
        super().gotLength(length)

    def refuse(self, code: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """:meth:`CappedRequest.refuse`, with the rate-limit headers of a key with
        ``limits`` (docs/design.md §Access: on every answer of such a key)."""
        head, site = self.head, getattr(self.channel, "site", None)
        if head is not None and head.key and isinstance(site, CrossbarSite) and not self.refused:
            headers = headers + tuple(key_limit_headers(site.runtime.limits, head.route, head.key))
        super().refuse(code, message, headers)

    def process(self) -> None:
        head = self.head
        if head is not None and not self.refused and (self.body_chunks or self.peeked is not NOTHING):
            self.head = head.with_body(self.body_chunks, self.peeked)
        super().process()

    def setHeader(self, name: str | bytes, value: str | bytes) -> None:
        """``Request.setHeader``, but Twisted's ``Server: TwistedWeb/x.y`` (set by
        ``Request.process``) is never set: no header to remove later, per request."""
        if name == b"Server" and value == _TWISTED_SERVER:
            return
        super().setHeader(name, value)

    def head_line(self) -> tuple[bytes, bytes]:
        # On the head, before Twisted sets self.method and self.uri (after the body).
        channel = self.channel
        return channel.request_line() if isinstance(channel, HeadDeadlineChannel) else (self.method, self.uri)

    def refused_answer(self, code: int, body_bytes: int) -> None:
        site = getattr(self.channel, "site", None)
        if isinstance(site, CrossbarSite):
            head = self.head or RequestHead.parse(site.runtime.config, *self.head_line())
            site.record_head_answer(head, code, body_bytes)


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
    protocol = H1ServerChannel  # type: ignore[assignment]

    def __init__(self, root: IResource, runtime: Runtime, requests: RequestLog) -> None:
        super().__init__(root, requestFactory=CrossbarRequest, parsePOSTFormSubmission=False)
        self.runtime = runtime
        self.requests = requests
        self.open_channels: set[HeadDeadlineChannel] = set()
        """Client connections now open (each channel adds and removes itself)."""
        self.max_connections = connection_limit()
        """Client connections this process keeps open at once (from ``RLIMIT_NOFILE``,
        :func:`~crossbar.proxy.connections.connection_limit`); one more is answered 503
        and closed at once (docs/design.md §The proxy, rule 9)."""

    def buildProtocol(self, addr: Any) -> Any:
        if len(self.open_channels) >= self.max_connections:
            refuse = OverLimit()
            refuse.factory = self
            return refuse
        return super().buildProtocol(addr)

    def log(self, request: Any) -> None:
        pass

    def record_early_answer(self, method: bytes, uri: bytes, status: int, body_bytes: int) -> None:
        """Record an answer made before the request head was complete: a 400 for a
        request Twisted cannot parse (``uri`` may be b"")."""
        self.record_head_answer(RequestHead.parse(self.runtime.config, method, uri), status, body_bytes)

    def record_head_answer(self, head: RequestHead, status: int, body_bytes: int) -> None:
        """Record an answer made before any resource saw the request ``head``: a 413
        for a body over the limit, a 401, a 400 on the head."""
        route = head.route_label
        rest = head.rest if route != NO_ROUTE else b""
        self.requests.write(RequestRecord(
            route=route, host="", method=head.method.decode("latin-1"), path=rest.decode("latin-1"),
            target=head.path.decode("latin-1"), status=status, bytes=body_bytes, duration=0.0, key=head.key,
        ))

    def stop_keep_alive(self) -> int:
        """Close every client connection with no request on it, and every other one
        right after its answer; returns how many were closed at once."""
        return sum(1 for channel in list(self.open_channels) if channel.close_when_idle())


