"""CORS headers on crossbar's own answers (docs/design.md §The proxy, rule 9).

A browser client reads an answer of another origin only when it carries
``Access-Control-Allow-Origin``. The hosts' answers carry it (llama-server echoes the
request's ``Origin``), so crossbar's own answers -- a 401, a 404, the route model list,
a 503 -- do the same for a request with an ``Origin``: the browser then shows the
client crossbar's JSON message instead of a bare CORS failure. Proxied answers keep the
host's own headers untouched.
"""

from __future__ import annotations

from twisted.web.http_headers import Headers

__all__ = ["cors_headers"]


def cors_headers(request_headers: Headers) -> tuple[tuple[bytes, bytes], ...]:
    """The CORS headers for crossbar's own answer to a request with ``request_headers``:
    ``Access-Control-Allow-Origin: <its Origin>`` and ``Vary: Origin`` when it has
    exactly one ``Origin`` (what llama-server answers), else none."""
    origins = request_headers.getRawHeaders(b"origin") or []
    if len(origins) != 1 or not origins[0]:
        return ()
    return ((b"Access-Control-Allow-Origin", origins[0]), (b"Vary", b"Origin"))
