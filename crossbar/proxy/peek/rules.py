"""The key rules of the body peek: the model (docs/design.md §The proxy rule 4), where it lies
for a rewrite (§"Model names") and the affinity key (§"Cache affinity").

Each rule is written twice, side by side in this one file: over ijson ``basic_parse``
events (:class:`EventRules`, fed by the incremental lexer in :mod:`.lexer`) and over a
body ``json.loads`` decoded (:func:`rules_of`, for small bodies that came in one chunk).
Both feed the same accumulator (:class:`_Found`: the top-level values, the messages'
hash, the infill chunk, the prompt's bytes) and share its :meth:`_Found.result`, so what
a key *is* is stated once; a change to what a rule *reads* touches the two walks below,
next to each other. ``tests/test_peek.py`` checks that both give the same answer.

The rules, in precedence order (the first that applies gives the key):

- ``k:`` the top-level string ``prompt_cache_key`` (OpenAI's routing hint);
- ``u:`` the top-level string ``user``;
- ``m:`` chat: the ``messages`` up to and including the first ``user`` message (each
  message's role and text content; the text parts of a content list in order);
- ``i:`` infill (llama.cpp ``/infill``, as llama.vim and llama.vscode send it): the first
  chunk of ``input_extra`` (its ``filename`` and the first :data:`PROMPT_BYTES` bytes of
  its ``text``), else the first :data:`PROMPT_BYTES` bytes of ``input_prefix``. See
  :func:`infill_key` for why;
- ``p:`` the first :data:`PROMPT_BYTES` bytes of ``prompt`` (a string, or a list of
  strings and token ids).

Work is bounded (hostile bodies): the rules look at no more than :data:`KEY_EVENTS`
events below the top level of a body; the conversation start (or prompt, or infill
list) is hashed up to that bound and the rest is skipped: by the C loops of
:meth:`EventRules._skip` over events yajl already made, and from the next piece on by
the lexer without yajl (:mod:`.skip`; :meth:`EventRules.reopen` and
:meth:`EventRules.after_skipped` put a fresh parser where the old one was). The
decoded-dict walk is used only for a body that cannot reach the bound
(:func:`most_events`), so it needs none.
"""

from __future__ import annotations

import enum
import hashlib
from decimal import Decimal
from dataclasses import dataclass, field
from itertools import accumulate
from operator import itemgetter
from typing import Any, Final

__all__ = [
    "KEY_EVENTS", "MAX_DEPTH", "NOTHING", "PROMPT_BYTES", "EventRules", "Peeked", "Spot", "SpotKind",
    "infill_key", "most_events", "rules_of",
]

MAX_DEPTH: Final = 900
"""Deeper nesting gives no answer (``json.loads`` raises RecursionError near 1000)."""

PROMPT_BYTES: Final = 4096
"""Bytes of a ``prompt`` (or infill text) the affinity key is taken from (docs/design.md
§"Cache affinity")."""

KEY_EVENTS: Final = 16384
"""Events below a body's top level the key rules look at one by one, at most (without
it: 400,000 ``system`` messages before the first ``user`` one cost 1.7 s of CPU).
About 2,700 messages of a conversation start, or 5 ms of CPU."""


class SpotKind(enum.Enum):
    """What a model rewrite does at a :class:`Spot` (docs/design.md §"Model names")."""

    VALUE = "value"
    """Replace the bytes ``[start, end)``: the top-level ``"model"`` string, quotes included."""
    FIRST_MEMBER = "first member"
    """Insert ``"model": "<m>", `` at ``start`` (just after the object's ``{``)."""
    ONLY_MEMBER = "only member"
    """Insert ``"model": "<m>"`` at ``start`` (an empty object: no comma)."""


@dataclass(frozen=True)
class Spot:
    """Where a rewrite of the model goes: absolute byte offsets in the body as received
    (a UTF-8 BOM and leading whitespace included). ``start == end`` for an insertion."""

    start: int
    end: int
    kind: SpotKind


@dataclass(frozen=True)
class Peeked:
    """What the body peek found.

    ``model``: the top-level non-empty string ``"model"`` of a JSON object body, else None
    (docs/design.md §The proxy rule 4). ``affinity_key``: the request's affinity key (§"Cache
    affinity"), a short string ``"<source>:<hex>"`` with source ``k`` (prompt_cache_key),
    ``u`` (user), ``m`` (messages), ``i`` (infill) or ``p`` (prompt), else None.
    ``spot``: where a rewrite of the model goes (§"Model names"): the top-level
    ``"model"`` string when there is one (the last, as duplicates go), the object's first
    member when the object has no top-level ``"model"`` at all; None when the body is not
    a UTF-8 JSON object or its ``"model"`` is not a string. Two answers are equal when
    their model and key are (the spot depends on the bytes, not on what they say).
    """

    model: str | None
    affinity_key: str | None
    spot: Spot | None = field(default=None, compare=False)


NOTHING: Final = Peeked(None, None)
"""No model, no affinity key, no spot: not a JSON object."""


@dataclass(frozen=True)
class _Long:
    """A string the lexer took over: the blake2b digest of its text (UTF-8), its first
    PROMPT_BYTES bytes, and the text itself only where it is kept (a model name)."""

    digest: bytes
    head: bytes
    text: str | None


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


def _digest(*parts: bytes) -> str:
    h = _hasher()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def _text(value: object) -> bytes | None:
    """A string value's identity: the 16-byte blake2b digest of its UTF-8 text, the
    same whether yajl decoded it, json.loads did, or it was taken over as a long string."""
    if isinstance(value, str):
        h = _hasher()
        h.update(value.encode("utf-8", "surrogatepass"))
        return bytes(h.digest())
    if isinstance(value, _Long):
        return value.digest
    return None


def _utf8(value: object) -> bytes:
    """A string's UTF-8 bytes (a long string's first PROMPT_BYTES); b"" for anything else."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return value.head if isinstance(value, _Long) else b""


def infill_key(filename: object, text: object) -> str:
    """The infill affinity key (``i:``) of the first ``input_extra`` chunk (its
    ``filename`` and ``text``), or of ``input_prefix`` given as ``text`` with no filename.

    Why this part of an ``/infill`` body: llama.vim and llama.vscode (ggml-org's editor
    plugins) send ``{"id_slot": 0, "input_extra": [{"text", "time", "filename"}, ...],
    "input_prefix": <up to 256 lines above the cursor>, "input_suffix": ..., "prompt":
    <the current line up to the cursor>, "cache_prompt": true, ...}``; llama-server builds
    the prompt as the extra chunks first (``<file_sep>filename\\ntext`` each), then the
    prefix, suffix and middle, and reuses the longest cached token prefix of its slot.
    ``input_extra`` is the plugin's ring buffer of recently seen code: chunks are
    appended at the end (one per ``ring_update_ms``, each followed by a warm-up request
    with ``n_predict: 0`` carrying the new ring) and the oldest is dropped first, so
    the first chunk is the part that stays the same longest, and it is where the
    host's cached prefix starts. Keying on the whole ring would move the session to
    another host at every append (losing the cache of every older chunk); keying on the
    prefix, the middle or ``prompt`` would move it at nearly every keystroke. A body
    with no chunk yet (a session's first seconds) keys on the start of ``input_prefix``
    (the start of the file while the cursor is within its first 256 lines).
    """
    return "i:" + _digest(_utf8(filename), _utf8(text)[:PROMPT_BYTES])


_TOP_VALUES: Final = ("model", "user", "prompt_cache_key", "input_prefix")
"""Top-level members whose last value the rules keep."""


class _Found:
    """What the rules took from a body so far, and the answer (:meth:`result`).

    Filled by :class:`EventRules` (event by event) or :func:`rules_of` (from a decoded
    dict), through the same methods, so both give the same key.
    """

    def __init__(self) -> None:
        self.top: dict[str, object] = {}  # last value of model, user, prompt_cache_key, input_prefix
        self.messages: Any = None  # a hasher while "messages" is a list (None: absent or not a list)
        self.message_count = 0
        self.infill: str | None = None  # the key of the first usable input_extra chunk
        self.prompt: bytearray | None = None  # None: absent or unusable; else the bytes so far
        self.spot: Spot | None = None  # where the model lies (set by the front end)
        self.model_key = False  # any top-level "model" member (whatever its value)
        self.members = 0  # top-level members seen
        self.brace: int | None = None  # absolute offset of the top-level "{" (None: not UTF-8)

    def top_value(self, key: object, value: object) -> None:
        """A top-level member ``key``'s value (a scalar, ``[]`` for a list, None for an
        object): the last one wins, as with duplicate keys in ``json.loads``."""
        if key in _TOP_VALUES:
            assert isinstance(key, str)
            self.top[key] = value
        elif key == "messages":
            self.messages = _hasher() if value == [] else None
            self.message_count = 0
        elif key == "input_extra":
            self.infill = None
        elif key == "prompt":
            if isinstance(value, (str, _Long)):
                self.prompt = bytearray()
                self.prompt_item(value)
            else:
                self.prompt = bytearray() if value == [] else None

    def message(self, role: object, text_count: int, texts: Any) -> None:
        """One message of the conversation start: its role and its texts' digests
        (``texts``: a hasher over them, ``text_count`` of them)."""
        h = self.messages
        role_bytes = _utf8(role)
        h.update(len(role_bytes).to_bytes(8, "big") + role_bytes)
        h.update(text_count.to_bytes(8, "big") + texts.digest())
        self.message_count += 1

    def prompt_item(self, value: object) -> bool:
        """A string or token id of the prompt; True once PROMPT_BYTES are taken."""
        if self.prompt is None:
            return False
        if isinstance(value, (str, _Long)):
            self.prompt += _utf8(value)[:PROMPT_BYTES]
        elif isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
            self.prompt += b"%s " % str(value).encode("ascii")
        if len(self.prompt) >= PROMPT_BYTES:
            del self.prompt[PROMPT_BYTES:]
            return True
        return False

    def result(self) -> Peeked:
        """The answer: model, affinity key (the first rule that applies), spot."""
        model = self.top.get("model")
        if isinstance(model, _Long):
            model = model.text
        if not (isinstance(model, str) and model):
            model = None
        return Peeked(model, self._key(), self._spot())

    def _key(self) -> str | None:
        for name, tag in (("prompt_cache_key", "k"), ("user", "u")):
            value = self.top.get(name)
            if isinstance(value, (str, _Long)) and value != "":
                return tag + ":" + _text(value).hex()  # type: ignore[union-attr]
        if self.message_count:
            return "m:" + self.messages.hexdigest()
        if self.infill is not None:
            return self.infill
        prefix = self.top.get("input_prefix")
        if isinstance(prefix, (str, _Long)) and prefix != "":
            return infill_key(None, prefix)
        if self.prompt:
            return "p:" + _digest(bytes(self.prompt))
        return None

    def _spot(self) -> Spot | None:
        if self.brace is None:
            return None
        if self.model_key:
            return self.spot  # None unless the last "model" was a string the front end placed
        kind = SpotKind.FIRST_MEMBER if self.members else SpotKind.ONLY_MEMBER
        return Spot(self.brace + 1, self.brace + 1, kind)


# ---------------------------------------------------------------------------------------
# The rules over ijson events (bodies read incrementally).

_DELTA: Final = {"start_map": 1, "start_array": 1, "end_map": -1, "end_array": -1, "map_key": 0,
                 "string": 0, "number": 0, "boolean": 0, "null": 0}
_EVENT: Final = itemgetter(0)


class EventRules(_Found):
    """Turns ijson ``basic_parse`` events into the model and the affinity key.

    Only the containers the rules look at are entered (the top-level object, ``messages``
    up to its first ``user`` message, a message's ``content`` list and its parts,
    ``input_extra`` up to its first chunk with a text, a ``prompt`` list until
    PROMPT_BYTES are taken); any other container is skipped with C loops over the
    events (a running nesting level, no Python per event). Events below the top level
    that are looked at one by one are counted in :attr:`steps`, at most
    :data:`KEY_EVENTS`: then the key is what was taken so far and the rest is skipped.

    The lexer sets :attr:`long` (a taken-over string, in place of the next string
    event's value) and reads :attr:`model_at` (the index, in the last batch, of a
    top-level ``"model"`` string event) to place the model (:attr:`spot`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # containers entered
        self.skip = 0  # levels still open in a skipped container
        self.steps = 0  # events below the top level looked at one by one
        self.last = ""
        self.k1: object = None  # current top-level key
        self.k3: object = None  # current key in a message or an input_extra chunk
        self.k5: object = None  # current key in a content part
        self.role: object = None
        self.texts: Any = _hasher()  # the digests of the current message's texts, in order
        self.text_count = 0
        self.part_type: object = None
        self.part_text: bytes | None = None
        self.chunk: dict[object, object] = {}  # the current input_extra chunk's filename and text
        self.long: _Long | None = None
        self.model_at: int | None = None
        self.skip_map = False  # the container skipped at depth > 1 is an object (else a list)

    def reopen(self) -> bytes:
        """JSON text that opens the containers the rules are in (:attr:`depth` of them)
        and the one being skipped, each ready for its next value: a fresh parser fed
        it, then the skipped container's closing bracket, is where the old one was
        (used by the lexer to resume after skipping bytes itself, at depth > 1)."""
        third = b"[" if self.k1 == "prompt" else b'{"":'
        return b"".join((b'{"":', b"[", third, b"[", b'{"":')[:self.depth]) + (b"{" if self.skip_map else b"[")

    def after_skipped(self, inside: bool) -> None:
        """The lexer skipped bytes itself up to a point where the parse resumes with a
        fresh parser: at the closing bracket of the container being skipped
        (``inside``: its end event is still to come), else at depth 1 after a member."""
        self.skip = 1 if inside else 0
        self.last = "end_array"
        self.long = None

    def wants_long(self) -> bool:
        """Whether a string starting now may be the model or part of the affinity key."""
        d = self.depth
        if self.skip:
            return False
        k1 = self.k1
        if self.last == "map_key":
            return ((d == 1 and k1 in ("model", "user", "prompt_cache_key", "prompt", "input_prefix"))
                    or (d == 3 and k1 == "messages" and self.k3 == "content")
                    or (d == 3 and k1 == "input_extra" and self.k3 in ("text", "filename"))
                    or (d == 5 and k1 == "messages" and self.k5 == "text"))
        return d in (2, 3) and k1 == "prompt"

    def take(self, events: list[tuple[str, Any]]) -> None:
        """Process a batch of events in order. Raises ValueError on a body that is not
        an object or nests deeper than MAX_DEPTH."""
        i, n = 0, len(events)
        self.model_at = None
        while i < n:
            if self.skip:
                i = self._skip(events, i)
                continue
            event, value = events[i]
            i += 1
            if self.long is not None and (event == "string" or event == "map_key"):
                value, self.long = self.long, None
            depth = self.depth
            if depth > 1:
                self.steps += 1
                if self.steps > KEY_EVENTS:
                    self._bound(event)
                    continue
            if event == "map_key":
                if depth == 1:
                    self.k1 = value
                    self.members += 1
                elif depth == 3:
                    self.k3 = value
                    if value == "content" and self.k1 == "messages":
                        self._texts(None)
                elif depth == 5:
                    self.k5 = value
            elif event == "start_map" or event == "start_array":
                if self._enter(depth, event == "start_map"):
                    self.depth = depth + 1
                elif i < n and events[i][0][:4] == "end_":  # an empty container
                    event = events[i][0]
                    i += 1
                else:
                    self.skip, self.skip_map = 1, event == "start_map"
            elif event == "end_map" or event == "end_array":
                self.depth = depth - 1
                k1 = self.k1
                if depth == 3 and k1 == "messages":  # a message ends
                    self._message_done()
                elif depth == 5 and k1 == "messages":  # a content part ends
                    if self.part_type == "text" and self.part_text is not None:
                        self.texts.update(self.part_text)
                        self.text_count += 1
                elif depth == 3 and k1 == "input_extra":  # a chunk ends
                    text = self.chunk.get("text")
                    if isinstance(text, (str, _Long)):
                        self.infill = infill_key(self.chunk.get("filename"), text)
                        self.skip, self.depth = 1, 1  # the other chunks play no part
            else:  # a scalar
                if depth == 1:
                    self._top_scalar(value, i - 1, event)
                elif depth == 3:
                    k1 = self.k1
                    if k1 == "prompt":
                        self._prompt(value)
                    elif k1 == "input_extra":
                        self.chunk[self.k3] = value
                    elif self.k3 == "role":
                        self.role = value
                    elif self.k3 == "content":
                        self._texts(_text(value))
                elif depth == 5:
                    if self.k5 == "type":
                        self.part_type = value
                    elif self.k5 == "text":
                        self.part_text = _text(value)
                elif depth == 2 and self.k1 == "prompt":
                    self._prompt(value)
            self.last = event

    def _top_scalar(self, value: object, index: int, event: str) -> None:
        key = self.k1
        self.top_value(key, value)
        if key == "model":
            self.model_key = True
            self.spot = None  # placed by the front end after this batch (model_at)
            self.model_at = index if event == "string" else None

    def _enter(self, depth: int, is_map: bool) -> bool:
        """Whether a container starting at ``depth`` is entered (else skipped)."""
        if depth == 0:
            if not is_map:
                raise ValueError("not an object")
            return True
        k1 = self.k1
        if depth == 1:
            self.top_value(k1, None if is_map else [])
            if k1 == "model":
                self.model_key, self.spot, self.model_at = True, None, None
            return not is_map and k1 in ("messages", "prompt", "input_extra") and self.steps < KEY_EVENTS
        if k1 == "messages":
            if depth == 2 and is_map:  # a message starts
                self.role, self.k3 = None, None
                self._texts(None)
                return True
            if depth == 3 and not is_map and self.k3 == "content":
                return True
            if depth == 4 and is_map:  # a content part starts
                self.part_type, self.part_text, self.k5 = None, None, None
                return True
            return False
        if k1 == "input_extra":
            if depth == 2 and is_map:  # a chunk starts
                self.chunk, self.k3 = {}, None
                return True
            if depth == 3:  # a container as a chunk's member: not a string
                self.chunk[self.k3] = None
            return False
        return k1 == "prompt" and depth == 2 and not is_map

    def _skip(self, events: list[tuple[str, Any]], i: int) -> int:
        """Skip events from ``i`` until the skipped container ends; return the next index.

        Looks ahead in windows growing fourfold, so skipping many small containers in
        one batch stays linear in the batch.
        """
        n, level = len(events), self.skip
        for k in range(i, min(n, i + 16)):  # most skipped containers are small
            level += _DELTA[events[k][0]]
            if level == 0:
                self.skip = 0
                self.last = events[k][0]
                self.long = None
                return k + 1
            if self.depth + level > MAX_DEPTH:
                raise ValueError("nesting too deep")
        i, window = min(n, i + 16), 64
        while i < n:
            stop = min(n, i + window)
            levels = list(accumulate(map(_DELTA.__getitem__, map(_EVENT, events[i:stop])),
                                     initial=level))
            if self.depth + max(levels) > MAX_DEPTH:
                raise ValueError("nesting too deep")
            try:
                j = levels.index(0, 1)  # levels[k]: the level after events[i + k - 1]
            except ValueError:
                level, i, window = levels[-1], stop, window * 4
                continue
            self.skip = 0
            self.last = events[i + j - 1][0]
            self.long = None
            return i + j
        self.skip = level
        return n

    def _bound(self, event: str) -> None:
        """KEY_EVENTS reached at ``event`` (not looked at): the key is what was taken so
        far (a message under way counts as far as it got); the rest of this top-level
        member is skipped."""
        self.long = None
        if self.k1 == "messages" and self.depth >= 3:
            self.message(self.role, self.text_count, self.texts)
        self.skip, self.depth, self.last = self.depth - 1 + _DELTA[event], 1, event

    def _message_done(self) -> None:
        self.message(self.role, self.text_count, self.texts)
        if self.role == "user":  # the rest of messages plays no part: skip it
            self.skip, self.depth = 1, 1

    def _texts(self, first: bytes | None) -> None:
        """Start the current message's texts afresh (with ``first``, a text digest)."""
        self.texts, self.text_count = _hasher(), 0
        if first is not None:
            self.texts.update(first)
            self.text_count = 1

    def _prompt(self, value: object) -> None:
        if self.prompt_item(value) and self.depth > 1:  # the rest of the prompt list plays no part
            self.skip, self.depth = self.depth - 1, 1


# ---------------------------------------------------------------------------------------
# The same rules over a decoded body (json.loads; small bodies in one chunk).


def most_events(body: bytes) -> int:
    """At least the number of ijson events of the JSON object ``body`` (bytes): a
    string per two quotes, two events per bracket, and a number or literal per comma or
    closing bracket. C-speed counts, no parse."""
    opens = body.count(b"{") + body.count(b"[")
    return body.count(b'"') // 2 + 3 * opens + body.count(b",")


class Unsure(Exception):
    """:func:`rules_of` cannot promise :class:`EventRules`' answer for this body (the
    walk over events reads duplicate keys one by one, a decoded dict keeps the last)."""


def rules_of(top: dict[str, Any]) -> _Found:
    """The rules over a decoded JSON object ``top`` (floats as Decimal), the same as
    :class:`EventRules` over its events, for a body whose :func:`most_events` is at most
    KEY_EVENTS (the bound is never met). The caller sets ``spot`` and ``brace``, then asks ``result()``.
    Raises Unsure where a container stands where the rules expect a scalar (a message's
    ``role``, a content part's ``type`` or ``text``, a chunk's ``text`` or ``filename``)."""
    found = _Found()
    found.members = len(top)
    found.model_key = "model" in top
    for name in _TOP_VALUES:  # what top_value keeps (a container stands for itself: not a string)
        if name in top:
            found.top[name] = top[name]
    messages = top.get("messages")
    if isinstance(messages, list):
        found.messages = _hasher()
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            if isinstance(role, (dict, list)):
                raise Unsure("role")
            texts, n = _hasher(), 0
            content = message.get("content")
            if isinstance(content, str):
                texts.update(_text(content))
                n = 1
            elif isinstance(content, list):
                for part in content:
                    if not isinstance(part, dict):
                        continue
                    kind, text = part.get("type"), part.get("text")
                    if isinstance(kind, (dict, list)) or isinstance(text, (dict, list)):
                        raise Unsure("part")
                    if kind == "text" and isinstance(text, str):
                        texts.update(_text(text))
                        n += 1
            found.message(role, n, texts)
            if role == "user":
                break
    extra = top.get("input_extra")
    if isinstance(extra, list):
        for chunk in extra:
            if not isinstance(chunk, dict):
                continue
            filename, text = chunk.get("filename"), chunk.get("text")
            if isinstance(filename, (dict, list)) or isinstance(text, (dict, list)):
                raise Unsure("chunk")
            if isinstance(text, str):
                found.infill = infill_key(filename, text)
                break
    prompt = top.get("prompt")
    if isinstance(prompt, str):
        found.prompt = bytearray()
        found.prompt_item(prompt)
    elif isinstance(prompt, list):
        found.prompt = bytearray()
        for item in prompt:
            if any(found.prompt_item(value) for value in (item if isinstance(item, list) else (item,))):
                break
    return found
