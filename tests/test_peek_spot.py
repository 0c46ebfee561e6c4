"""The body peek's additions for issues 18 and 20: where the model lies and the rewrite
in place (docs/design.md §"Model names"), the infill affinity key for editor plugins
(§"Cache affinity"), and the bound on the key rules' work (issue 20 item 8)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from crossbar.proxy.peek import (
    KEY_EVENTS, LONG_STRING, BodyPeek, Peeked, Spot, SpotKind, peek, peek_small, rewrite_model,
)


def fed(body: bytes, sizes: list[int] | int) -> tuple[Peeked, BodyPeek]:
    p = BodyPeek()
    pos, i = 0, 0
    while pos < len(body):
        size = sizes if isinstance(sizes, int) else sizes[i % len(sizes)]
        p.feed(body[pos:pos + size])
        pos, i = pos + size, i + 1
    return p.finish(), p


def chunked(body: bytes, sizes: list[int]) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < len(body):
        out.append(body[pos:pos + sizes[i % len(sizes)]])
        pos, i = pos + sizes[i % len(sizes)], i + 1
    return out


_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_leaf = st.none() | st.booleans() | st.integers(-5, 5) | _text
_value = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["model", "a", "messages", "x"]) | _text, inner, max_size=3), max_leaves=8)
_docs = st.dictionaries(st.sampled_from(["model", "messages", "prompt", "a", "b", "modelx"]) | _text,
                        _value, max_size=5)
_models = st.sampled_from(["m1", "", "mé", 'q"\\', "\u2028"]) | _text


@st.composite
def encoded(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A JSON object body as different clients write it (spacing, escapes, a BOM)."""
    doc = draw(_docs)
    if draw(st.booleans()):
        doc = {"model": draw(_models), **doc} if draw(st.booleans()) else {**doc, "model": draw(_models)}
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 0, 2])),
                      separators=draw(st.sampled_from([None, (",", ":"), (" , ", " : ")])))
    body = draw(st.sampled_from([b"", b" \r\n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\t"])) + text.encode()
    return doc, body


class SpotTests(SynchronousTestCase):
    @settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(encoded(), st.lists(st.integers(1, 50), min_size=1, max_size=5), st.sampled_from(["t", "gpt-4o", "é\"x"]))
    def test_rewrite_changes_only_the_model(self, case: tuple[dict[str, Any], bytes], sizes: list[int],
                                            target: str) -> None:
        """Every chunking and the small path agree on the spot; the rewrite decodes to the
        original object with only "model" set, and every other byte is the client's."""
        doc, body = case
        whole, _ = fed(body, 10**9)
        cut, _ = fed(body, sizes)
        self.assertEqual(cut.spot, whole.spot, body)
        small = peek_small(body)
        if small is not None:
            self.assertEqual(small.spot, fed(body, 1)[0].spot, body)
        spot = whole.spot
        if "model" in doc and not isinstance(doc["model"], str):
            self.assertIsNone(spot)
            return
        assert spot is not None, body
        chunks = chunked(body, sizes)
        done = rewrite_model(chunks, spot, target)
        new = b"".join(done.chunks)
        self.assertEqual(done.length, len(new))
        self.assertEqual(json.loads(new), {**doc, "model": target})
        self.assertEqual(new[:spot.start], body[:spot.start])
        self.assertEqual(new[len(new) - (len(body) - spot.end):], body[spot.end:])
        self.assertEqual(peek(new).model, target or None)
        # chunks wholly before or after the changed bytes are passed on as the same objects
        offset, kept = 0, []
        for c in chunks:
            if offset + len(c) <= spot.start or offset > spot.end or spot.start < spot.end == offset:
                kept.append(c)
            offset += len(c)
        self.assertTrue(all(any(c is d for d in done.chunks) for c in kept))
        self.assertLessEqual(len(done.chunks), len(kept) + 1)

    def test_kinds(self) -> None:
        cases = [
            (b'{"model": "a", "x": 1}', Spot(10, 13, SpotKind.VALUE), b'{"model": "B", "x": 1}'),
            (b'{"x": 1}', Spot(1, 1, SpotKind.FIRST_MEMBER), b'{"model": "B", "x": 1}'),
            (b'  {}', Spot(3, 3, SpotKind.ONLY_MEMBER), b'  {"model": "B"}'),
            (b'{"model": "a", "model": "c"}', Spot(24, 27, SpotKind.VALUE), b'{"model": "a", "model": "B"}'),
        ]
        for body, spot, want in cases:
            for sizes in (1, 3, 10**9):
                self.assertEqual(fed(body, sizes)[0].spot, spot, (body, sizes))
            self.assertEqual(b"".join(rewrite_model([body], spot, "B").chunks), want)
        for body in (b'{"model": 3}', b'{"model": "a", "model": null}', b'[1]', b"x", b'{"model": "a"',
                     '{"model": "a"}'.encode("utf-16")):
            for sizes in (1, 10**9):
                self.assertIsNone(fed(body, sizes)[0].spot, body)

    def test_long_model_value_across_chunks(self) -> None:
        name = "m" * (LONG_STRING + 100)
        body = json.dumps({"messages": [], "model": name, "x": 1}).encode()
        got, _ = fed(body, 65536)
        start = body.index(b'"mmm')
        self.assertEqual(got.spot, Spot(start, start + len(name) + 2, SpotKind.VALUE))
        chunks = chunked(body, [65536])
        done = rewrite_model(chunks, got.spot, "small")
        self.assertEqual(json.loads(b"".join(done.chunks)), {"messages": [], "model": "small", "x": 1})
        self.assertEqual(len(done.chunks), 1)  # the chunks wholly inside the old value are dropped
        self.assertEqual(done.length, len(body) - len(name) + len("small"))

    def test_only_touched_chunks_copied(self) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "x" * 300000}], "model": "a"}).encode()
        chunks = chunked(body, [65536])
        got, _ = fed(body, 65536)
        assert got.spot is not None
        done = rewrite_model(chunks, got.spot, "bb")
        self.assertEqual(len(done.chunks), len(chunks))
        changed = [i for i, (a, b) in enumerate(zip(chunks, done.chunks)) if a is not b]
        self.assertEqual(changed, [len(chunks) - 1])
        self.assertEqual(done.length, len(body) + 1)


def vim_fim(extra: list[dict[str, Any]], prefix: str, middle: str, suffix: str) -> bytes:
    """A completion request as llama.vim's ``llama#fim`` sends it (autoload/llama.vim)."""
    return json.dumps({
        "id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": middle,
        "n_predict": 128, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
        "response_fields": ["content", "timings/prompt_n", "truncated", "tokens_cached"],
    }).encode()


def vim_warmup(extra: list[dict[str, Any]]) -> bytes:
    """llama.vim's ``s:ring_update`` request: the new ring, nothing to predict."""
    return json.dumps({
        "id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
        "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""],
    }).encode()


def vscode_fim(extra: list[dict[str, Any]], prefix: str, middle: str, suffix: str, prepare: bool = False) -> bytes:
    """llama.vscode's ``createRequestPayload`` (src/llama-server.ts), with its model."""
    if prepare:
        doc: dict[str, Any] = {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
                               "prompt": middle, "n_predict": 0, "samplers": [], "cache_prompt": True,
                               "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    else:
        doc = {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
               "prompt": middle, "n_predict": 128, "n_cmpl": 1, "top_k": 40, "top_p": 0.99, "stream": False,
               "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
               "t_max_prompt_ms": 500, "t_max_predict_ms": 2500, "model": "qwen2.5-coder"}
    return json.dumps(doc).encode()


def chunk(name: str, i: int) -> dict[str, Any]:
    lines = "".join(f"    line {i}.{n} of {name} = compute({n})\n" for n in range(64))
    return {"text": lines, "time": [1733000000 + i, 5000], "filename": name}


class InfillKeyTests(SynchronousTestCase):
    def key(self, body: bytes) -> str | None:
        keys = {peek(body).affinity_key, fed(body, 1000)[0].affinity_key, fed(body, 7)[0].affinity_key}
        self.assertEqual(len(keys), 1, body[:80])
        return keys.pop()

    def test_one_session_one_key(self) -> None:
        ring = [chunk("src/a.py", 0), chunk("src/b.py", 1)]
        prefix = "import os\n" + "x = 1\n" * 300
        session = [vim_warmup(ring)]
        for typed in ("d", "de", "def", "def f("):  # keystrokes: prefix, middle, suffix change
            session.append(vim_fim(ring, prefix + typed + "\n", typed, "\nreturn\n"))
        ring = ring + [chunk("src/c.py", 2)]  # the ring gains a chunk: a warm-up, then completions
        session += [vim_warmup(ring), vim_fim(ring, prefix, "x", "")]
        keys = {self.key(body) for body in session}
        self.assertEqual(len(keys), 1)
        key = keys.pop()
        assert key is not None
        self.assertTrue(key.startswith("i:"), key)

    def test_vscode_prepare_and_complete(self) -> None:
        ring = [chunk("/home/u/p/main.ts", 0)]
        bodies = [vscode_fim(ring, "", "", "", prepare=True), vscode_fim(ring, "const a = 1;\n", "con", ""),
                  vscode_fim(ring + [chunk("/home/u/p/util.ts", 1)], "let b\n", "", "\n}")]
        self.assertEqual(len({self.key(b) for b in bodies}), 1)
        self.assertEqual(peek(bodies[1]).model, "qwen2.5-coder")

    def test_sessions_differ(self) -> None:
        a = self.key(vim_fim([chunk("a.py", 0)], "p", "", ""))
        b = self.key(vim_fim([chunk("b.py", 0)], "p", "", ""))  # same text, other file
        c = self.key(vim_fim([chunk("a.py", 1)], "p", "", ""))
        self.assertEqual(len({a, b, c}), 3)

    def test_no_ring_yet_keys_on_the_prefix_start(self) -> None:
        head = "#!/usr/bin/env python\n" * 300  # more than PROMPT_BYTES
        a = self.key(vim_fim([], head + "x = 1\n", "x", ""))
        b = self.key(vim_fim([], head + "x = 1\ny = 2\n", "", "z"))
        self.assertEqual(a, b)
        self.assertNotEqual(a, self.key(vim_fim([], "other file\n", "x", "")))
        self.assertNotEqual(a, self.key(vim_fim([chunk("a.py", 0)], head, "x", "")))

    def test_precedence(self) -> None:
        body = json.loads(vim_fim([chunk("a.py", 0)], "p", "mid", ""))
        infill = peek(json.dumps(body).encode()).affinity_key
        self.assertEqual(peek(json.dumps({**body, "user": "u1"}).encode()).affinity_key,
                         peek(b'{"user": "u1"}').affinity_key)
        self.assertNotEqual(infill, peek(json.dumps({"prompt": "mid"}).encode()).affinity_key)
        # malformed chunks are passed over: the first chunk with a text string counts
        odd = [1, {"filename": "a.py"}, {"text": 3}, chunk("a.py", 0)]
        self.assertEqual(self.key(vim_fim(odd, "p", "", "")), infill)
        self.assertEqual(self.key(vim_fim([chunk("a.py", 0), {"text": {}}], "q", "", "")), infill)
        self.assertEqual(self.key(json.dumps({"input_extra": [{"text": "", "filename": ""}]}).encode())[:2], "i:")
        self.assertIsNone(self.key(b'{"input_extra": [], "input_prefix": ""}'))


class KeyWorkBoundTests(SynchronousTestCase):
    """Issue 20 item 8: the key rules look at a bounded number of events, whatever the
    body's shape; the key is the conversation start up to that bound."""

    def conversation(self, systems: int, first: str, later: int) -> bytes:
        messages = [{"role": "system", "content": "rule %d" % (i % 10)} for i in range(systems)]
        messages.append({"role": "user", "content": first})
        messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}] * later
        return json.dumps({"model": "m1", "messages": messages}).encode()

    def test_many_system_messages(self) -> None:
        body = self.conversation(100_000, "go", 0)
        got, p = fed(body, 65536)
        self.assertEqual(got.model, "m1")
        self.assertLessEqual(p._keys.steps, KEY_EVENTS + 1)
        same, _ = fed(self.conversation(100_000, "stop", 3), 65536)  # the start up to the bound is the same
        self.assertEqual(same.affinity_key, got.affinity_key)
        self.assertNotEqual(fed(self.conversation(10, "go", 0), 65536)[0].affinity_key, got.affinity_key)

    def test_every_shape_is_bounded(self) -> None:
        n = 300_000
        shapes = [
            b'{"messages":[' + b"{}," * n + b'{}],"model":"m1"}',
            b'{"messages":[' + b"1," * n + b'1],"model":"m1"}',
            b'{"messages":[{"role":"system","content":[' + b'{"type":"text","text":"a"},' * n + b"{}]}],\"model\":\"m1\"}",
            b'{"prompt":[' + b'"",' * n + b'""],"model":"m1"}',
            b'{"prompt":[' + b"[]," * n + b'[]],"model":"m1"}',
            b'{"input_extra":[' + b'{"filename":"a"},' * n + b'{}],"model":"m1"}',
            b'{"messages":[{"role":"system",' + b'"x":1,' * n + b'"content":"a"}],"model":"m1"}',
        ]
        for body in shapes:
            for sizes in (65536, 10**9):
                got, p = fed(body, sizes)
                self.assertEqual(got.model, "m1", body[:40])
                self.assertLessEqual(p._keys.steps, KEY_EVENTS + 1, body[:40])
            self.assertEqual(fed(body, 65536)[0], fed(body, 4099)[0], body[:40])


class MostEventsTests(SynchronousTestCase):
    """The small-body walk is used only where the bound cannot be met: most_events is
    never below the events yajl makes of a body."""

    @settings(max_examples=300, deadline=None)
    @given(encoded())
    def test_an_upper_bound(self, case: tuple[dict[str, Any], bytes]) -> None:
        import ijson

        from crossbar.proxy.peek.rules import most_events
        _, body = case
        body = body.removeprefix(b"\xef\xbb\xbf")
        events = sum(1 for _ in ijson.basic_parse(body, use_float=True))
        self.assertGreaterEqual(most_events(body), events, body)

    def test_a_body_past_the_bound_goes_incremental(self) -> None:
        body = json.dumps({"model": "m1", "prompt": [0] * (KEY_EVENTS + 1)}, separators=(",", ":")).encode()
        self.assertLess(len(body), 65536)
        self.assertIsNone(peek_small(body))
        self.assertEqual(peek(body), fed(body, 1)[0])
