"""Pure routing rules of the proxy (docs/design.md §The proxy, rules 1-4; choosing a host
is :mod:`crossbar.hosts.balance`).

Nothing here does I/O: each function takes bytes or names and answers, so each rule is
unit-tested on its own.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote_to_bytes

__all__ = [
    "has_dot_segment", "is_forwardable", "query_model", "replace_query_model", "split_route", "split_target",
]

_ABSOLUTE_FORM = re.compile(rb"[Hh][Tt][Tt][Pp][Ss]?://[^/?#]*")
_VISIBLE_ASCII = re.compile(rb"\A[\x21\x22\x24-\x7e]*\Z")  # no "#": a target has no fragment
_TOKEN = re.compile(rb"\A[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
def split_target(target: bytes) -> tuple[bytes, bytes]:
    """Split a request target into (path, query) where query keeps its leading ``?``.

    ``b"/a/v1/x?y=1"`` -> ``(b"/a/v1/x", b"?y=1")``; ``b"/a"`` -> ``(b"/a", b"")``.
    An absolute-form target (RFC 9112 §3.2.2, which a server must accept) is reduced to
    its path: ``b"http://crossbar:7777/a/v1/x"`` -> ``(b"/a/v1/x", b"")``. crossbar is
    no forward proxy: the authority in it never chooses where the request goes.
    """
    absolute = _ABSOLUTE_FORM.match(target)
    if absolute is not None:
        target = target[absolute.end():]
        if not target.startswith(b"/"):
            target = b"/" + target
    path, sep, query = target.partition(b"?")
    return path, sep + query


def split_route(path: bytes) -> tuple[str, bytes] | None:
    """Take the first path segment as the route (rule 1).

    Returns ``(route, rest)`` where ``rest`` is the remaining path, byte for byte, always
    starting with ``/``: ``b"/a/v1/x"`` -> ``("a", b"/v1/x")``; ``b"/a"`` and ``b"/a/"``
    -> ``("a", b"/")``. Returns None for no route segment: ``b"/"``, ``b"//x"``,
    ``b""``, ``b"noslash"``. A route segment that is not UTF-8 yields a route name that
    matches no configured route.
    """
    if not path.startswith(b"/"):
        return None
    segment, slash, remainder = path[1:].partition(b"/")
    if not segment:
        return None
    route = segment.decode("utf-8", errors="replace")
    return route, b"/" + remainder


def has_dot_segment(rest: bytes) -> bool:
    """Whether ``rest`` holds a ``.`` or ``..`` segment, also percent-encoded (rule 3).

    The path is percent-decoded once (as an upstream does) and split on ``/`` and ``\\``,
    so ``/v1/%2e%2e/slots`` and ``/v1/..%2Fslots`` are caught.
    """
    if b"." not in rest and b"%" not in rest:  # no dot, not even encoded (most paths)
        return False
    decoded = unquote_to_bytes(rest).replace(b"\\", b"/")
    return any(seg in (b".", b"..") for seg in decoded.split(b"/"))


def is_forwardable(method: bytes, target: bytes) -> bool:
    """Whether ``method`` is an HTTP token and ``target`` (rest and query) only visible
    ASCII without ``#`` (RFC 9110 §9.1, RFC 9112 §3.2: a request target has no
    fragment; a ``#`` hid a dot segment from :func:`has_dot_segment`, and the client
    side cut the target there), so the request can be sent upstream as it is.

    twisted.web's server lets other bytes through (only a space splits the request
    line); the client side refuses them. Such a request is answered 400 ``bad path``
    (docs/design.md §The proxy, rule 3) instead of being forwarded.
    """
    return _TOKEN.match(method) is not None and _VISIBLE_ASCII.match(target) is not None


_MODEL_PARAM = re.compile(rb"(?:(?<=[?&])|\A)model=([^&]*)")


def query_model(query: bytes) -> str | None:
    """The ``model`` query parameter of a GET or HEAD (rule 4; llama.cpp's router mode
    reads ``/props?model=X``): the first one, percent-decoded (``+`` as a space), or None
    when there is none or it is empty or not UTF-8. ``query`` keeps its leading ``?``."""
    found = _MODEL_PARAM.search(query)
    if found is None:
        return None
    raw = unquote_to_bytes(found.group(1).replace(b"+", b" "))
    try:
        model = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return model or None


def replace_query_model(query: bytes, model: str) -> bytes:
    """``query`` with the value of its first ``model`` parameter replaced by ``model``
    (percent-encoded), every other byte kept (§Model names: an alias in a GET's query)."""
    found = _MODEL_PARAM.search(query)
    if found is None:
        return query
    value = quote(model, safe="").encode("ascii")
    return query[:found.start(1)] + value + query[found.end(1):]
