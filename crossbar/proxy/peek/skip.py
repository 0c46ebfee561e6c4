"""Skipping the bytes of JSON values no key rule reads, without a parser (issue 20 item 8;
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
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")
"""Raw control bytes: invalid anywhere in a JSON text (whitespace aside)."""

_KEY = re.compile(
    rb'([,{][ \t\r\n]*)"(?:model|user|prompt_cache_key|input_prefix|messages|input_extra|prompt|[^"\\]*\\[^"]*)"')
"""A key a rule reads, or any key with an escape (which may spell one): a string after
``,`` or ``{`` (a key wherever it stands at depth 1), on escape-neutralised bytes."""

_NAMES: Final = (b'"model"', b'"user"', b'"prompt', b'"input_', b'"messages"')
_MARK: Final = b"\\1\x01\x02"
_TABLE: Final = bytes.maketrans(b"[]{}\x01\x02", bytes((8, 248, 8, 248, 1, 255)))
"""As signed bytes: +8 opens a level, -8 closes one; a marked key is +1 then -1, so the
nesting after its first byte is 9 exactly when the key stands at depth 1."""
_DELETE: Final = bytes(b for b in range(256) if b not in b"[]{}\x01\x02")
_OPEN: Final = b"\x08"
_CLOSE: Final = b"\xf8"
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
        self.level = 8 * levels
        self.scan = scan
        self.limit = 8 * room + 1
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
        if _CONTROL.search(data) is not None:
            raise ValueError("control character")
        quoted = b'"' in data
        marked = data
        if self.scan and quoted and (b"\\" in data or any(name in data for name in _NAMES)):
            marked = _KEY.sub(_MARK, data)
        opened = self.in_string
        if opened:
            marked = b'"' + marked
        parts = marked.split(b'"') if quoted or opened else [marked]
        outside = b"".join(parts[::2]) if len(parts) > 1 else marked
        sym = outside.translate(_TABLE, _DELETE)
        level, closes = self.level, sym.count(_CLOSE)
        marks = marked is not data and b"\x01" in sym
        if marks or level - 8 * closes <= 0 or level + 8 * sym.count(_OPEN) > self.limit:
            levels = list(accumulate(array("b", sym), initial=level))
            cut = len(levels)
            for target in ((0, 9) if marks else (0,)):
                try:
                    cut = min(cut, levels.index(target, 1))
                except ValueError:
                    pass
            if max(levels[:cut + 1]) > self.limit:
                raise ValueError("nesting too deep")
            if cut < len(levels):
                return self._where(raw, data, opened, sym, cut - 1, parts if marked is data else None, base, at)
            level = levels[-1]
        else:
            level += 8 * (sym.count(_OPEN) - closes)
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
        if sym[index] == 1:  # the n-th marked key: the n-th match on the unmarked bytes
            found = next(islice(_KEY.finditer(data), sym.count(b"\x01", 0, index), None))
            place = found.end(1)
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
