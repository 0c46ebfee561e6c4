"""The headers of a proxied request and its answer (docs/design.md §The proxy, rule 6;
§Access for ``Authorization``).

Pure functions of their arguments: the exchange calls them with what it knows (the
client's headers, the route's keys, the host's ``api_key``, the client's address), so
each header rule is unit-tested without a socket.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from crossbar.upstream.h1client import HeaderPairs

__all__ = [
    "HOP_BY_HOP", "HOST_HEADER", "answer_headers", "content_type", "hop_by_hop_names", "is_event_stream", "relayable_phrase",
    "upstream_headers",
]

HOST_HEADER = b"X-Crossbar-Host"
"""Set on every proxied answer: the name of the host that answered (docs/design.md §The proxy, rule 6)."""

HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
        b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade",
    }
)
"""Hop-by-hop header names (RFC 9110 §7.6.1, plus the common ``Proxy-Connection``)."""

_REPLACED_UPSTREAM = frozenset(
    {b"host", b"content-length", b"expect", b"x-forwarded-for", b"x-forwarded-host",
     b"x-forwarded-proto", b"forwarded"}
)
"""Client headers crossbar never forwards as they are: it sets its own (rule 6)."""

_CLIENT_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})
"""Where a client presents a keyed route's key; neither reaches a host (docs/design.md §Access)."""

_DROP_UPSTREAM = HOP_BY_HOP | _REPLACED_UPSTREAM
_DROP_UPSTREAM_KEYED = _DROP_UPSTREAM | _CLIENT_KEY_HEADERS
"""The client headers never forwarded, on a route without and with ``keys``, when the
client's ``Connection`` names none (made once: no set built per request)."""

_NO_BODY_CODES = (204, 304)


def hop_by_hop_names(headers: Headers, connection: Iterable[bytes] = ()) -> frozenset[bytes]:
    """The lower-cased names not to forward (docs/design.md §The proxy, rule 6):
    :data:`HOP_BY_HOP` and those listed in ``Connection`` -- the values in ``headers``
    and, for an upstream answer (whose ``Connection`` Twisted keeps out of
    ``IResponse.headers``), the raw values in ``connection``."""
    values = headers.getRawHeaders(b"connection")
    if values:
        connection = (*values, *connection)
    return _listed(connection)


def _listed(connection: Iterable[bytes]) -> frozenset[bytes]:
    """:data:`HOP_BY_HOP` and the names listed in the ``Connection`` values ``connection``."""
    if not connection:
        return HOP_BY_HOP  # usually no Connection list: no new set
    named = {token.strip().lower() for value in connection for token in value.split(b",")}
    named.discard(b"")
    return HOP_BY_HOP | named if named else HOP_BY_HOP


def relayable_phrase(phrase: bytes) -> bytes | None:
    """The upstream's reason phrase if it may be relayed as it is, else ``None`` (the
    standard phrase for the code is sent instead): RFC 9112 §4 allows only HTAB, SP,
    visible ASCII and obs-text, so a bare CR (which a lenient client could read as a
    line end, i.e. a header injected by the host) or a NUL never reaches the client."""
    if not phrase or any(c < 0x20 and c != 0x09 or c == 0x7F for c in phrase):
        return None
    return phrase


def upstream_headers(
    src: Headers, *, keyed: bool, api_key: str | None, client: str | None, secure: bool
) -> HeaderPairs:
    """The headers sent upstream (rule 6), as ``(name, values)`` pairs in the order they
    are written: the client's ``src``, hop-by-hop ones removed, ``Host`` left to the
    client side (the upstream's), fresh ``X-Forwarded-*``; ``Authorization`` per §Access.
    Names and values are the client's as ``src`` holds them (already checked and
    canonical there: no ``Headers`` is built to check them again).

    :param keyed: the route has ``keys``: the client's ``Authorization`` and
        ``X-Api-Key`` (its crossbar key) never leave crossbar.
    :param api_key: the host's ``api_key`` (printable ASCII, the config checks): sent as
        ``Authorization: Bearer``, never the client's (in its place when the client sent
        one); None for none (and for a keyless preflight on a keyed route).
    :param client: the client's address (``X-Forwarded-For``, exactly it), or None.
    :param secure: the client came over TLS (``X-Forwarded-Proto: https``).
    """
    drop = _DROP_UPSTREAM_KEYED if keyed else _DROP_UPSTREAM
    if src.hasHeader(b"connection"):
        drop = drop | hop_by_hop_names(src)
    host: Sequence[bytes] = ()
    out: list[tuple[bytes, Sequence[bytes]]] = []
    for name, values in src.getAllRawHeaders():
        if name.lower() not in drop:
            out.append((name, values))
        elif name == b"Host":  # Headers' names are canonical
            host = values
    if api_key is not None:
        bearer = (b"Authorization", [b"Bearer " + api_key.encode("ascii")])
        at = next((i for i, (name, _) in enumerate(out) if name == b"Authorization"), None)
        if at is None:
            out.append(bearer)
        else:
            out[at] = bearer
    if client:
        out.append((b"X-Forwarded-For", [client.encode("ascii", "replace")]))
    if host:
        out.append((b"X-Forwarded-Host", [host[0]]))
    out.append((b"X-Forwarded-Proto", [b"https" if secure else b"http"]))
    return out


def answer_headers(response: IResponse, out: Headers, method: bytes) -> None:
    """Copy the upstream answer's headers onto the client's answer ``out`` (rule 6):
    hop-by-hop ones dropped, repeated ones kept, and ``Content-Length`` kept when the
    upstream gave one (Twisted moves it to ``response.length``), so the answer is
    chunked only when the upstream's was. HEAD answers keep theirs in
    ``response.headers``; 204 and 304 carry none."""
    connection = getattr(response, "upstream_connection", None)
    if connection is None:
        drop = hop_by_hop_names(response.headers)
    else:  # an H1Response: its Connection values are kept out of its headers
        drop = _listed(connection)
    for name, values in response.headers.getAllRawHeaders():
        if name.lower() not in drop:
            out.setRawHeaders(name, values)
    length = response.length
    if isinstance(length, int) and response.code not in _NO_BODY_CODES and method != b"HEAD":
        out.setRawHeaders(b"Content-Length", [str(length).encode("ascii")])


def content_type(headers: Headers) -> bytes | None:
    """The (first) ``Content-Type`` value of ``headers``, or None."""
    types = headers.getRawHeaders(b"content-type")
    return types[0] if types else None


def is_event_stream(content_type: bytes | None) -> bool:
    """``content_type`` (a ``Content-Type`` value, or None) is ``text/event-stream``: a
    streamed answer."""
    return content_type is not None and content_type.startswith(b"text/event-stream")
