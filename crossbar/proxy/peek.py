"""The incremental body peek: the model and the affinity key of a request body, read
chunk by chunk as it arrives (DESIGN.md §The proxy rule 4, §"Cache affinity", §"Quality
bar": no request holds the reactor more than a few milliseconds).

:class:`BodyPeek` is fed each chunk ``Request.handleContentChunk`` gets (up to ~64 KiB)
and parses it with ijson's push interface over its C backend (yajl2). Nothing is
re-read: the work for a chunk is bounded by the chunk, however large the body.

What yajl buffers, and how the quadratic case is avoided: yajl keeps an unfinished token
(a string cut by a chunk boundary) in its own buffer and re-lexes that buffer from its
start on every following chunk, so a 15 MiB base64 string fed in 64 KiB pieces costs
O(n²) (measured: 4 ms per chunk at the end, ~0.5 s of CPU per body). So yajl is never
fed an open string: a cheap regex pass (C speed, no per-byte Python) finds where strings
open and close; the bytes of a string still open at the end of a chunk are held here
(up to :data:`LONG_STRING` bytes) and handed to yajl once it closes. A string longer
than that is *taken over*: its content is validated here as JSON text (escapes, control
characters, UTF-8, incrementally), hashed when the affinity key needs it, and dropped;
yajl is fed ``""`` in its place. So neither yajl nor this class ever holds a long string
(an image's base64 data): memory stays within ``LONG_STRING`` plus one chunk.

Answers are those of ``json.loads`` (``tests/reference.py``) on every body
except these, which give None here (no model, no key) and are not JSON anyway or are
never sent by a client: ``NaN``/``Infinity`` literals, numbers yajl/Decimal refuse
(exponents beyond ~10^999999999), a number token over 64 KiB cut by a chunk boundary,
nesting deeper than :data:`MAX_DEPTH`, raw UTF-8-encoded surrogates. An escaped lone
surrogate (``"\\ud800"``) in a string of at most ``LONG_STRING`` bytes becomes ``"?"``
(yajl's choice).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from itertools import accumulate
from operator import itemgetter
from decimal import Decimal
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

import ijson
from ijson.utils import sendable_list
from twisted.logger import Logger

__all__ = [
    "LONG_STRING", "MAX_DEPTH", "NOTHING", "PROMPT_BYTES", "SMALL_BODY", "BodyPeek", "Peeked", "backend_name",
    "peek", "peek_small",
]

LONG_STRING: Final = 256 * 1024
"""Bytes of one JSON string held for yajl across chunks; a longer one is taken over."""

MAX_DEPTH: Final = 900
"""Deeper nesting gives no answer (``json.loads`` raises RecursionError near 1000)."""

PROMPT_BYTES: Final = 4096
"""Bytes of a ``prompt`` the affinity key is taken from (DESIGN.md §"Cache affinity")."""

SMALL_BODY: Final = 64 * 1024
"""A body of at most this many bytes that arrives in one chunk is read with
``json.loads`` at :meth:`BodyPeek.finish` (:func:`peek_small`): ~2 us against ~14 us for
the incremental parse, and at most a few ms of reactor time even for a hostile body of
tiny tokens (issue 14)."""

_LONG_NUMBER: Final = 64 * 1024
_BOM: Final = codecs.BOM_UTF8
_WS: Final = b" \t\r\n"
# Outside a string: runs of non-quote bytes and complete strings. A string's content is
# taken by a lookahead (atomic: never backtracked into) and consumed by the backreference,
# so a string left open at the chunk's end fails at once; possessive quantifiers would
# say the same, but CPython 3.11.2 (Debian 12) gets ``*+`` wrong here.
_OUT = re.compile(rb'(?:[^"]+|"(?=([^"\\]*(?:\\.[^"\\]*)*))\1")*', re.DOTALL)
# Inside a string: valid content only (RFC 8259 §7); stops at '"', bad content or the end.
_IN = re.compile(rb'(?:[^"\\\x00-\x1f]+|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*')
_PARTIAL_ESCAPE = re.compile(rb"\\(?:u[0-9a-fA-F]{0,3})?\Z")
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\Z")
_NUMBER_BYTES: Final = b"-+.0123456789eE"

_DELTA: Final = {"start_map": 1, "start_array": 1, "end_map": -1, "end_array": -1, "map_key": 0,
                 "string": 0, "number": 0, "boolean": 0, "null": 0}
_EVENT: Final = itemgetter(0)

_log = Logger(namespace="crossbar.peek")


def _choose_backend() -> ModuleType:
    try:
        return ijson.get_backend("yajl2_c")
    except Exception as e:  # ImportError or a broken build: still correct, only slower
        _log.warn("ijson's C backend (yajl2_c) is unavailable ({error}); the body peek uses "
                  "ijson's {name} backend", error=str(e), name=ijson.backend)
        return ijson  # the best backend ijson found


_BACKEND: Final = _choose_backend()


def backend_name() -> str:
    """The ijson backend the peek uses: ``"yajl2_c"`` normally."""
    return str(getattr(_BACKEND, "backend_name", getattr(_BACKEND, "backend", "?")))


@dataclass(frozen=True)
class Peeked:
    """What the body peek found.

    ``model``: the top-level non-empty string ``"model"`` of a JSON object body, else None
    (DESIGN.md §The proxy rule 4). ``affinity_key``: the request's affinity key (§"Cache
    affinity"), a short string ``"<source>:<hex>"`` with source ``k`` (prompt_cache_key),
    ``u`` (user), ``m`` (messages) or ``p`` (prompt), else None.
    """

    model: str | None
    affinity_key: str | None


NOTHING: Final = Peeked(None, None)
"""No model, no affinity key."""


@dataclass(frozen=True)
class _Long:
    """A string taken over: the blake2b digest of its text (UTF-8), its first
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
    same whether yajl decoded it or it was taken over as a long string."""
    if isinstance(value, str):
        h = _hasher()
        h.update(value.encode("utf-8", "surrogatepass"))
        return bytes(h.digest())
    if isinstance(value, _Long):
        return value.digest
    return None


def _utf8(value: object) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return value.head if isinstance(value, _Long) else b""


class _Keys:
    """Turns ijson ``basic_parse`` events into the model and the affinity key.

    Only the containers the rules look at are entered (the top-level object, ``messages``
    up to its first ``user`` message, a message's ``content`` list and its parts, a
    ``prompt`` list until PROMPT_BYTES are taken); any other container is skipped with C
    loops over the events (a running nesting level, no Python per event), so a body of a
    million small tokens costs about what yajl itself costs.
    """

    def __init__(self) -> None:
        self.depth = 0  # containers entered
        self.skip = 0  # levels still open in a skipped container
        self.last = ""
        self.k1: object = None  # current top-level key
        self.k3: object = None  # current key in a message
        self.k5: object = None  # current key in a content part
        self.top: dict[str, object] = {}  # last value (or None) of model, user, prompt_cache_key
        # messages: a list value of "messages" (None: absent or not a list), hashed message by message
        self.messages: Any = None
        self.message_count = 0
        self.messages_done = False
        self.role: object = None
        self.texts: Any = _hasher()  # the digests of the current message's texts, in order
        self.text_count = 0
        self.part_type: object = None
        self.part_text: bytes | None = None
        # prompt: None (absent / unusable) or the bytes so far
        self.prompt: bytearray | None = None
        self.long: _Long | None = None

    def wants_long(self) -> bool:
        """Whether a string starting now may be the model or part of the affinity key."""
        d = self.depth
        if self.skip:
            return False
        if self.last == "map_key":
            return ((d == 1 and self.k1 in ("model", "user", "prompt_cache_key", "prompt"))
                    or (d == 3 and self.k1 == "messages" and self.k3 == "content")
                    or (d == 5 and self.k1 == "messages" and self.k5 == "text"))
        return d in (2, 3) and self.k1 == "prompt"

    def take(self, events: list[tuple[str, Any]]) -> None:
        """Process events in order. Raises ValueError on a body that is not an object
        or nests deeper than MAX_DEPTH."""
        i, n = 0, len(events)
        while i < n:
            if self.skip:
                i = self._skip(events, i)
                continue
            event, value = events[i]
            i += 1
            if self.long is not None and (event == "string" or event == "map_key"):
                value, self.long = self.long, None
            depth = self.depth
            if event == "map_key":
                if depth == 1:
                    self.k1 = value
                elif depth == 3:
                    self.k3 = value
                    if value == "content":
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
                    self.skip = 1
            elif event == "end_map" or event == "end_array":
                self.depth = depth - 1
                if self.k1 != "messages":
                    pass
                elif depth == 3:  # a message ends
                    self._message_done()
                elif depth == 5:  # a content part ends
                    if self.part_type == "text" and self.part_text is not None:
                        self.texts.update(self.part_text)
                        self.text_count += 1
            else:  # a scalar
                if depth == 1:
                    self._top_value(value)
                elif depth == 3:
                    if self.k1 == "prompt":
                        self._prompt_item(value)
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
                    self._prompt_item(value)
            self.last = event

    def _enter(self, depth: int, is_map: bool) -> bool:
        """Whether a container starting at ``depth`` is entered (else skipped)."""
        if depth == 0:
            if not is_map:
                raise ValueError("not an object")
            return True
        k1 = self.k1
        if depth == 1:
            self._top_value(None if is_map else [])
            return not is_map and (k1 == "messages" or k1 == "prompt")
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

    def _message_done(self) -> None:
        h = self.messages
        h.update(len(_utf8(self.role)).to_bytes(8, "big") + _utf8(self.role))
        h.update(self.text_count.to_bytes(8, "big") + self.texts.digest())
        self.message_count += 1
        if self.role == "user":  # the rest of messages plays no part: skip it
            self.messages_done = True
            self.skip, self.depth = 1, 1

    def _texts(self, first: bytes | None) -> None:
        """Start the current message's texts afresh (with ``first``, a text digest)."""
        self.texts, self.text_count = _hasher(), 0
        if first is not None:
            self.texts.update(first)
            self.text_count = 1

    def _top_value(self, value: object) -> None:
        key = self.k1
        if key in ("model", "user", "prompt_cache_key"):
            assert isinstance(key, str)
            self.top[key] = value
        elif key == "messages":  # duplicate keys: the last wins
            self.messages = _hasher() if value == [] else None
            self.message_count = 0
            self.messages_done = False
        elif key == "prompt":
            if isinstance(value, (str, _Long)):
                self.prompt = bytearray()
                self._prompt_item(value)
            else:
                self.prompt = bytearray() if value == [] else None

    def _prompt_item(self, value: object) -> None:
        if self.prompt is None:
            return
        if isinstance(value, (str, _Long)):
            self.prompt += _utf8(value)[:PROMPT_BYTES]
        elif isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
            self.prompt += b"%s " % str(value).encode("ascii")
        if len(self.prompt) >= PROMPT_BYTES:
            del self.prompt[PROMPT_BYTES:]
            if self.depth > 1:  # the rest of the prompt list plays no part: skip it
                self.skip, self.depth = self.depth - 1, 1

    def result(self) -> Peeked:
        model = self.top.get("model")
        if isinstance(model, _Long):
            model = model.text
        if not (isinstance(model, str) and model):
            model = None
        for name, tag in (("prompt_cache_key", "k"), ("user", "u")):
            value = self.top.get(name)
            text = _text(value) if value != "" else None
            if text is not None:
                return Peeked(model, tag + ":" + text.hex())
        if self.message_count:
            return Peeked(model, "m:" + self.messages.hexdigest())
        if self.prompt:
            return Peeked(model, "p:" + _digest(bytes(self.prompt)))
        return Peeked(model, None)


class BodyPeek:
    """Incremental peek of one request body.

    Call :meth:`feed` with each chunk (bytes, any size) as it arrives, then
    :meth:`finish` once for the :class:`Peeked` answer. Never raises on any input: a body
    that turns out not to be a JSON object (or invalid JSON) stops being parsed at once,
    and its answer is ``Peeked(None, None)``. Work per ``feed`` is linear in the chunk
    (plus at most :data:`LONG_STRING` bytes once per string held across chunks).
    """

    def __init__(self) -> None:
        self._failed = False
        self._finished: Peeked | None = None
        self._head = bytearray()  # bytes before the encoding and the first '{' are known
        self._started = False
        self._decoder: codecs.IncrementalDecoder | None = None  # UTF-16/32 bodies
        self._events: list[tuple[str, Any]] = sendable_list()
        self._coro: Any = None
        self._keys = _Keys()
        # string state between chunks
        self._in_string = False
        self._held: list[bytes] = []
        self._held_len = 0
        self._long: _LongString | None = None
        self._carry = b""
        self._number_run = 0
        self._small: bytes | None = None  # a first chunk <= SMALL_BODY, not parsed yet

    @property
    def done(self) -> bool:
        """True once the body is known not to be a JSON object: later chunks are ignored.
        (Asking parses a first chunk held for :func:`peek_small` the incremental way.)"""
        if self._small is not None:
            small, self._small = self._small, None
            self._feed(small)
        return self._failed

    def feed(self, chunk: bytes) -> None:
        """Inspect the next ``chunk`` of the body (bytes). Never raises."""
        if self._failed or not chunk:
            return
        if (not self._started and not self._head and self._small is None and len(chunk) <= SMALL_BODY
                and chunk[:1] == b"{"):
            self._small = chunk  # maybe the whole body: finish() may read it at once
            return
        if self._small is not None:
            small, self._small = self._small, None
            self._feed(small)
        self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        if self._failed or not chunk:
            return
        try:
            if not self._started:
                self._head += chunk
                if not self._start(final=False):
                    if self._failed:
                        self._fail()
                    return
                chunk, self._head = bytes(self._head), bytearray()
                if self._decoder is None:
                    chunk = chunk[len(_BOM):] if chunk.startswith(_BOM) else chunk
            if self._decoder is not None:
                chunk = self._decoder.decode(chunk).encode("utf-8", "surrogatepass")
            self._scan(chunk)
        except Exception:  # invalid JSON, bad UTF-8, too deep, a yajl or Decimal refusal
            self._fail()

    def finish(self) -> Peeked:
        """The answer, once the whole body was fed (later calls return the same)."""
        if self._finished is not None:
            return self._finished
        if self._small is not None:
            small, self._small = self._small, None
            quick = peek_small(small)
            if quick is not None:
                self._fail()
                self._finished = quick
                return quick
            self._feed(small)
        answer = NOTHING
        try:
            if not self._failed and not self._started:
                if self._start(final=True):
                    body = bytes(self._head)
                    self._head = bytearray()
                    if self._decoder is None and body.startswith(_BOM):
                        body = body[len(_BOM):]
                    if self._decoder is not None:
                        body = self._decoder.decode(body).encode("utf-8", "surrogatepass")
                    self._scan(body)
            if not self._failed and self._started:
                if self._decoder is not None:
                    self._scan(self._decoder.decode(b"", final=True).encode("utf-8", "surrogatepass"))
                if self._in_string or self._carry:
                    raise ValueError("unterminated string")
                self._coro.close()
                self._keys.take(self._events)
                answer = self._keys.result()
        except Exception:
            pass
        self._fail()
        self._finished = answer
        return answer

    def _fail(self) -> None:
        self._failed = True
        self._small = None
        self._coro = None
        self._held, self._head = [], bytearray()
        del self._events[:]

    def _start(self, final: bool) -> bool:
        """Decide from the first bytes whether to parse (as json.loads would decode).

        Returns False while undecided; sets ``_failed`` when the body is not an object.
        """
        head = bytes(self._head)
        if not final and len(head) < len(_BOM) and _BOM.startswith(head):
            return False
        body = head[len(_BOM):] if head.startswith(_BOM) else head
        stripped = body.lstrip(_WS)
        if not stripped:
            if final:
                self._failed = True
            else:  # only whitespace so far: keep what decides the encoding, not all of it
                del self._head[len(head) - len(body) + 4:]
            return False
        if stripped[:1] != b"{":
            self._failed = True  # cheap: multipart, arrays and plain text are never parsed
            return False
        if len(head) < 4 and not final:
            return False
        encoding = json.detect_encoding(head)
        if encoding not in ("utf-8", "utf-8-sig"):
            self._decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
        self._coro = _BACKEND.basic_parse_coro(self._events)
        self._started = True
        return True

    def _send(self, data: bytes) -> None:
        if data:
            self._coro.send(data)
            if self._events:
                self._keys.take(self._events)
                del self._events[:]

    def _scan(self, chunk: bytes) -> None:
        """Feed yajl everything but strings still open at the chunk's end."""
        if self._carry:
            chunk, self._carry = self._carry + chunk, b""
        pos, end = 0, len(chunk)
        while pos < end:
            if self._in_string:
                pos = self._string_part(chunk, pos)
                continue
            stop = _match_end(_OUT, chunk, pos)
            if stop > pos:
                piece = chunk[pos:stop]
                self._check_number_run(piece)
                self._send(piece)
            if stop < end:  # an opening quote whose string does not end in this chunk
                self._in_string = True
                self._held, self._held_len = [b'"'], 1
                stop += 1
            pos = stop

    def _check_number_run(self, piece: bytes) -> None:
        """Refuse a number token over 64 KiB cut by chunk boundaries (yajl re-lexes it)."""
        head = len(piece) - len(piece.lstrip(_NUMBER_BYTES))
        run = self._number_run + head
        if run > _LONG_NUMBER:
            raise ValueError("number token too long")
        if head < len(piece):
            run = len(piece) - len(piece.rstrip(_NUMBER_BYTES))
        self._number_run = run

    def _string_part(self, chunk: bytes, pos: int) -> int:
        """Consume string content from ``pos``; return where scanning goes on."""
        stop = _match_end(_IN, chunk, pos)
        end = len(chunk)
        closed = stop < end and chunk[stop] == 0x22  # '"'
        if not closed:
            if stop < end and _PARTIAL_ESCAPE.match(chunk, stop) is None:
                raise ValueError("invalid string content")
            split = _HIGH_SURROGATE.match(chunk, max(pos, stop - 6), stop)
            if split is not None and _escaped(chunk, pos, split.start()):
                stop = split.start()  # keep a surrogate pair's halves together
            self._carry = chunk[stop:]  # an escape cut by the chunk boundary
        content = chunk[pos:stop]
        if self._long is None and self._held_len + len(content) <= LONG_STRING:
            self._held.append(content)
            self._held_len += len(content)
            if closed:
                self._in_string = False
                self._held.append(b'"')
                held, self._held = b"".join(self._held), []
                self._number_run = 0
                self._send(held)
            return stop + 1 if closed else end
        if self._long is None:  # this string turns long: take it over
            held, self._held = b"".join(self._held), []
            wanted = self._keys.wants_long()
            self._long = _LongString(wanted, wanted and self._keys.depth == 1 and self._keys.k1 == "model")
            self._long.add(held[1:])
        self._long.add(content)
        if not closed:
            return end
        taken, self._long = self._long.end(), None
        self._in_string = False
        self._number_run = 0
        self._keys.long = taken
        self._send(b'""')
        self._keys.long = None
        return stop + 1


def _match_end(pattern: re.Pattern[bytes], chunk: bytes, pos: int, stop: int | None = None) -> int:
    """Where ``pattern`` (one that also matches the empty string) stops matching from ``pos``."""
    found = pattern.match(chunk, pos, len(chunk) if stop is None else stop)
    return found.end() if found is not None else pos


def _escaped(chunk: bytes, start: int, backslash: int) -> bool:
    """Whether the backslash at ``backslash`` starts an escape (an even run before it)."""
    i = backslash
    while i > start and chunk[i - 1] == 0x5C:
        i -= 1
    return (backslash - i) % 2 == 0


class _LongString:
    """The content of one long string, validated (and decoded when wanted) piece by piece.

    Pieces hold whole escapes (and never split a surrogate pair's escapes); UTF-8 may be
    cut anywhere (an incremental decoder). ``wanted``: decode and hash the text;
    ``keep``: also keep it (a model name).
    """

    def __init__(self, wanted: bool, keep: bool) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self._hash = _hasher() if wanted else None
        self._head = bytearray()
        self._kept: list[str] | None = [] if keep else None

    def add(self, piece: bytes) -> None:
        """Validate (and use) the next piece. Raises UnicodeDecodeError on bad UTF-8."""
        raw = self._utf8.decode(piece)
        if self._hash is None:
            return
        text: str = json.loads('"' + raw + '"') if "\\" in raw else raw
        data = text.encode("utf-8", "surrogatepass")
        self._hash.update(data)
        if len(self._head) < PROMPT_BYTES:
            self._head += data[:PROMPT_BYTES - len(self._head)]
        if self._kept is not None:
            self._kept.append(text)

    def end(self) -> _Long:
        """The finished string. Raises UnicodeDecodeError if it ends inside a character."""
        self._utf8.decode(b"", final=True)
        return _Long(self._hash.digest() if self._hash is not None else b"", bytes(self._head),
                     "".join(self._kept) if self._kept is not None else None)


def peek(body: bytes) -> Peeked:
    """The :class:`Peeked` answer for a whole ``body`` (bytes) at once."""
    p = BodyPeek()
    p.feed(body)
    return p.finish()


class _Unsure(Exception):
    """:func:`peek_small` cannot promise the incremental peek's answer for this body."""


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""An escaped surrogate (yajl: ``?``) or a raw UTF-8-encoded one (``json.loads`` of
bytes decodes with ``surrogatepass``; the incremental peek refuses it)."""


def _refuse_constant(name: str) -> object:
    raise _Unsure(name)  # NaN, Infinity: the incremental peek gives no answer


_DECODER: Final = json.JSONDecoder(parse_float=Decimal, parse_constant=_refuse_constant)
"""``json.loads`` with floats as ijson gives them (Decimal), built once."""


def peek_small(body: bytes) -> Peeked | None:
    """The answer :class:`BodyPeek` gives for the whole ``body`` (bytes), computed with
    ``json.loads``; None when this shortcut cannot promise the same answer (then the
    caller runs the incremental peek). Never raises.

    Used for bodies of at most :data:`SMALL_BODY` bytes that came in one chunk (issue
    14). It answers only UTF-8 bodies starting with ``{`` that ``json.loads`` reads,
    without ``NaN``/``Infinity``, surrogates (escaped or raw), more than :data:`MAX_DEPTH` brackets,
    or a container where the rules expect a scalar (a message's ``role``, a content
    part's ``type`` or ``text``: there duplicate keys are read differently); floats are
    ``Decimal`` as ijson gives them. The rules are DESIGN.md §The proxy rule 4 and §"Cache
    affinity", as in :class:`_Keys`.
    """
    if (body[:1] != b"{" or b"\x00" in body[:4]  # else not UTF-8 (json.detect_encoding)
            or body.count(b"{") + body.count(b"[") >= MAX_DEPTH or _SURROGATE.search(body)):
        return None
    try:
        return _keys_of(_DECODER.decode(body.decode("utf-8")))
    except Exception:  # invalid JSON (the incremental peek agrees: NOTHING) or _Unsure
        return None


def _keys_of(top: dict[str, Any]) -> Peeked:
    """:meth:`_Keys.result` for a decoded body. Raises _Unsure (see :func:`peek_small`)."""
    model = top.get("model")
    model = model if isinstance(model, str) and model else None
    for name, tag in (("prompt_cache_key", "k"), ("user", "u")):
        value = top.get(name)
        if isinstance(value, str) and value:
            return Peeked(model, tag + ":" + _digest_text(value).hex())
    messages = top.get("messages")
    if isinstance(messages, list):
        h, count = _hasher(), 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            if isinstance(role, (dict, list)):
                raise _Unsure("role")
            texts, n = _hasher(), 0
            content = message.get("content")
            if isinstance(content, str):
                texts.update(_digest_text(content))
                n = 1
            elif isinstance(content, list):
                for part in content:
                    if not isinstance(part, dict):
                        continue
                    kind, text = part.get("type"), part.get("text")
                    if isinstance(kind, (dict, list)) or isinstance(text, (dict, list)):
                        raise _Unsure("part")
                    if kind == "text" and isinstance(text, str):
                        texts.update(_digest_text(text))
                        n += 1
            role_bytes = _utf8(role)
            h.update(len(role_bytes).to_bytes(8, "big") + role_bytes)
            h.update(n.to_bytes(8, "big") + texts.digest())
            count += 1
            if role == "user":
                break
        if count:
            return Peeked(model, "m:" + h.hexdigest())
    prompt = top.get("prompt")
    taken = bytearray()
    if isinstance(prompt, str):
        taken += _utf8(prompt)[:PROMPT_BYTES]
    elif isinstance(prompt, list):
        for item in prompt:
            for value in (item if isinstance(item, list) else (item,)):
                _take_prompt_item(taken, value)
                if len(taken) >= PROMPT_BYTES:
                    break
            if len(taken) >= PROMPT_BYTES:
                break
    if taken:
        return Peeked(model, "p:" + _digest(bytes(taken[:PROMPT_BYTES])))
    return Peeked(model, None)


def _digest_text(value: str) -> bytes:
    h = _hasher()
    h.update(value.encode("utf-8", "surrogatepass"))
    return bytes(h.digest())


def _take_prompt_item(taken: bytearray, value: object) -> None:
    if isinstance(value, str):
        taken += _utf8(value)[:PROMPT_BYTES]
    elif isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
        taken += b"%s " % str(value).encode("ascii")
