"""The model written into a request body in place (docs/design.md §"Model names"): the bytes
of the top-level ``"model"`` value replaced, or a ``"model"`` member inserted first, at
the :class:`~crossbar.proxy.peek.rules.Spot` the peek found; every other byte as the
client sent it, and only the chunk(s) holding changed bytes copied (§"Model names":
rewriting must not stall the reactor)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from crossbar.proxy.peek.rules import Spot, SpotKind

__all__ = ["Rewritten", "rewrite_model"]


@dataclass(frozen=True)
class Rewritten:
    """A rewritten body: its ``chunks`` (the untouched ones are the caller's own bytes
    objects) and its ``length`` in bytes (the new ``Content-Length``)."""

    chunks: list[bytes]
    length: int


def rewrite_model(chunks: Sequence[bytes], spot: Spot, target: str) -> Rewritten:
    """The body ``chunks`` (bytes, in order) with the model set to ``target`` at ``spot``
    (absolute offsets into the joined chunks): ``spot``'s bytes replaced by ``target``
    JSON-encoded, or ``"model": <target>, `` (no comma for an empty object) inserted.

    Chunks before and after the changed bytes are passed on as they are (the same
    objects); the chunk that holds ``spot.start`` and the one that holds ``spot.end``
    are sliced around the new bytes, the chunks wholly inside the old value dropped.
    Work: one pass over the chunk lengths plus a copy of at most two chunks. Raises
    ValueError when ``spot`` lies outside the body.
    """
    value = json.dumps(target).encode("ascii")
    if spot.kind is SpotKind.VALUE:
        new = value
    elif spot.kind is SpotKind.FIRST_MEMBER:
        new = b'"model": ' + value + b", "
    else:
        new = b'"model": ' + value
    total = sum(map(len, chunks))
    start, end = spot.start, spot.end
    if not 0 <= start <= end <= total or (spot.kind is not SpotKind.VALUE and start != end):
        raise ValueError("spot outside the body")
    out: list[bytes] = []
    offset = 0  # absolute offset of the current chunk
    it = iter(chunks)
    for chunk in it:  # chunks wholly before the spot (an insertion at a chunk's end goes after it)
        if offset + len(chunk) > start or (offset + len(chunk) == start == total):
            break
        out.append(chunk)
        offset += len(chunk)
    else:
        chunk = b""  # an empty body: only an insertion at 0 gets here (never for an object)
    head = memoryview(chunk)[:start - offset]
    # find the chunk holding ``end`` (the first byte after the old value)
    while offset + len(chunk) < end:
        offset += len(chunk)
        chunk = next(it)
    tail = memoryview(chunk)[end - offset:]
    out.append(b"".join((head, new, tail)))
    out.extend(it)
    return Rewritten(out, total - (end - start) + len(new))
