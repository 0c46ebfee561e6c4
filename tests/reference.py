"""Reference answers for tests: what ``json.loads`` says a body's model is (docs/design.md
§The proxy, rule 4). crossbar itself peeks incrementally (:mod:`crossbar.proxy.peek`); its
answers are checked against this one."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

__all__ = ["peek_model"]

_OBJECT_START = re.compile(rb"(?:\xef\xbb\xbf)?[ \t\r\n]*\{")

HEADROOM = 1000
"""Levels of nesting (and other calls) ``json.loads`` may use above its caller: CPython's
default recursion limit, as a shallow caller has it."""


def _depth() -> int:
    """Frames on the stack of the caller."""
    depth, frame = 0, sys._getframe(1)
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    return depth


def loads(body: bytes) -> Any:
    """``json.loads(body)`` with :data:`HEADROOM` levels above the caller, however deep the
    caller is: the recursion limit counts the caller's frames too, so without this a
    body nested 950 deep parses under plain pytest and raises RecursionError in a
    pytest-xdist worker (whose tests run some 40 frames deeper)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(_depth() + HEADROOM)
    try:
        return json.loads(body)
    finally:
        sys.setrecursionlimit(limit)


def peek_model(body: bytes) -> str | None:
    """The top-level string ``"model"`` of a JSON object body, else None (rule 4).

    Never raises: a body that is not JSON, not an object, has no ``model`` or a
    non-string one gives None. Duplicate keys: the last wins, as in llama-server.
    """
    if _OBJECT_START.match(body) is None:
        return None  # cheap: multipart, arrays and plain text are never parsed
    try:
        doc = loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    model = doc.get("model")
    return model if isinstance(model, str) and model else None
