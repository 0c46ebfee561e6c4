"""Reference answers for tests: what ``json.loads`` says a body's model is (docs/design.md
§The proxy, rule 4). crossbar itself peeks incrementally (:mod:`crossbar.proxy.peek`); its
answers are checked against this one."""

from __future__ import annotations

import json
import re

__all__ = ["peek_model"]

_OBJECT_START = re.compile(rb"(?:\xef\xbb\xbf)?[ \t\r\n]*\{")


def peek_model(body: bytes) -> str | None:
    """The top-level string ``"model"`` of a JSON object body, else None (rule 4).

    Never raises: a body that is not JSON, not an object, has no ``model`` or a
    non-string one gives None. Duplicate keys: the last wins, as in llama-server.
    """
    if _OBJECT_START.match(body) is None:
        return None  # cheap: multipart, arrays and plain text are never parsed
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    model = doc.get("model")
    return model if isinstance(model, str) and model else None
