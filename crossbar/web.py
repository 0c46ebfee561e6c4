"""Web plumbing: the site, its request class, the root resource and the listener
(DESIGN.md §Shape).

:class:`CrossbarSite` is a ``twisted.web`` ``Site`` whose root (:class:`Root`) sends
``/_crossbar/...`` to the ops app and every other path to the proxy. Its requests are
:class:`CrossbarRequest` (bodies capped, no ``Server`` header), its connections
:class:`~crossbar.channel.HeadDeadlineChannel`. :class:`ListenService` listens on the
``listen`` endpoint while running.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from crossbar.access import check_key
from crossbar.channel import HeadDeadlineChannel
from crossbar.config import Config
from crossbar.record import NO_ROUTE, RequestLog, RequestRecord
from crossbar.request import CappedRequest, json_error_bytes
from crossbar.routing import split_route, split_target
from crossbar.runtime import Runtime
from crossbar.waiting import Condition

__all__ = ["CrossbarRequest", "CrossbarSite", "ListenService", "Root"]


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
        """On the head, in this order: the ``Host`` header (RFC 9112 §3.2: exactly one
        in HTTP/1.1, visible ASCII), an asterisk-form target (no route), the key
        (DESIGN.md §Access), then the body's size (rule 4): each refused at once."""
        site = getattr(self.channel, "site", None)
        if self.refused or not isinstance(site, CrossbarSite):
            return super().gotLength(length)
        self.config = config = site.runtime.config
        method, target = self.head_line()
        hosts = self.requestHeaders.getRawHeaders(b"host") or []
        version = self.channel.request_version() if isinstance(self.channel, HeadDeadlineChannel) else b""
        if len(hosts) > 1 or (not hosts and version == b"HTTP/1.1") or any(
                _HOST_VALUE.match(h) is None for h in hosts):
            return self.refuse(400, b"Bad Request", "bad host header")
        if target == b"*":
            return self.refuse(400, b"Bad Request", "missing route")
        verdict = check_key(config, method, target, self.requestHeaders.getRawHeaders(b"authorization"),
                            has_body=length != 0)
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


class ListenService(Service):
    """Listens on ``endpoint`` while running; :attr:`port` is the listening port.

    A listen that fails at once (address in use, bad interface) raises
    ``CannotListenError`` from ``startService``, so ``twistd`` stops at start-up
    instead of running deaf.
    """

    _log = Logger(namespace="crossbar")

    def __init__(self, endpoint: IStreamServerEndpoint, factory: IProtocolFactory) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.port: IListeningPort | None = None
        self._listening: Deferred[IListeningPort] | None = None
        self._listened_condition = Condition(lambda: self.port is not None)

    def privilegedStartService(self) -> None:
        """Listen before twistd drops privileges (``--uid``), so ports below 1024 work."""
        super().privilegedStartService()
        self._listen()

    def startService(self) -> None:
        super().startService()
        if self._listening is None:  # started without privilegedStartService (tests)
            self._listen()

    def _listen(self) -> None:
        try:
            d = self.endpoint.listen(self.factory)
        except Exception as e:  # e.g. OverflowError for a port over 65535
            raise CannotListenError(None, None, e) from None
        self._listening = d
        d.addCallback(self._listened)
        if d.called:  # TCP, UNIX, systemd: listening (or not) at once
            failures: list[Failure] = []
            d.addErrback(failures.append)
            if failures:
                error = failures[0].value
                if isinstance(error, CannotListenError):
                    raise error
                raise CannotListenError(None, None, error)  # e.g. a unix socket's lock file
        else:
            d.addErrback(self._listen_failed)

    def _listen_failed(self, failure: Failure) -> None:
        """A listen that failed later (e.g. a slow endpoint): running deaf helps nobody."""
        self._log.failure("cannot listen; stopping", failure=failure)
        from twisted.internet import reactor

        reactor.stop()

    def _listened(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        host = port.getHost()
        self._log.info("listening on {address}", address=f"{getattr(host, 'host', host)}:{getattr(host, 'port', '')}")
        self._listened_condition.check()
        return port

    def when_listening(self) -> Deferred[IListeningPort]:
        """Fires with the listening port once listening."""
        assert self._listening is not None, "not started"
        def port(_: None) -> IListeningPort:
            assert self.port is not None
            return self.port

        return self._listened_condition.wait().addCallback(port)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        self._listening = None
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None
