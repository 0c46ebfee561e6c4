"""Error answers crossbar makes itself (docs/design.md rule 9): always JSON ``{"error": ...}``."""

from __future__ import annotations

import json

__all__ = ["json_error_bytes"]


def json_error_bytes(message: str, **extra: str) -> bytes:
    """The body of an error answer: ``{"error": message, ...extra}`` (docs/design.md rule 9).

    :param message: the error text, never a secret or a body.
    :param extra: more string members (``host`` for 502/504).
    :returns: UTF-8 JSON bytes.
    """
    return json.dumps({"error": message, **extra}).encode("utf-8")
