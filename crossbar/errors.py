"""Error answers crossbar makes itself (docs/design.md §The proxy, rule 9).

Every one has the shape llama-server's own errors have, and OpenAI's::

    {"error": {"code": 404, "message": "unknown route", "type": "invalid_request_error"}}

so a client reads crossbar's errors and its hosts' alike (``error.message``,
``error.type``). Where crossbar names the host that failed (502, 504), ``"host"`` is a
member of the error object.

One writer for every path: :func:`error_headers` are the headers of every error answer
(its extra headers -- CORS, ``WWW-Authenticate``, ``Allow`` --, ``Retry-After`` on every
503, the JSON content type), set on a ``Request`` by the proxy and the ops app alike;
:func:`raw_error_answer` writes the same answer as bytes for the early answers made on
the connection before (or without) a ``Request``: a head Twisted cannot parse, a body
refused on its head, a connection over the bound. A HEAD's answer has no body.
"""

from __future__ import annotations

import json
from typing import Sequence

from twisted.web.http import RESPONSES

__all__ = ["error_headers", "error_type", "json_error_bytes", "phrase", "raw_error_answer"]

Header = tuple[bytes, bytes]

_PHRASES = {413: b"Content Too Large", 429: b"Too Many Requests"}  # RFC 9110's names twisted.web lacks

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "unavailable_error",
    504: "server_error",
}


def error_type(code: int) -> str:
    """The error ``type`` for HTTP status ``code`` (rule 9): the named ones from the
    table, any other 4xx ``invalid_request_error``, anything else ``server_error``."""
    named = _TYPES.get(code)
    if named is not None:
        return named
    return "invalid_request_error" if 400 <= code < 500 else "server_error"


def json_error_bytes(code: int, message: str, **extra: str) -> bytes:
    """The body of an error answer (rule 9):
    ``{"error": {"code": code, "message": message, "type": ..., **extra}}``.

    :param code: the answer's HTTP status (an ``int``).
    :param message: the error text, never a secret or a body.
    :param extra: more string members of the error object (``host`` for 502/504).
    :returns: UTF-8 JSON bytes.
    """
    return json.dumps({"error": {"code": code, "message": message, "type": error_type(code), **extra}}).encode("utf-8")


def phrase(code: int) -> bytes:
    """The reason phrase of status ``code`` (RFC 9110's, e.g. ``b"Too Many Requests"``)."""
    return _PHRASES.get(code) or RESPONSES.get(code, b"Error")


def error_headers(code: int, extra: Sequence[Header] = ()) -> list[Header]:
    """The headers of an error answer of status ``code`` (rule 9): ``extra`` as given,
    ``Retry-After: 1`` for a 503 that names no ``Retry-After`` (every 503 crossbar makes
    tells a client when to come back, rule 10), and ``Content-Type: application/json``.

    :param extra: (name, value) pairs: CORS, ``WWW-Authenticate``, ``Allow``, ``Retry-After``.
    :returns: a new list of (name, value) ``bytes`` pairs.
    """
    headers = list(extra)
    if code == 503 and not any(name.lower() == b"retry-after" for name, _ in headers):
        headers.append((b"Retry-After", b"1"))
    headers.append((b"Content-Type", b"application/json"))
    return headers


def raw_error_answer(code: int, message: str, head_only: bool = False, extra: Sequence[Header] = ()) -> tuple[bytes, int]:
    """A whole HTTP/1.1 error answer as bytes, for a connection crossbar answers before
    (or without) a ``Request``, closing after it: the status line, :func:`error_headers`,
    ``Content-Length``, ``Connection: close`` and the :func:`json_error_bytes` body
    (none for a HEAD: ``head_only``).

    :returns: the bytes to write, and how many of them are body (for the request log).
    """
    body = json_error_bytes(code, message)
    sent = b"" if head_only else body
    lines = [b"HTTP/1.1 %d %s" % (code, phrase(code))]
    lines += [name + b": " + value for name, value in error_headers(code, extra)]
    lines += [b"Content-Length: %d" % len(body), b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + sent, len(sent)
