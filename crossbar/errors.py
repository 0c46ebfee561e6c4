"""Error answers crossbar makes itself (docs/design.md §The proxy, rule 9).

Every one has the shape llama-server's own errors have, and OpenAI's::

    {"error": {"code": 404, "message": "unknown route", "type": "invalid_request_error"}}

so a client reads crossbar's errors and its hosts' alike (``error.message``,
``error.type``). Where crossbar names the host that failed (502, 504), ``"host"`` is a
member of the error object.
"""

from __future__ import annotations

import json

__all__ = ["error_type", "json_error_bytes"]

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
