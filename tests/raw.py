"""Raw-socket HTTP/1.1 for tests that must send exact bytes (and read exact answers).

treq and twisted.web.client normalise what they send; these helpers do not. The client
is a Twisted protocol on a real loopback connection: it writes what it is given and
collects everything until crossbar closes (or half-closes) the connection.
:func:`parse_responses` is a deliberately strict HTTP/1.1 response parser, so a test
can assert that an answer is well-formed. Also here: :func:`two_hosts`, crossbar in
front of two :class:`~tests.harness.FakeLlama` hosts with different loaded models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site
from zope.interface import implementer

from crossbar.service import CrossbarService
from tests.harness import FakeLlama, start_crossbar

__all__ = [
    "BadResponse", "complete", "RawResponse", "TwoHosts", "parse_responses",
    "raw_exchange", "two_hosts", "upstream_requests",
]


class BadResponse(Exception):
    """The bytes crossbar sent are not a well-formed HTTP/1.1 response."""


@dataclass
class RawResponse:
    """One parsed response: status, headers in wire order (names lower-cased), body
    (de-chunked), and whether the body was sent chunked."""

    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    chunked: bool = False

    def get(self, name: bytes) -> list[bytes]:
        """Every value of header ``name`` (case-insensitive), in order."""
        name = name.lower()
        return [v for n, v in self.headers if n == name]

    def one(self, name: bytes) -> bytes | None:
        values = self.get(name)
        return values[0] if values else None


def _parse_one(data: bytes, head: bool, at_eof: bool) -> tuple[RawResponse, bytes]:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        raise BadResponse(f"no end of headers in {data[:200]!r}")
    lines = data[:end].split(b"\r\n")
    rest = data[end + 4:]
    version, _, tail = lines[0].partition(b" ")
    code, _, reason = tail.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise BadResponse(f"bad status line {lines[0]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise BadResponse(f"bad header line {line!r}")
        headers.append((name.lower(), value.strip()))
    response = RawResponse(int(code), reason, headers, b"")
    status = response.status
    te = response.get(b"transfer-encoding")
    lengths = response.get(b"content-length")
    if head or status in (204, 304) or 100 <= status < 200:
        return response, rest
    if te:
        if te != [b"chunked"] or lengths:
            raise BadResponse(f"bad framing te={te} cl={lengths}")
        response.chunked = True
        body = b""
        while True:
            size_end = rest.find(b"\r\n")
            if size_end < 0:
                raise BadResponse("truncated chunked body (no size line)")
            size = int(rest[:size_end].split(b";")[0], 16)
            chunk = rest[size_end + 2:size_end + 2 + size]
            if len(chunk) < size or rest[size_end + 2 + size:size_end + 4 + size] != b"\r\n":
                raise BadResponse("truncated chunked body")
            rest = rest[size_end + 4 + size:]
            if size == 0:
                break
            body += chunk
        response.body = body
        return response, rest
    if lengths:
        if len(set(lengths)) != 1:
            raise BadResponse(f"conflicting Content-Length {lengths}")
        n = int(lengths[0])
        if len(rest) < n:
            raise BadResponse(f"body shorter than Content-Length: {len(rest)} < {n}")
        response.body = rest[:n]
        return response, rest[n:]
    if not at_eof:
        raise BadResponse("body delimited by close on an open connection")
    response.body = rest
    return response, b""


def parse_responses(data: bytes, head: bool = False, at_eof: bool = True) -> list[RawResponse]:
    """Every response in ``data``, in order (interim ``1xx`` ones included).

    :raises BadResponse: when the bytes are not well-formed HTTP/1.1 responses.
    """
    out: list[RawResponse] = []
    while data:
        response, data = _parse_one(data, head, at_eof)
        out.append(response)
    return out


def complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole, well-formed response (for ``until=``)."""
    try:
        return bool(parse_responses(data, at_eof=False))
    except (BadResponse, ValueError):
        return False


@implementer(IHalfCloseableProtocol)
class _Collect(Protocol):
    def __init__(self, chunks: list[bytes], until: Callable[[bytes], bool] | None) -> None:
        self.received = b""
        self.chunks = chunks
        self.until = until
        self.done: Deferred[bytes] = Deferred()
        self.closed: Deferred[None] = Deferred()
        self.how = ""
        self.wait_close = False

    def connectionMade(self) -> None:
        for chunk in self.chunks:
            self.transport.write(chunk)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if self.until is not None and self.until(self.received):
            self._finish("until")

    def readConnectionLost(self) -> None:
        if not self.wait_close:
            self._finish("half-close")

    def writeConnectionLost(self) -> None:
        pass

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self._finish("close")
        if not self.closed.called:
            self.closed.callback(None)

    def _finish(self, how: str) -> None:
        if not self.done.called:
            self.how = how
            self.done.callback(self.received)


async def raw_exchange(
    port: int,
    *chunks: bytes,
    timeout: float = 10.0,
    until: Callable[[bytes], bool] | None = None,
    wait_close: bool = False,
    trickle: bytes = b"",
) -> tuple[bytes, str]:
    """Send ``chunks`` on a new loopback connection to ``port`` and collect every byte
    until crossbar closes or half-closes it (or ``until(received)`` holds).

    Returns ``(received, how)``, ``how`` being ``"close"``, ``"half-close"`` or
    ``"until"``; with ``wait_close`` a half-close is not an end (only a full close,
    ``until`` or the timeout are). The connection is closed and its end awaited before
    returning. ``trickle``, when given, is written again every 0.1 s until the
    connection ends (a client that keeps sending; a reset is only noticed on a write).

    :raises AssertionError: nothing ended within ``timeout`` seconds.
    """
    proto = _Collect(list(chunks), until)
    proto.wait_close = wait_close
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), proto)
    timer = reactor.callLater(timeout, proto._finish, "timeout")
    sender = LoopingCall(proto.transport.write, trickle)  # type: ignore[union-attr]
    if trickle:
        sender.start(0.1)
    received = await proto.done
    if sender.running:
        sender.stop()
    if timer.active():
        timer.cancel()
    proto.transport.abortConnection()  # type: ignore[union-attr]
    await proto.closed
    assert proto.how != "timeout", f"no end within {timeout}s; got {received[:300]!r}"
    return received, proto.how


def request_bytes(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
                  body: bytes = b"", close: bool = True) -> bytes:
    """A raw HTTP/1.1 request: ``Host`` first, then ``headers`` as given, then
    ``Connection: close`` (when ``close``)."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: crossbar.test"]
    lines += [n + b": " + v for n, v in headers]
    if close:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def upstream_requests(upstream: FakeLlama) -> list[Any]:
    """What the upstream saw apart from health polls."""
    return [s for s in upstream.seen if s.uri not in (b"/health", b"/v1/models")]


@dataclass
class TwoHosts:
    """crossbar in front of two FakeLlama hosts: ``a`` has ``model-a`` loaded, ``b``
    ``model-b``; route ``r`` is ``[a, b]`` with default model ``model-b``; route ``d``
    is ``[dead]`` (a host that answers health 503)."""

    a: FakeLlama
    b: FakeLlama
    dead: FakeLlama
    service: CrossbarService
    base: str
    port: int
    extra: dict[str, Any] = field(default_factory=dict)

    def chosen(self) -> list[str]:
        """Which host got each proxied request, in order."""
        out = [(s, "a") for s in upstream_requests(self.a)] + [(s, "b") for s in upstream_requests(self.b)]
        return [name for _, name in out]


class _QuietSite(Site):
    """An upstream's site without an access log, so captured log events are crossbar's."""

    noisy = False

    def log(self, request: Any) -> None:
        pass


async def quiet_listen(case: TestCase, resource: Resource) -> str:
    """Like :func:`tests.harness.listen`, without the upstream's access log."""
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(_QuietSite(resource))
    case.addCleanup(port.stopListening)
    return f"http://127.0.0.1:{port.getHost().port}"


async def two_hosts(case: TestCase, timeouts: str = "") -> TwoHosts:
    """Start :class:`TwoHosts` and wait for the first poll round."""
    a, b, dead = FakeLlama(["model-a"]), FakeLlama(["model-b"]), FakeLlama(["model-x"])
    dead.health_code = 503
    urls = [await quiet_listen(case, u) for u in (a, b, dead)]
    service, base = await start_crossbar(
        case,
        f"""
health: {{interval: 60, timeout: 5}}
{timeouts}
hosts:
  a: {urls[0]}
  b: {urls[1]}
  dead: {urls[2]}
routes:
  r:
    hosts: [a, b]
    default_model: model-b
  d:
    hosts: [dead]
""",
    )
    await service.poller.when_first_round_done()
    port = int(base.rsplit(":", 1)[1])
    return TwoHosts(a, b, dead, service, base, port)
