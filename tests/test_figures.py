"""Reading an answer's figures from its tail (docs/design.md §What the answers say): every
shape llama-server answers in, ``timings`` over ``usage``, and hostile shapes counting
nothing without raising. The agreement with real llama-servers is in
tests/test_tokens_real.py."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from crossbar.ops.figures import TAIL_BYTES, Figures, read_figures

SSE = b"text/event-stream"
JSON = b"application/json; charset=utf-8"


def sse(*events: Any, named: bool = False) -> bytes:
    out = b""
    for event in events:
        if named and isinstance(event, dict):
            out += b"event: " + event["type"].encode() + b"\n"
        out += b"data: " + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n\n"
    return out


def timings(prompt: int, cached: int, generated: int) -> dict[str, Any]:
    return {"cache_n": cached, "prompt_n": prompt, "prompt_ms": 1.5, "prompt_per_second": 1000.0 * prompt,
            "predicted_n": generated, "predicted_ms": 2.0, "predicted_per_second": 500.0 * generated}


def read(body: bytes, ctype: bytes | None = JSON, path: bytes = b"/v1/chat/completions") -> Figures | None:
    return read_figures([body], ctype, path, True)


class ShapeTests(TestCase):
    def test_chat_json_timings_win_over_usage(self) -> None:
        body = json.dumps({"choices": [], "usage": {"completion_tokens": 99, "prompt_tokens": 99,
                                                    "prompt_tokens_details": {"cached_tokens": 9}},
                           "timings": timings(7, 30, 5)}).encode()
        self.assertEqual(read(body), Figures(7, 30, 5, 7000.0, 2500.0))

    def test_chat_json_usage_only(self) -> None:
        body = json.dumps({"usage": {"completion_tokens": 5, "prompt_tokens": 31,
                                     "prompt_tokens_details": {"cached_tokens": 30}}}).encode()
        self.assertEqual(read(body), Figures(1, 30, 5))

    def test_chat_stream_last_event_with_figures(self) -> None:
        chunk = {"choices": [{"delta": {"content": " x"}}], "object": "chat.completion.chunk"}
        last = {"choices": [{"finish_reason": "length", "delta": {}}], "timings": timings(3, 4, 5)}
        body = sse(chunk, chunk, last, b"[DONE]")
        self.assertEqual(read(body, SSE), Figures(3, 4, 5, 3000.0, 2500.0))
        with_usage = sse(chunk, {**last, "usage": {"prompt_tokens": 50, "completion_tokens": 50}}, b"[DONE]")
        self.assertEqual(read(with_usage, SSE), Figures(3, 4, 5, 3000.0, 2500.0))
        only_usage = sse(chunk, {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 6,
                                                           "prompt_tokens_details": {"cached_tokens": 2}}},
                         b"[DONE]")
        self.assertEqual(read(only_usage, SSE), Figures(10, 2, 6))
        self.assertIsNone(read(sse(chunk, chunk, b"[DONE]"), SSE))

    def test_native_json_array_and_stream(self) -> None:
        native = {"content": "x", "tokens_predicted": 4, "tokens_evaluated": 6, "tokens_cached": 9,
                  "timings": timings(1, 5, 4)}
        self.assertEqual(read(json.dumps(native).encode(), JSON, b"/completion"), Figures(1, 5, 4, 1000.0, 2000.0))
        first = {**native, "timings": timings(8, 0, 3)}
        self.assertEqual(read(json.dumps([first, native]).encode(), JSON, b"/completion"),
                         Figures(1, 5, 4, 1000.0, 2000.0))
        no_timings = {k: v for k, v in native.items() if k != "timings"}
        self.assertEqual(read(json.dumps(no_timings).encode(), JSON, b"/infill"), Figures(6, 0, 4))
        stream = sse({"content": " a", "stop": False, "tokens_predicted": 1, "tokens_evaluated": 6},
                     {"content": "", "stop": True, **native})
        self.assertEqual(read(stream, SSE, b"/completion"), Figures(1, 5, 4, 1000.0, 2000.0))

    def test_anthropic(self) -> None:
        body = json.dumps({"type": "message", "content": [{"type": "text", "text": "x"}],
                           "usage": {"cache_read_input_tokens": 30, "input_tokens": 1, "output_tokens": 5}}).encode()
        self.assertEqual(read(body, JSON, b"/v1/messages"), Figures(1, 30, 5))
        start = {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 9, "input_tokens": 22,
                                                                "output_tokens": 0}}}
        delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " us"}}
        end = [{"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 5}},
               {"type": "message_stop"}]
        stream = sse(start, delta, delta, *end, named=True)
        self.assertEqual(read(stream, SSE, b"/v1/messages"), Figures(22, 9, 5))
        # message_start has left the tail: it is read from the first chunk, kept aside
        head = sse(start, named=True)
        rest = sse(*([delta] * 400), *end, named=True)
        self.assertGreater(len(rest), TAIL_BYTES)
        self.assertEqual(read_figures([rest], SSE, b"/v1/messages", False, head), Figures(22, 9, 5))
        self.assertEqual(read_figures([rest], SSE, b"/v1/messages", False, None), Figures(0, 0, 5))

    def test_responses(self) -> None:
        body = json.dumps({"object": "response", "status": "completed",
                           "usage": {"input_tokens": 27, "output_tokens": 5, "total_tokens": 32,
                                     "input_tokens_details": {"cached_tokens": 13}}}).encode()
        self.assertEqual(read(body, JSON, b"/v1/responses"), Figures(14, 13, 5))
        done = {"type": "response.completed",
                "response": {"status": "completed", "usage": {"input_tokens": 27, "output_tokens": 5,
                                                              "input_tokens_details": {"cached_tokens": 26}}}}
        stream = sse({"type": "response.output_text.delta", "delta": " x"}, done, named=True)
        self.assertEqual(read(stream, SSE, b"/v1/responses"), Figures(1, 26, 5))
        self.assertEqual(read(sse({**done, "timings": timings(2, 25, 5)}, named=True), SSE), Figures(2, 25, 5, 2000.0, 2500.0))

    def test_long_json_answer_read_from_its_tail(self) -> None:
        body = json.dumps({"choices": [{"message": {"content": "word " * 20000}}],
                           "usage": {"prompt_tokens": 40, "completion_tokens": 4000},
                           "timings": timings(12, 28, 4000)}).encode()
        chunks = [body[i:i + 4096] for i in range(0, len(body), 4096)][-5:]
        self.assertEqual(read_figures(chunks, JSON, b"/v1/chat/completions", False), Figures(12, 28, 4000, 12000.0, 2000000.0))
        # key-like text inside a string is escaped and never matches
        tricky = json.dumps({"content": 'x "timings": {"prompt_n": 1, "predicted_n": 1}' * 2000,
                             "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()
        self.assertEqual(read_figures([tricky[-TAIL_BYTES:]], JSON, b"/", False), Figures(3, 0, 2))

    def test_not_json_or_sse_counts_nothing(self) -> None:
        body = json.dumps({"timings": timings(1, 2, 3)}).encode()
        self.assertIsNone(read(body, b"text/plain"))
        self.assertIsNone(read(body, None))
        self.assertIsNone(read_figures([], JSON, b"/", True))


HOSTILE_VALUES = ["12", -1, 1 << 40, 10 ** 30, 1.5, True, None, [], {"n": 1}, float("nan")]


class HostileTests(TestCase):
    def test_bad_counts_count_nothing(self) -> None:
        for bad in HOSTILE_VALUES:
            for key in ("prompt_n", "predicted_n", "cache_n"):
                t = {**timings(1, 2, 3), key: bad}
                if bad is None and key == "cache_n":
                    continue  # an absent/null cache figure is 0
                self.assertIsNone(read(json.dumps({"timings": t}).encode()), (key, bad))
            for key in ("prompt_tokens", "completion_tokens"):
                u = {"prompt_tokens": 5, "completion_tokens": 5, key: bad}
                if bad is None:
                    continue
                self.assertIsNone(read(json.dumps({"usage": u}).encode()), (key, bad))
        self.assertIsNone(read(json.dumps({"timings": {**timings(1, 2, 3), "predicted_per_second": -3}}).encode()))
        self.assertIsNone(read(b'{"timings": {"prompt_n": 1, "predicted_n": 1, "predicted_per_second": 1e999}}'))
        cached_over = {"usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 6}}}
        self.assertIsNone(read(json.dumps(cached_over).encode()))
        # a prompt total at MAX_TOKENS is not believed even when total - cached is below it
        for usage in ({"prompt_tokens": 1 << 31, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 1 << 30}},
                      {"input_tokens": 1 << 31, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 1 << 30}}):
            self.assertIsNone(read(json.dumps({"usage": usage}).encode()), usage)
        self.assertIsNone(read(json.dumps({"timings": "fast", "usage": "many"}).encode()))

    def test_deep_nesting_and_a_megabyte_of_usage(self) -> None:
        deep = b'{"usage": ' + b"[" * 200000 + b"]" * 200000 + b"}"
        self.assertIsNone(read_figures([deep[-TAIL_BYTES:]], JSON, b"/", False))
        self.assertIsNone(read(deep))
        self.assertIsNone(read(sse(b'{"usage": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"), SSE))
        big = json.dumps({"usage": {"pad": "x" * (1 << 20), "prompt_tokens": 5, "completion_tokens": 5}}).encode()
        chunks = [big[i:i + 65536] for i in range(0, len(big), 65536)]
        self.assertIsNone(read_figures(chunks[-1:], JSON, b"/", False))
        self.assertIsNone(read_figures(chunks[-1:], SSE, b"/", False))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.binary(max_size=300), max_size=8), st.booleans(), st.booleans())
    def test_never_raises(self, chunks: list[bytes], sse_type: bool, whole: bool) -> None:
        stuffed = [c.replace(b"x", b'"timings":{') for c in chunks]
        result = read_figures(stuffed, SSE if sse_type else JSON, b"/", whole, stuffed[0] if stuffed else None)
        self.assertTrue(result is None or isinstance(result, Figures))

    @settings(max_examples=200, deadline=None)
    @given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                            st.sampled_from(["timings", "usage", "prompt_n", "predicted_n", "cache_n", "prompt_tokens",
                                             "input_tokens", "output_tokens", "tokens_predicted", "response", "type"]),
                            inner, max_size=5), max_leaves=30))
    def test_any_json_shape(self, doc: Any) -> None:
        body = json.dumps(doc).encode()
        for result in (read(body), read(sse(body), SSE), read_figures([body], JSON, b"/", False)):
            if result is not None:
                self.assertTrue(0 <= result.prompt < 1 << 31 and 0 <= result.cached < 1 << 31
                                and 0 <= result.generated < 1 << 31, result)


def _count_ok(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 31


def _speed_ok(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and 0 <= value < 1e9)


def expected(t: Any, u: Any) -> Figures | None:
    """DESIGN's rules for an answer's ``timings`` (``t``) and OpenAI ``usage`` (``u``),
    written plainly from the parsed values (a key absent: the value ``...``)."""
    if t is not ... and t is not None:
        if not isinstance(t, dict) or not all(_count_ok(t.get(k)) for k in ("prompt_n", "predicted_n")):
            return None
        cached = 0 if t.get("cache_n") is None else t["cache_n"]
        speeds = [t.get("prompt_per_second"), t.get("predicted_per_second")]
        if not _count_ok(cached) or not all(map(_speed_ok, speeds)):
            return None
        return Figures(t["prompt_n"], cached, t["predicted_n"], *(None if v is None else float(v) for v in speeds))
    if u is ... or u is None or not isinstance(u, dict):
        return None
    total, generated = u.get("prompt_tokens"), u.get("completion_tokens")
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    total, cached, generated = (0 if v is None else v for v in (total, cached, generated))
    if not (_count_ok(total) and _count_ok(cached) and _count_ok(generated)) or cached > total:
        return None
    return Figures(total - cached, cached, generated)


_ANY_FIGURE = (st.integers(0, 40) | st.integers(-2, 1 << 32) | st.integers() | st.floats() | st.booleans() | st.none()
               | st.text(max_size=3) | st.lists(st.integers(0, 9), max_size=2))


class InlineReadTests(TestCase):
    """The reader checks llama-server's ``timings`` and OpenAI's ``usage`` in line (issue 19's
    cost): every value, absent or of any type, gives what the rules give."""

    @settings(max_examples=400, deadline=None)
    @given(st.one_of(st.just(...), st.none(), st.dictionaries(
               st.sampled_from(["prompt_n", "cache_n", "predicted_n", "prompt_per_second", "predicted_per_second",
                                "prompt_ms"]), _ANY_FIGURE)),
           st.one_of(st.just(...), st.none(), st.integers(), st.dictionaries(
               st.sampled_from(["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"]),
               _ANY_FIGURE | st.dictionaries(st.just("cached_tokens"), _ANY_FIGURE)).filter(
               lambda u: "prompt_tokens" in u or "completion_tokens" in u)),
           st.booleans())
    def test_timings_and_usage_as_the_rules_say(self, t: Any, u: Any, stream: bool) -> None:
        answer: dict[str, Any] = {"choices": [{"message": {"content": "x"}}]}
        if u is not ...:
            answer["usage"] = u
        if t is not ...:
            answer["timings"] = t
        body = json.dumps(answer, separators=(",", ":") if stream else None).encode()
        got = read(sse(body, b"[DONE]"), SSE) if stream else read(body)
        self.assertEqual(got, expected(t, u), (t, u))


_TIMINGS_ORDER = ("cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                  "predicted_ms", "predicted_per_token_ms", "predicted_per_second")
_NEAR_LIMIT = st.sampled_from([0, 7, 999_999_999, 1_000_000_000, (1 << 31) - 1, 1 << 31, -1, 1e9 - 0.5, 1e9, 12.25, -0.0,
                               1e-7, 3.5e12])


class ExactBytesTests(TestCase):
    """llama-server's own bytes (its key order, no blanks) are read without decoding
    (issue 19's cost); whatever the values, the answer is what the rules give."""

    @settings(max_examples=400, deadline=None)
    @given(st.lists(_ANY_FIGURE | _NEAR_LIMIT, min_size=9, max_size=9), st.booleans())
    def test_llama_timings_bytes(self, values: list[Any], stream: bool) -> None:
        t = dict(zip(_TIMINGS_ORDER, values))
        body = json.dumps({"choices": [], "timings": t}, separators=(",", ":")).encode()
        got = read(sse(body, b"[DONE]"), SSE) if stream else read(body)
        self.assertEqual(got, expected(t, ...), t)

    @settings(max_examples=400, deadline=None)
    @given(st.lists(_ANY_FIGURE | _NEAR_LIMIT, min_size=4, max_size=4), st.booleans(), st.booleans())
    def test_usage_bytes_in_both_orders(self, values: list[Any], openai_order: bool, details: bool) -> None:
        completion, prompt, total, cached = values
        u = ({"prompt_tokens": prompt, "completion_tokens": completion} if openai_order
             else {"completion_tokens": completion, "prompt_tokens": prompt})
        u["total_tokens"] = total
        if details:
            u["prompt_tokens_details"] = {"cached_tokens": cached}
        body = json.dumps({"choices": [], "usage": u}, separators=(",", ":")).encode()
        self.assertEqual(read(body), expected(..., u), u)

    def test_the_bytes_real_hosts_send(self) -> None:
        """As llama-server b11669 wrote them (a stream's last event and a chat answer)."""
        event = (b'data: {"choices":[],"created":1796181777,"id":"chatcmpl-m9","model":"tiny-a","object":'
                 b'"chat.completion.chunk","usage":{"completion_tokens":3,"prompt_tokens":50,"total_tokens":53,'
                 b'"prompt_tokens_details":{"cached_tokens":49}},"timings":{"cache_n":49,"prompt_n":1,"prompt_ms":0.427,'
                 b'"prompt_per_token_ms":0.427,"prompt_per_second":2341.92037470726,"predicted_n":3,"predicted_ms":0.697,'
                 b'"predicted_per_token_ms":0.3485,"predicted_per_second":2869.4404591104735}}\n\ndata: [DONE]\n\n')
        self.assertEqual(read(event, SSE), Figures(1, 49, 3, 2341.92037470726, 2869.4404591104735))
        answer = (b'{"choices":[],"object":"chat.completion","usage":{"completion_tokens":5,"prompt_tokens":50,'
                  b'"total_tokens":55,"prompt_tokens_details":{"cached_tokens":0}},"id":"chatcmpl-Ff"}')
        self.assertEqual(read(answer), Figures(50, 0, 5))
        openai = b'{"usage":{"prompt_tokens":9,"completion_tokens":8,"total_tokens":17}}'
        self.assertEqual(read(openai), Figures(9, 0, 8))
        for cached, counted in ((5, True), (6, False)):  # more cached than the whole prompt: not believed
            over = (b'{"usage":{"completion_tokens":1,"prompt_tokens":5,"total_tokens":6,"prompt_tokens_details":'
                    b'{"cached_tokens":%d}}}' % cached)
            self.assertEqual(read(over), Figures(0, 5, 1) if counted else None)

    def test_a_stream_whose_figures_are_before_the_last_2k(self) -> None:
        last = json.dumps({"choices": [], "timings": timings(3, 4, 5)}, separators=(",", ":")).encode()
        body = sse(last, *[b'{"note":"' + b"n" * 900 + b'"}'] * 4)
        self.assertEqual(read(body, SSE), Figures(3, 4, 5, 3000.0, 2500.0))


class _Sink:
    """The client side of a relay, as much as dataReceived uses."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


class RelayTailTests(TestCase):
    def test_keeps_references_to_the_last_16k_and_the_first_chunk(self) -> None:
        from twisted.internet.task import Clock

        from crossbar.proxy.relay import Relay

        relay = Relay(_Sink(), Clock(), 10.0)  # type: ignore[arg-type]
        chunks = [bytes([65 + i % 26]) * 1000 for i in range(100)]
        for chunk in chunks:
            relay.dataReceived(chunk)
        kept = list(relay._tail)
        self.assertTrue(all(any(k is c for c in chunks) for k in kept), "a chunk was copied")
        self.assertLess(sum(map(len, kept)) - len(kept[0]), TAIL_BYTES)
        self.assertGreaterEqual(sum(map(len, kept)), TAIL_BYTES)
        self.assertIs(relay._head, chunks[0])
        self.assertIs(kept[-1], chunks[-1])
        self.assertEqual(relay.first_byte_at, 0.0)
