"""Which upstream paths a route forwards (docs/design.md §The proxy, rules 3 and 10).

A core module: the request path classifies each request with :func:`classify_path`, and
the config refuses a route ``paths`` entry the forbidden list covers
(:func:`is_forbidden`). Pure: bytes in, a verdict out.
"""

from __future__ import annotations

import re
from enum import Enum
from urllib.parse import unquote_to_bytes

__all__ = ["FORBIDDEN", "KEYLESS", "MODEL_LISTS", "NATIVE", "NATIVE_READ", "READ_ONLY", "PathKind", "classify_path",
           "is_forbidden", "needs_no_key", "path_kind"]

_SLASHES = re.compile(rb"/{2,}")
_READ = (b"GET", b"HEAD")

FORBIDDEN = (b"/slots", b"/models/load", b"/models/unload", b"/models/sse", b"/metrics", b"/tools", b"/cors-proxy")
"""Paths refused whatever a route allows, with everything under them (rule 3): they
change a host (slots save/restore/erase, loading and unloading models) or show other
clients' data (slot contents, the host's metrics, its tools and CORS proxy)."""

READ_ONLY = (b"/models", b"/props", b"/lora-adapters")
"""Paths (and, for ``/models``, everything under it) that only GET and HEAD may reach:
a POST to them changes the host's settings or loads a model."""

NATIVE = (
    b"/completion", b"/completions", b"/infill", b"/tokenize", b"/detokenize", b"/embedding",
    b"/embeddings", b"/rerank", b"/reranking", b"/apply-template", b"/chat/completions",
    b"/chat/completions/input_tokens", b"/responses",
)
"""llama.cpp's own endpoints that its clients call (editor plugins post to ``/infill``)."""

NATIVE_READ = (b"/health", b"/props", b"/lora-adapters")
"""llama.cpp's endpoints forwarded for GET and HEAD only."""

KEYLESS = (b"/health", b"/v1/health")
"""GET/HEAD of these needs no key on a keyed route, as on llama-server itself (rule 2):
load balancers and llama.cpp's clients probe them without credentials."""

MODEL_LISTS = (b"/v1/models", b"/models")
"""``GET`` of these is the route model list (rule 10), answered by crossbar."""


class PathKind(Enum):
    """What rule 3 makes of a request's path (docs/design.md §The proxy, rules 3 and 10)."""

    FORWARD = "forward"
    MODEL_LIST = "model list"
    FORBIDDEN = "forbidden path"
    NOT_FOUND = "not found"


def _under(path: bytes, names: tuple[bytes, ...], dirs: tuple[bytes, ...]) -> bool:
    """Whether ``path`` is one of ``names`` or below one of them; ``dirs`` is ``names``
    each with a ``/`` appended (built once: this runs for every request)."""
    return path in names or path.startswith(dirs)


def _dirs(names: tuple[bytes, ...]) -> tuple[bytes, ...]:
    return tuple(n + b"/" for n in names)

_FORBIDDEN_DIRS = _dirs(FORBIDDEN)
_READ_ONLY_TREE = READ_ONLY[:1]  # /models and everything under it
_READ_ONLY_TREE_DIRS = _dirs(_READ_ONLY_TREE)


_KINDS: dict[tuple[bytes, bytes, tuple[str, ...]], PathKind] = {}
_KINDS_MAX = 512  # a client sending many different paths only churns it (cleared when full)
_KINDS_PATH_MAX = 256  # bytes: longer paths are classified each time, never kept


def classify_path(method: bytes, rest: bytes, paths: tuple[str, ...] = ()) -> PathKind:
    """:func:`path_kind`, remembered for up to 512 short (method, path, route paths):
    clients post to a handful of paths, and this runs for every request. At most
    512 x 256 bytes of paths are kept (a query string never is)."""
    key = (method, rest, paths)
    kind = _KINDS.get(key)
    if kind is None:
        kind = path_kind(method, rest, paths)
        if len(rest) <= _KINDS_PATH_MAX:
            if len(_KINDS) >= _KINDS_MAX:
                _KINDS.clear()
            _KINDS[key] = kind
    return kind


def path_kind(method: bytes, rest: bytes, paths: tuple[str, ...] = ()) -> PathKind:
    """Rule 3 for a request whose ``rest`` has no dot-segment: forbidden, the route
    model list, forwarded, or not found.

    The forbidden list is matched as a host might read the path — percent-decoded once,
    runs of ``/`` taken as one, with and without a leading ``/v1`` (llama-server serves
    most endpoints under both) — and wins over everything, the route's own ``paths``
    included. What is forwarded is matched on the path exactly as received, so an
    encoded or doubled form of an allowed path is not found rather than forwarded.

    :param method: the request method (exact case; other methods were refused before).
    :param rest: the path after the route segment, as received (no query).
    :param paths: the route's extra forwarded paths: exact, or prefixes ending in ``/``.
    """
    read = method in _READ
    if is_forbidden(rest, read):
        return PathKind.FORBIDDEN
    if read and rest in MODEL_LISTS:
        return PathKind.MODEL_LIST
    if rest.startswith(b"/v1/") or rest in NATIVE or (read and rest in NATIVE_READ):
        return PathKind.FORWARD
    for extra in paths:
        wanted = extra.encode("utf-8")
        if rest == wanted or (wanted.endswith(b"/") and rest.startswith(wanted)):
            return PathKind.FORWARD
    return PathKind.NOT_FOUND


def needs_no_key(method: bytes, rest: bytes) -> bool:
    """Whether a request for ``rest`` (the path after the route, as received) needs no key
    on a keyed route: GET or HEAD of :data:`KEYLESS` (rule 2)."""
    return method in _READ and rest in KEYLESS


def is_forbidden(rest: bytes, read: bool) -> bool:
    """Whether the forbidden list of rule 3 covers ``rest`` for a GET/HEAD (``read``) or
    another method, matched as received, percent-decoded once with runs of ``/`` taken
    as one, and each with and without a leading ``/v1``."""
    # find, not ``in``: a bytes ``in`` first tries its needle as an int (a TypeError raised and cleared)
    decoded = unquote_to_bytes(rest) if rest.find(b"%") >= 0 else rest
    if decoded.find(b"//") >= 0:
        decoded = _SLASHES.sub(b"/", decoded)
    for p in {rest, decoded, decoded[3:] if decoded.startswith(b"/v1/") else decoded}:
        if _under(p, FORBIDDEN, _FORBIDDEN_DIRS):
            return True
        if not read and (_under(p, _READ_ONLY_TREE, _READ_ONLY_TREE_DIRS) or p in READ_ONLY[1:]):
            return True
    return False
