"""Skipping the bytes of JSON values no key rule reads, without a parser (hostile bodies;
docs/design.md §"Cache affinity", §"Quality bar").

yajl (:mod:`.lexer`) builds a Python tuple per token: a body of millions of tiny tokens
costs ~10x the CPU per byte of a plain prompt even where the rules look at none of them.
Once the rules are done with a value (a container they do not enter, the rest of
``messages`` after the first ``user`` message or past :data:`~.rules.KEY_EVENTS`, ...),
:class:`Skip` follows the bytes only as far as the structure goes -- where strings are
(quote parity, escapes neutralised) and the bracket nesting outside them -- with bytes
and regex operations that run in C over a whole chunk, not a Python step per token:
``split``/``join`` drop string contents, ``translate`` keeps the brackets as +1/-1, and
``itertools.accumulate`` gives the nesting where a chunk may end the value. At depth 1
(between top-level members) it also stops at any key a rule reads (``"model"``,
``"messages"``, ... or any key spelt with an escape), so a later top-level ``"model"``
is still found; between them the members are skipped the same way.

What a skipped region is checked for: nesting (deeper than :data:`~.rules.MAX_DEPTH`
fails, as the parser would), raw control bytes (invalid anywhere in JSON) and, where
the parse resumes, the kind of the closing bracket (the fresh parser sees it). Other
malformed JSON inside a skipped value (a bad number, a missing comma, bad UTF-8 in a
string, an unknown escape) is not seen: the answer is then the one of the body's
well-formed parts, and the host refuses the body with its own 400. Which bytes the
parser already saw depends on chunk boundaries, so for such an invalid body the answer
is either that one or no answer (``NOTHING``), never another.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_right
from itertools import accumulate, islice
from typing import Final

__all__ = ["Skip"]

_WS: Final = b" \t\r\n"
_NOT_CONTROL: Final = bytes(b for b in range(256) if b >= 0x20 or b in b"\t\r\n")
"""All but the raw control bytes, which are invalid anywhere in a JSON text (whitespace
aside): deleting these leaves the control bytes (a C loop, cheaper than a regex search)."""

_READ: Final = ("model", "user", "prompt_cache_key", "input_prefix", "messages", "input_extra", "prompt")
"""The top-level keys a rule reads (:mod:`.rules`)."""


def _spelt(name: str) -> re.Pattern[bytes]:
    """``name`` as a key after a ``,``, each letter as itself or its ``\\u00XX`` escape
    (on escape-neutralised bytes): a key wherever it stands at depth 1 (a skipped region
    never holds the top-level ``{``, so no key after a ``{`` is at depth 1)."""
    letters = b"".join(b"(?:%s|\\\\u00%x[%x%X])" % (re.escape(c).encode(), ord(c) >> 4, ord(c) & 15, ord(c) & 15)
                       for c in name)
    return re.compile(rb',[ \t\r\n]*("' + letters + rb'")')


_KEYS: Final = tuple((i + 1, name.encode(), _spelt(name)) for i, name in enumerate(_READ))
"""Each key a rule reads: its mark (1-7), its name, its pattern."""
_TABLE: Final = bytes.maketrans(b"[]{}" + bytes(range(1, 8)) + bytes(range(0x11, 0x18)),
                                bytes((16, 240, 16, 240)) + bytes(range(1, 8)) + bytes(256 - i for i in range(1, 8)))
"""As signed bytes: +16 opens a level, -16 closes one; the key marked ``,\\x0i\\x1i``
is +i then -i, so the nesting after its first byte is 16 + i exactly when it stands at
depth 1."""
_DELETE: Final = bytes(b for b in range(256) if b not in b"[]{}" + bytes(range(1, 8)) + bytes(range(0x11, 0x18)))
_OPEN: Final = b"\x10"
_CLOSE: Final = b"\xf0"
_CLOSING = re.compile(rb"[\]}]")
_CARRY: Final = 128
"""Bytes of a string open at a chunk's end carried into the next when it may be a key
a rule reads (the longest, ``"prompt_cache_key"`` spelt with escapes, is 98)."""


class Skip:
    """Bytes skipped structurally until the value being skipped ends.

    :param levels: brackets open at the start (the skipped container's own included;
        with ``scan``, counted from the top-level object, which is one of them).
    :param scan: also stop at a key a rule reads at depth 1 (the skipped value is a
        top-level member's, or none: between members).
    :param room: the deepest nesting allowed, in the same count (MAX_DEPTH less the
        depth the count starts from).
    :param comma: the last byte before the start that is not whitespace is a ``,``
        (with ``scan``: a key right at the start must be found).
    """

    def __init__(self, levels: int, scan: bool, room: int, comma: bool = False) -> None:
        self.level = 16 * levels
        self.scan = scan
        self.limit = 16 * room + 8
        self.in_string = False
        self.escape = False  # inside a string, the next byte is escaped
        self.carry = b"," if comma else b""

    def run(self, chunk: bytes, at: int) -> tuple[int, bytes] | None:
        """Skip ``chunk`` (which starts at absolute offset ``at``). Returns None when
        all of it is skipped; else where the parse resumes: an absolute offset in the
        chunk, or before it with the bytes (a key carried from the previous chunk, its
        string still open) that come first. Raises ValueError on nesting too deep or a
        control byte."""
        data, base = chunk, at
        if self.carry:
            data, base, self.carry = self.carry + chunk, at - len(self.carry), b""
        raw = data
        if self.escape and data:
            data, self.escape = b"_" + data[1:], False
        if b"\\" in data:  # escapes cannot hide or fake a quote once neutralised
            data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
        if data.translate(None, _NOT_CONTROL):
            raise ValueError("control character")
        quoted, opened, level = b'"' in data, self.in_string, self.level
        marked, escaped = data, b"\\u00" in data
        marks: list[int] = []
        keys: list[tuple[int, bytes, re.Pattern[bytes]]] = []
        if self.scan and quoted:
            lowered = data.lower() if escaped else b""
            keys = [key for key in _KEYS  # (a key spelt with escapes starts with its letter or one)
                    if key[1] in data or (escaped and (b'"' + key[1][:1] in data or b'"\\u00%x' % key[1][0] in lowered))]
        split = None
        if keys and level > 16:  # inside a member's value: no key counts unless it ends here
            split = _outside(data, quoted, opened)
            if _settled(split[1], level - 16, self.limit - 16):
                keys = []
        if keys and level == 16:  # between members: the last of each key, if all stand at depth 1
            place = _last_keys(data, opened, keys, level, self.limit)
            if place is not None:
                return base + place, raw[place:at - base] if base + place < at else b""
        for i, _, pattern in keys:
            marked, n = pattern.subn(b",%c%c" % (i, 0x10 + i), marked)
            if n:
                marks.append(i)
        if split is None or marks:
            split = _outside(marked, quoted, opened)
        parts, sym = split
        closes = sym.count(_CLOSE)
        if (marks or level - 16 * closes <= 0 or level + 16 * sym.count(_OPEN) > self.limit) and (
                marks or not _settled(sym, level, self.limit)):
            levels = list(accumulate(array("b", sym), initial=level))
            try:
                cut = levels.index(0, 1)
            except ValueError:
                cut = len(levels)
            if marks:  # only the last of each key at depth 1 counts (the last wins, as in json.loads)
                head = levels[:cut]
                backwards = head[::-1]
                for i in marks:
                    try:
                        cut = min(cut, len(head) - 1 - backwards.index(16 + i))
                    except ValueError:
                        pass
            if max(levels[:cut + 1]) > self.limit:
                raise ValueError("nesting too deep")
            if cut < len(levels):
                return self._where(raw, data, opened, sym, cut - 1, None if marks else parts, base, at)
            level = levels[-1]
        else:
            level += 16 * (sym.count(_OPEN) - closes)
        self.level = level
        self.in_string = len(parts) % 2 == 0
        if self.in_string:
            self.escape = data.endswith(b"\\")
        if self.scan:
            self._carry(raw, data)
        return None

    def _carry(self, raw: bytes, data: bytes) -> None:
        """Keep what a key cut by the chunk's end needs: its ``,`` and its open string
        (``raw``: the bytes as sent; ``data``: the same with escapes neutralised)."""
        if self.in_string:
            quote = data.rfind(b'"')
            if quote >= 0 and len(data) - quote <= _CARRY and data[:quote].rstrip(_WS).endswith(b","):
                self.carry = b"," + raw[quote:]
                self.in_string = self.escape = False
        elif data.rstrip(_WS).endswith(b","):
            self.carry = b","

    def _where(self, raw: bytes, data: bytes, opened: bool, sym: bytes, index: int, parts: list[bytes] | None,
               base: int, at: int) -> tuple[int, bytes]:
        """The stop at ``sym[index]`` (a closing bracket or a key's mark) as a place in
        ``data`` (``raw`` neutralised; both start at absolute ``base``, the chunk at ``at``)."""
        mark = sym[index]
        if mark < 8:  # the n-th key marked so: the n-th match of its pattern on the unmarked bytes
            pattern = _KEYS[mark - 1][2]
            before = sym.count(bytes((mark,)), 0, index)
            found = _last(pattern, data) if before == sym.count(bytes((mark,))) - 1 else None
            if found is None:
                found = next(islice(pattern.finditer(data), before, None))
            place = found.start(1)
        else:  # the n-th closing bracket outside strings
            if parts is None:
                parts = (b'"' + data if opened else data).split(b'"')
            evens = parts[::2]
            outside = b"".join(evens)
            where = next(islice(_CLOSING.finditer(outside), sym.count(_CLOSE, 0, index + 1) - 1, None)).start()
            ends = list(accumulate(map(len, evens)))
            j = bisect_right(ends, where)
            place = sum(map(len, parts[:2 * j])) + 2 * j + where - (ends[j - 1] if j else 0) - opened
        start = base + place
        return start, raw[place:at - base] if start < at else b""


def _last(pattern: re.Pattern[bytes], data: bytes) -> re.Match[bytes] | None:
    """The last match of ``pattern`` (which starts with ``,``: matches never overlap)
    in ``data``, looked for from the end in growing windows."""
    window = 256
    while True:
        start = max(0, len(data) - window)
        found = None
        for found in pattern.finditer(data, start):
            pass
        if found is not None or start == 0:
            return found
        window *= 16


def _settled(sym: bytes, level: int, limit: int) -> bool:
    """Whether the nesting ``sym`` (see _TABLE) starting at ``level`` stays above 0 and
    within ``limit``, told cheaply: adjacent open-close pairs (``{}``, ``[0]``) are removed
    first (which keeps every lower point and lowers the highest by 16 a pass)."""
    passes = 0
    while passes < 4:
        shorter = sym.replace(b"\x10\xf0", b"")
        if len(shorter) == len(sym):
            break
        sym, passes = shorter, passes + 1
    if level - 16 * sym.count(_CLOSE) > 0 and level + 16 * (sym.count(_OPEN) + passes) <= limit:
        return True
    levels = list(accumulate(array("b", sym), initial=level))
    return min(levels) > 0 and max(levels) + 16 * passes <= limit


def _outside(data: bytes, quoted: bool, opened: bool) -> tuple[list[bytes], bytes]:
    """``data`` (escapes neutralised; ``opened``: it starts inside a string) split on its
    quotes, and what lies outside strings kept as nesting steps (see _TABLE)."""
    if opened:
        data = b'"' + data
    parts = data.split(b'"') if quoted or opened else [data]
    outside = b"".join(parts[::2]) if len(parts) > 1 else data
    return parts, outside.translate(_TABLE, _DELETE)


def _last_keys(data: bytes, opened: bool, keys: list[tuple[int, bytes, re.Pattern[bytes]]], level: int,
               limit: int) -> int | None:
    """Where the skipping between members stops (:meth:`Skip.run` at depth 1): the first
    of the last matches of ``keys`` in ``data`` (the keys the chunk holds), found from the
    end without marking every key; None when that cannot be told so (a last match not
    at depth 1 nor outside strings, or the object ending before it): then every key is
    marked."""
    places = []
    for _, _, pattern in keys:
        found = _last(pattern, data)
        if found is None:
            continue
        place = found.start(1)
        parts, sym = _outside(data[:place], True, opened)
        if len(parts) % 2 == 0 or not _settled(sym, level, limit):
            return None
        if level + 16 * (sym.count(_OPEN) - sym.count(_CLOSE)) != 16:
            return None
        places.append(place)
    return min(places) if places else None
