"""The lexer front end of the body peek: a request body, chunk by chunk as it arrives,
turned into ijson events for the key rules (:mod:`.rules`; docs/design.md §The proxy rule 4,
§"Cache affinity", §"Model names", §"Quality bar": no request holds the reactor more than
a few milliseconds), and where the top-level ``"model"`` lies in the body's bytes.

:class:`BodyPeek` is fed each chunk ``Request.handleContentChunk`` gets (up to ~64 KiB)
and parses it with ijson's push interface over its C backend (yajl2). Nothing is
re-read: the work for a chunk is bounded by the chunk, however large the body. A body
of at most :data:`SMALL_BODY` bytes in one chunk is read with ``json.loads`` instead
(:func:`peek_small`) and walked by the same rules over the decoded dict.

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

Values no rule reads are not fed to yajl at all once the rules say so (at most
:data:`_PIECE` bytes later): :class:`~.skip.Skip` follows their strings and bracket
nesting at C speed, then a fresh yajl resumes at the value's closing bracket or at the
next top-level key a rule reads. Malformed JSON inside such a value
is mostly not seen (see :mod:`.skip`): the answer is then that of the body's
well-formed parts, or none.

Answers are those of ``json.loads`` (``tests/reference.py``) on every valid body
except these, which give None here (no model, no key) and are not JSON anyway or are
never sent by a client: ``NaN``/``Infinity`` literals, numbers yajl/Decimal refuse
(exponents beyond ~10^999999999), a number token over 64 KiB cut by a chunk boundary,
nesting deeper than :data:`MAX_DEPTH`, raw UTF-8-encoded surrogates. An escaped lone
surrogate (``"\\ud800"``) in a string of at most ``LONG_STRING`` bytes becomes ``"?"``
(yajl's choice).
"""

from __future__ import annotations

import codecs
import json
import re
from decimal import Decimal
from itertools import islice, repeat
from operator import itemgetter
from types import ModuleType
from typing import Any, Final

import ijson
from ijson.utils import sendable_list
from twisted.logger import Logger

from crossbar.proxy.peek.rules import (
    KEY_EVENTS, MAX_DEPTH, NOTHING, PROMPT_BYTES, EventRules, Peeked, Spot, SpotKind, Unsure, _hasher, _Long,
    most_events, rules_of,
)
from crossbar.proxy.peek.skip import Skip

__all__ = ["LONG_STRING", "SMALL_BODY", "BodyPeek", "backend_name", "peek", "peek_small"]

LONG_STRING: Final = 256 * 1024
"""Bytes of one JSON string held for yajl across chunks; a longer one is taken over."""

SMALL_BODY: Final = 64 * 1024
"""A body of at most this many bytes that arrives in one chunk is read with
``json.loads`` at :meth:`BodyPeek.finish` (:func:`peek_small`): ~2 us against ~14 us for
the incremental parse, and at most a few ms of reactor time even for a hostile body of
tiny tokens."""

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

# A complete string in a piece fed to yajl (every string there is complete).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
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


class BodyPeek:
    """Incremental peek of one request body.

    Call :meth:`feed` with each chunk (bytes, any size) as it arrives, then
    :meth:`finish` once for the :class:`Peeked` answer. Never raises on any input: a body
    that turns out not to be a JSON object (or invalid JSON) stops being parsed at once,
    and its answer is ``Peeked(None, None)``. Work per ``feed`` is linear in the chunk
    (plus at most :data:`LONG_STRING` bytes once per string held across chunks).

    Where the model lies (``Peeked.spot``, absolute offsets in the body as fed): the
    lexer knows the offset of every piece it hands yajl, and every string in a piece is
    complete, so the rules' top-level ``"model"`` string event (the last one of a batch)
    is the n-th string of its piece, n the number of string events before it. UTF-16
    and UTF-32 bodies (transcoded here) get no spot.
    """

    def __init__(self) -> None:
        self._failed = False
        self._finished: Peeked | None = None
        self._head = bytearray()  # bytes before the encoding and the first '{' are known
        self._started = False
        self._decoder: codecs.IncrementalDecoder | None = None  # UTF-16/32 bodies
        self._events: list[tuple[str, Any]] = sendable_list()
        self._coro: Any = None
        self._keys: EventRules  # made when parsing starts (a small body never needs one)
        self._fed = 0  # bytes given to _feed so far
        self._next = 0  # absolute offset just past what _scan was given (UTF-8 bodies)
        self._open_at = 0  # absolute offset of the opening quote of the string under way
        # string state between chunks
        self._in_string = False
        self._held: list[bytes] = []
        self._held_len = 0
        self._long: _LongString | None = None
        self._carry = b""
        self._number_run = 0
        self._small: bytes | None = None  # a first chunk <= SMALL_BODY, not parsed yet
        self._skip: Skip | None = None  # bytes skipped without yajl (see .skip)

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
        self._fed += len(chunk)
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
                    self._next = self._fed - len(chunk)  # (the whitespace before '{' may have a gap)
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
                    self._next = self._fed - len(body)
                    if self._decoder is not None:
                        body = self._decoder.decode(body).encode("utf-8", "surrogatepass")
                    self._scan(body)
            if not self._failed and self._started:
                if self._decoder is not None:
                    self._scan(self._decoder.decode(b"", final=True).encode("utf-8", "surrogatepass"))
                if self._in_string or self._carry or self._skip is not None:
                    raise ValueError("unterminated string or object")
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
        self._skip = None
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
        self._keys = EventRules()
        self._coro = _BACKEND.basic_parse_coro(self._events)
        self._started = True
        if self._decoder is None:  # where '{' is: the head ends at _fed, no gap after '{'
            self._keys.brace = self._fed - len(stripped)
        return True

    def _send(self, data: bytes, at: int, span: tuple[int, int] | None = None) -> None:
        """Hand yajl ``data`` (which starts at absolute offset ``at``; ``span``: where
        the one string it holds really lies, for a taken-over string)."""
        if data:
            self._coro.send(data)
            if self._events:
                keys = self._keys
                keys.take(self._events)
                if keys.model_at is not None and self._decoder is None:
                    keys.spot = _place(self._events, keys.model_at, data, at, span)
                del self._events[:]

    def _scan(self, chunk: bytes) -> None:
        """Feed yajl everything but strings still open at the chunk's end, and none of
        what :class:`~.skip.Skip` skips."""
        base = self._next - len(self._carry)  # absolute offset of chunk[0] (UTF-8 bodies)
        self._next += len(chunk)
        if self._carry:
            chunk, self._carry = self._carry + chunk, b""
        self._walk(chunk, base)

    def _walk(self, chunk: bytes, base: int) -> None:
        """:meth:`_scan` of ``chunk``, which starts at absolute offset ``base``."""
        pos, end = 0, len(chunk)
        if self._skip is not None:
            pos = self._skipped(chunk, 0, base)
        while pos < end:
            if self._in_string:
                pos = self._string_part(chunk, pos, base)
                if not self._in_string:
                    pos = self._maybe_skip(chunk, pos, base)
                continue
            limit = end if end - pos <= _PIECE else pos + _PIECE
            stop = _open_string(chunk, pos, limit)
            if stop > pos:
                piece = chunk[pos:stop]
                self._check_number_run(piece)
                self._send(piece, base + pos)
                after = self._maybe_skip(chunk, stop, base)
                if after != stop:
                    pos = after
                    continue
            if stop < limit:  # an opening quote whose string does not end in this piece
                self._in_string = True
                self._held, self._held_len = [b'"'], 1
                self._open_at = base + stop
                stop += 1
            pos = stop

    def _maybe_skip(self, chunk: bytes, pos: int, base: int) -> int:
        """yajl has seen the bytes before ``pos`` (outside a string): when the rules are
        done with the value under way, or between top-level members, skip bytes without
        yajl from there (:class:`~.skip.Skip`). Returns where the walk goes on."""
        keys = self._keys
        if keys.skip:
            if keys.depth == 1:  # a top-level member's value: then on to the next member
                self._skip = Skip(keys.skip + 1, True, MAX_DEPTH)
            else:
                self._skip = Skip(keys.skip, False, MAX_DEPTH - keys.depth)
        elif keys.depth == 1 and keys.last in _VALUE_ENDS and keys.members and pos < len(chunk):
            before = chunk[max(0, pos - 64):pos].rstrip(_WS) or chunk[:pos].rstrip(_WS)
            if not before:
                return pos  # whether a comma came is in an earlier chunk: not here
            self._skip = Skip(1, True, MAX_DEPTH, comma=before.endswith(b","))
        else:
            return pos
        return self._skipped(chunk, pos, base)

    def _skipped(self, chunk: bytes, pos: int, base: int) -> int:
        """Skip from ``pos``; where the value ends (or a key a rule reads comes), resume
        with a fresh yajl put in the same place. Returns where the walk goes on."""
        skip = self._skip
        assert skip is not None
        found = skip.run(chunk[pos:] if pos else chunk, base + pos)
        if found is None:
            return len(chunk)
        start, first = found
        self._skip, self._number_run = None, 0
        keys = self._keys
        inside = not skip.scan  # at the skipped container's closing bracket, at depth > 1
        self._coro = _BACKEND.basic_parse_coro(self._events)
        self._coro.send(keys.reopen() if inside else b"{")
        del self._events[:]
        keys.after_skipped(inside)
        if first:  # a key carried from the previous chunk, its string still open
            self._walk(first + chunk[pos:], start)
            return len(chunk)
        return start - base

    def _check_number_run(self, piece: bytes) -> None:
        """Refuse a number token over 64 KiB cut by chunk boundaries (yajl re-lexes it)."""
        head = len(piece) - len(piece.lstrip(_NUMBER_BYTES))
        run = self._number_run + head
        if run > _LONG_NUMBER:
            raise ValueError("number token too long")
        if head < len(piece):
            run = len(piece) - len(piece.rstrip(_NUMBER_BYTES))
        self._number_run = run

    def _string_part(self, chunk: bytes, pos: int, base: int) -> int:
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
                self._send(held, self._open_at)
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
        self._send(b'""', self._open_at, (self._open_at, base + stop + 1))
        self._keys.long = None
        return stop + 1


def _open_string(chunk: bytes, pos: int, end: int | None = None) -> int:
    """Where the string left open at ``end`` (default: the end of ``chunk``) starts (its
    opening quote), scanning from ``pos`` (outside a string); ``end`` when every string
    closes before it.

    What ``_OUT`` says, at C speed per byte rather than per string: a quote is escaped
    when an odd run of backslashes precedes it, so the strings all close when the
    unescaped quotes are even; else the last unescaped quote opens the one left open.
    (A backslash outside a string is invalid JSON, and yajl refuses it before any
    string after it matters.)
    """
    end = len(chunk) if end is None else end
    quotes = chunk.count(b'"', pos, end)
    if quotes == 0:
        return end
    if chunk.find(b"\\", pos, end) >= 0:
        quotes -= len(_ODD_ESCAPED_QUOTE.findall(chunk, pos, end))
    if quotes % 2 == 0:
        return end
    i = chunk.rfind(b'"', pos, end)
    for _ in range(32):
        j = i
        while j > pos and chunk[j - 1] == 0x5C:
            j -= 1
        if (i - j) % 2 == 0:
            return i
        i = chunk.rfind(b'"', pos, i)
    return _match_end(_OUT, chunk, pos, end)  # many escaped quotes at the end: let the regex say


_ODD_ESCAPED_QUOTE = re.compile(rb'(?<!\\)\\(?:\\\\)*"')
"""A quote after an odd run of backslashes (an escaped quote inside a string)."""

_PIECE: Final = 4096
"""Bytes handed to yajl at once at most (cut before a string that ends beyond): between
pieces the lexer may start skipping (:meth:`BodyPeek._maybe_skip`)."""
_STRING_EVENTS: Final = {"map_key": 1, "string": 1}
_VALUE_ENDS: Final = frozenset({"string", "number", "boolean", "null", "end_map", "end_array"})


def _place(events: list[tuple[str, Any]], index: int, data: bytes, at: int, span: tuple[int, int] | None) -> Spot:
    """Where the string of ``events[index]`` lies: the n-th string of ``data`` (which
    starts at absolute offset ``at``), n the string events before it; ``span`` when
    given (a taken-over string, fed to yajl as ``""``)."""
    if span is None:
        n = sum(map(_STRING_EVENTS.get, map(_EVENT, events[:index]), repeat(0)))
        found = next(islice(_STRING.finditer(data), n, None))
        span = (at + found.start(), at + found.end())
    return Spot(span[0], span[1], SpotKind.VALUE)


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




_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""An escaped surrogate (yajl: ``?``) or a raw UTF-8-encoded one (``json.loads`` of
bytes decodes with ``surrogatepass``; the incremental peek refuses it)."""

_MODEL_MEMBER = re.compile(rb'"model"[ \t\r\n]*:[ \t\r\n]*("(?:[^"\\]|\\.)*")', re.DOTALL)


def _refuse_constant(name: str) -> object:
    raise Unsure(name)  # NaN, Infinity: the incremental peek gives no answer


_DECODER: Final = json.JSONDecoder(parse_float=Decimal, parse_constant=_refuse_constant)
"""``json.loads`` with floats as ijson gives them (Decimal), built once."""


def peek_small(body: bytes) -> Peeked | None:
    """The answer :class:`BodyPeek` gives for the whole ``body`` (bytes), computed with
    ``json.loads`` and :func:`~crossbar.proxy.peek.rules.rules_of`; None when this
    shortcut cannot promise the same answer (then the caller runs the incremental peek).
    Never raises.

    Used for bodies of at most :data:`SMALL_BODY` bytes that came in one chunk (~2 us
    against ~14 us). It answers only UTF-8 bodies starting with ``{`` that ``json.loads`` reads,
    without ``NaN``/``Infinity``, surrogates (escaped or raw), more than :data:`MAX_DEPTH`
    brackets, more events than the key rules look at (:data:`KEY_EVENTS`), or a container
    where the rules expect a scalar; floats are ``Decimal`` as
    ijson gives them. The spot of a string model is found when the body spells
    ``"model"`` once and never with a ``\\u006x`` escape (then that one is the
    top-level key); otherwise the incremental peek places it.
    """
    # ``find``, not ``in``: a bytes ``in`` first tries its needle as an int (a TypeError raised and cleared)
    if (body[:1] != b"{" or body.find(b"\x00", 0, 4) >= 0  # else not UTF-8 (json.detect_encoding)
            or body.count(b"{") + body.count(b"[") >= MAX_DEPTH or _SURROGATE.search(body)
            or (len(body) > KEY_EVENTS and most_events(body) > KEY_EVENTS)):  # the dict walk knows no bound
        return None
    try:
        found = rules_of(_DECODER.decode(body.decode("utf-8")))
        found.brace = 0
        if isinstance(found.top.get("model"), str):
            # "model" spelt once and never escaped (a letter of it as \u006x): that one is the key
            at = body.find(b'"model"')
            if body.find(b'"model"', at + 7) >= 0 or body.find(b"\\u006") >= 0:
                return None
            member = _MODEL_MEMBER.match(body, at)
            if member is None:
                return None
            found.spot = Spot(member.start(1), member.end(1), SpotKind.VALUE)
        return found.result()
    except Exception:  # invalid JSON (the incremental peek agrees: NOTHING) or Unsure
        return None
