"""The body peek: the model, the affinity key and where the model lies, read from a
request body chunk by chunk as it arrives (docs/design.md §The proxy rule 4, §"Model names",
§"Cache affinity", §"Quality bar").

- :mod:`.lexer`: the front end. :class:`BodyPeek` turns chunks into ijson events (yajl,
  strings cut by chunk boundaries held or taken over, positions kept); a small body in
  one chunk is read with ``json.loads`` (:func:`peek_small`).
- :mod:`.skip`: the bytes of values no rule reads, skipped without yajl (strings and
  bracket nesting only), up to the next top-level key a rule reads.
- :mod:`.rules`: the key rules, over ijson events and over a decoded dict, side by side.
- :mod:`.rewrite`: the model written into the body's chunks at the peek's spot.
"""

from crossbar.proxy.peek.lexer import LONG_STRING, SMALL_BODY, BodyPeek, backend_name, peek, peek_small
from crossbar.proxy.peek.rewrite import Rewritten, rewrite_model
from crossbar.proxy.peek.rules import (
    KEY_EVENTS, MAX_DEPTH, NOTHING, PROMPT_BYTES, Peeked, Spot, SpotKind, infill_key,
)

__all__ = [
    "KEY_EVENTS", "LONG_STRING", "MAX_DEPTH", "NOTHING", "PROMPT_BYTES", "SMALL_BODY", "BodyPeek", "Peeked",
    "Rewritten", "Spot", "SpotKind", "backend_name", "infill_key", "peek", "peek_small", "rewrite_model",
]
