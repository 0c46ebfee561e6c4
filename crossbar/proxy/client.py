"""What the exchange writes to the client's connection (docs/design.md §The proxy, rules 6,
7 and 9; §Operations for the drain).

The mechanics of a Twisted ``Request``: crossbar's own JSON answers, the relayed
answer's head, ``Connection: close`` during a drain, and cutting a connection so the
client sees a truncated answer. The exchange decides; these functions write.
"""

from __future__ import annotations

from typing import Any, Iterable

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.web.iweb import IResponse
from twisted.web.server import Request

from crossbar.errors import error_headers, json_error_bytes, phrase
from crossbar.proxy.cors import cors_headers
from crossbar.upstream.h1client import HeaderPairs
from crossbar.proxy.headers import HOST_HEADER, answer_headers, relayable_phrase, upstream_headers

__all__ = [
    "abort_connection", "close_if_draining", "error_body", "forwarded_headers", "write_head", "write_json",
]



def close_if_draining(request: Request, draining: bool) -> None:
    """During a drain, answer with ``Connection: close`` and close after it."""
    if not draining:
        return
    request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
    channel = request.channel
    if channel is not None:
        channel.persistent = False


def write_json(request: Request, code: int, body: bytes, retry_after: bool | int, draining: bool) -> int:
    """Answer ``code`` with the JSON ``body`` and finish; ``retry_after``: True for
    ``Retry-After: 1`` (busy answers), or a number of seconds. Returns the body bytes
    sent (0 for HEAD)."""
    request.setResponseCode(code, phrase(code))
    request.responseHeaders.removeHeader(b"server")
    extra = cors_headers(request.requestHeaders)  # like the hosts' answers
    if retry_after:
        extra += ((b"Retry-After", str(int(retry_after)).encode("ascii")),)
    for name, value in error_headers(code, extra) if code >= 400 else extra + ((b"Content-Type", b"application/json"),):
        request.setHeader(name, value)
    request.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
    close_if_draining(request, draining)
    request.write(body)
    request.finish()
    return 0 if request.method == b"HEAD" else len(body)


def error_body(request: Request, code: int, message: str, host: str | None) -> bytes:
    """Crossbar's own JSON error (rule 9) of status ``code`` saying ``message``; ``host``
    names the host that failed (in the error object and ``X-Crossbar-Host``, like a
    relayed answer)."""
    if host is None:
        return json_error_bytes(code, message)
    request.setHeader(HOST_HEADER, host.encode("utf-8"))
    return json_error_bytes(code, message, host=host)


def write_head(request: Request, response: IResponse, host: str, draining: bool,
               extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send the host's answer head to the client at once, before any body byte
    (docs/design.md §Quality bar): its status and headers (rule 6), ``extra`` headers of
    crossbar's (replacing the host's of those names: a key's rate-limit headers, §Access)
    and ``X-Crossbar-Host``."""
    request.setResponseCode(response.code, relayable_phrase(response.phrase))
    answer_headers(response, request.responseHeaders, request.method)
    for name, value in extra:
        request.responseHeaders.setRawHeaders(name, [value])
    close_if_draining(request, draining)
    request.responseHeaders.setRawHeaders(HOST_HEADER, [host.encode("utf-8")])
    request.write(b"")  # the head goes out now, not with the first body chunk


def abort_connection(request: Request) -> None:
    """Cut the client's connection: it sees a truncated answer, never a clean end."""
    transport: Any = request.channel.transport if request.channel is not None else None
    if transport is not None:
        transport.abortConnection()


def forwarded_headers(request: Request, keyed: bool, api_key: str | None, client_key: str) -> HeaderPairs:
    """The headers to send upstream for ``request`` (rule 6,
    :func:`~crossbar.proxy.headers.upstream_headers`): its client's address and whether
    it came over TLS read from the connection. ``client_key``: the name of the key the
    client presented ("" for none); a keyless request on a ``keyed`` route (a CORS
    preflight) never carries the host's ``api_key`` (§Access)."""
    client = request.getClientAddress()
    if keyed and not client_key:
        api_key = None
    return upstream_headers(
        request.requestHeaders, keyed=keyed, api_key=api_key, secure=request.isSecure(),
        client=client.host if isinstance(client, (IPv4Address, IPv6Address)) else None)
