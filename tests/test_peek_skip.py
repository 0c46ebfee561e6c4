"""The body peek skips the bytes of values no rule reads without yajl (crossbar.proxy.peek.skip;
issue 20 item 8): the same answers as a full parse on valid bodies, however the body is
cut into chunks; malformed JSON inside a skipped region gives no answer or the answer
of the body's well-formed parts, never a crash nor another answer."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from crossbar.proxy.peek import MAX_DEPTH, NOTHING, Peeked
from crossbar.proxy.peek.rules import rules_of
from tests.reference import peek_model
from tests.test_peek import fed

FILLERS = {  # values no rule reads, long enough to be skipped past chunk boundaries
    "ints": "[" + "0," * 40000 + "0]",
    "objects": "[" + '{"a":[1,{"b":"]}"}]},' * 4000 + "{}]",
    "strings": "[" + '"x\\"]}{[\\\\",' * 8000 + '"y"]',
    "escaped text": json.dumps("a\"b\\c}]{[\n" * 9000),
    "nested": json.dumps([{"model": "no", "user": "no", "deep": [[[["model"]]]]}] * 3000),
}


def reference(body: bytes) -> Peeked:
    """The key rules over the decoded body (the skipped values play no part in them)."""
    found = rules_of(json.loads(body))
    found.brace = None  # no spot: compared apart
    return found.result()


def members(doc: list[tuple[str, str]]) -> bytes:
    """A JSON object from (key, JSON text) pairs, duplicates kept, in order."""
    return ("{" + ",".join(f"{json.dumps(k)}: {v}" for k, v in doc) + "}").encode()


def check_spot(case: SynchronousTestCase, body: bytes, got: Peeked) -> None:
    if got.model is not None:
        assert got.spot is not None
        case.assertEqual(json.loads(body[got.spot.start:got.spot.end]), got.model)


class SkippedValuesTests(SynchronousTestCase):
    sizes: list[Any] = [65536, 4096, 1000, 7, [65531, 3, 17], [100, 40000]]

    def same(self, body: bytes) -> None:
        want = reference(body)
        self.assertEqual(peek_model(body), want.model)
        for sizes in self.sizes:
            got = fed(body, sizes)
            self.assertEqual(got, want, sizes)
            check_spot(self, body, got)

    def test_keys_after_skipped_values(self) -> None:
        for name, filler in FILLERS.items():
            for tail in ('"model": "m2"', '"user": "u"', '"mod\\u0065l": "m3"', '"\\u0075ser": "u2"',
                         '"prompt": "p"', '"prompt_cache_key": "k"', '"messages": [{"role": "user", "content": "c"}]',
                         '"input_extra": [{"filename": "f", "text": "t"}]', '"input_prefix": "i"',
                         # the last match of a key nested (not at depth 1), or in a string
                         '"user": "u", "y": {"user": "no"}', '"model": "m2", "y": [{"a": 1, "model": "no"}]',
                         '"user": "u", "y": ", \\"user\\": "', '"model": "m2", "model": {"model": "m3"}'):
                with self.subTest(filler=name, tail=tail):
                    body = members([("model", '"m1"'), ("x", filler)]) [:-1] + b",  \n\t" + tail.encode() + b"}"
                    self.same(body)

    def test_skipped_inside_the_messages(self) -> None:
        for name, filler in FILLERS.items():
            messages = [{"role": "system", "content": "s", "tool_calls": json.loads(filler)},
                        {"role": "user", "content": [{"type": "text", "text": "hi", "x": json.loads(filler)},
                                                     {"type": "text", "text": "there"}]},
                        {"role": "assistant", "content": json.loads(filler)}]
            body = members([("model", '"m1"'), ("messages", json.dumps(messages)), ("stream", "true"),
                            ("model", '"m2"')])
            self.same(body)

    def test_many_members_and_duplicates(self) -> None:
        rnd = random.Random(5)
        doc = [("model", '"m0"')]
        for i in range(30000):
            doc.append((rnd.choice(["a", "b", "model", "user", "tools"]), rnd.choice(['{}', '[0]', '"s"', '"m%d"' % i, '1'])))
        doc.append(("z", "1"))
        self.same(members(doc))

    def test_past_the_key_bound(self) -> None:
        messages = [{"role": "system", "content": "s"}] * 40000 + [{"role": "user", "content": "go"}]
        for top in ({"messages": messages, "model": "m1"}, {"model": "m1", "messages": messages, "user": "u"}):
            body = json.dumps(top).encode()
            first = fed(body, 65536)
            self.assertEqual(first.model, "m1")
            self.assertIsNotNone(first.affinity_key)
            for sizes in self.sizes:
                self.assertEqual(fed(body, sizes), first, sizes)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.sampled_from(["model", "user", "x", "messages", "prompt", "mod\u0065l"]),
                              st.sampled_from(list(FILLERS) + ['"m1"', '"u"', "[]", "{}", "3"])),
                    min_size=1, max_size=5),
           st.lists(st.integers(50, 70000), min_size=1, max_size=4))
    def test_property(self, doc: list[tuple[str, str]], sizes: list[int]) -> None:
        body = members([(k, FILLERS.get(v, v)) for k, v in doc])
        # (a filler as the messages or prompt may reach KEY_EVENTS, where the decoded-dict walk
        # knows no bound: then the answer must only not depend on the chunking)
        bound = any(k in ("messages", "prompt") and v in FILLERS for k, v in doc)
        want = fed(body, 65536) if bound else reference(body)
        got = fed(body, sizes)
        self.assertEqual(got, want)
        check_spot(self, body, got)


class MalformedInSkippedTests(SynchronousTestCase):
    """Malformed bytes in a skipped value: the host refuses such a body anyway (400);
    the peek gives the answer of the well-formed parts or none, never raises."""

    start = b'{"model": "m1", "x": [' + b"0," * 50000

    def body(self, bad: bytes, tail: bytes = b', "user": "u"}') -> bytes:
        return self.start + bad + b"0]" + tail

    def test_unseen_malformations_keep_the_answer(self) -> None:
        for bad in (b"1,,", b"tru,", b"01,", b'"\xff",', b'"\\x",', b"[{]},"):
            body = self.body(bad)
            self.assertIsNone(peek_model(body), bad)
            answers = {fed(body, sizes) for sizes in (65536, 4096, 1000, 7)}
            self.assertLessEqual(answers - {NOTHING}, {Peeked("m1", "u:" + fed(b'{"user": "u"}', 1).affinity_key[2:])},
                                 bad)
            self.assertEqual(fed(body, 65536).model, "m1", bad)

    def test_detected_malformations_give_nothing(self) -> None:
        for body in (
            self.body(b"\x01,"),  # a raw control byte
            self.body(b"[" * (2 * MAX_DEPTH) + b"]" * (2 * MAX_DEPTH) + b","),  # too deep
            self.start + b"0",  # the body ends inside the skipped value
            self.body(b"", b""),  # ... inside the top-level object
            self.body(b"", b"}}"),  # a bracket too many
            self.body(b"", b"]"),  # the top-level object closed by the wrong bracket
            self.start + b'"open string',  # the body ends inside a string
        ):
            self.assertIsNone(peek_model(body), body[-40:])
            for sizes in (65536, 4096, 7):
                self.assertEqual(fed(body, sizes), NOTHING, (body[-40:], sizes))
