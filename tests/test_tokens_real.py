"""Tokens, speed and cache through crossbar against real llama-servers (docs/design.md §What
the answers say): every API llama-server speaks, streamed and not, through raw HTTP
and the real openai and anthropic SDKs. crossbar's counts must equal what the host
reported in the very same answers (read here, in the test, from the whole body) and
the increase of the host's own ``--metrics`` counters; a conversation that keeps to
its host shows a cached share above 80% in status; the ``model`` label never takes a
value from a request. Skipped when no llama-server can be had, except under CI.
"""

from __future__ import annotations

import json
from typing import Any

import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.trial import unittest

from tests.harness import http_client, require_llama_server, start_crossbar, wait_for
from tests.logs import LogCapture
from tools.llama_server import LlamaServer

KEY = "alice-Tk9q2-secret"
AUTH = {b"Authorization": [b"Bearer " + KEY.encode()], b"Content-Type": [b"application/json"]}
Counts = tuple[int, int, int]


def reported(body: bytes, content_type: str) -> Counts:
    """What the host says it did in a whole answer (prompt processed, cached,
    generated), read here independently of crossbar's tail reader."""
    if content_type.startswith("text/event-stream"):
        events = [json.loads(line[5:]) for line in body.split(b"\n")
                  if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
    else:
        doc = json.loads(body)
        events = [doc[-1] if isinstance(doc, list) else doc]
    for event in reversed(events):
        if "timings" in event:
            t = event["timings"]
            return t["prompt_n"], t.get("cache_n", 0), t["predicted_n"]
    for event in reversed(events):
        if event.get("type") == "message_delta":  # Anthropic stream
            start = next(e for e in events if e.get("type") == "message_start")["message"]["usage"]
            return start["input_tokens"], start.get("cache_read_input_tokens", 0), event["usage"]["output_tokens"]
        usage = event.get("usage") or (event.get("response") or {}).get("usage")
        if not usage:
            continue
        if "prompt_tokens" in usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            return usage["prompt_tokens"] - cached, cached, usage["completion_tokens"]
        if "input_tokens_details" in usage:
            cached = usage["input_tokens_details"].get("cached_tokens", 0)
            return usage["input_tokens"] - cached, cached, usage["output_tokens"]
        return usage["input_tokens"], usage.get("cache_read_input_tokens", 0), usage["output_tokens"]
    raise AssertionError(f"no figures in the answer: {body[-300:]!r}")


def add(a: Counts, b: Counts) -> Counts:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def crossbar_tokens(text: str, **labels: str) -> dict[str, dict[str, float]]:
    """``crossbar_tokens_total`` summed by kind, per ``model`` label, for series with ``labels``."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "crossbar_tokens_total" and all(s.labels.get(k) == v for k, v in labels.items()):
                kinds = out.setdefault(s.labels["model"], {})
                kinds[s.labels["kind"]] = kinds.get(s.labels["kind"], 0) + s.value
    return out


def host_counters(text: str) -> Counts:
    values = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:") and " " in line:
            name, value = line.split()[:2]
            values[name] = int(float(value))
    return (values["llamacpp:prompt_tokens_total"], values["llamacpp:prompt_tokens_cached_total"],
            values["llamacpp:tokens_predicted_total"])


async def get_text(case: unittest.TestCase, url: str) -> str:
    response = await http_client(case).get(url)
    return str(await treq.text_content(response))


def _anthropic(base: str, stream: bool) -> Counts:
    import anthropic

    client = anthropic.Anthropic(base_url=base + "/r", auth_token=KEY, api_key=None, max_retries=0, timeout=60.0)
    try:
        messages: Any = [{"role": "user", "content": "tell me about the river and the garden"}]
        if stream:
            with client.messages.stream(model="tiny-a", max_tokens=12, messages=messages) as s:
                text = "".join(s.text_stream)
                assert text, "no text streamed"
                usage: Any = s.get_final_message().usage
        else:
            usage = client.messages.create(model="tiny-a", max_tokens=9, messages=messages).usage
        return usage.input_tokens, usage.cache_read_input_tokens or 0, usage.output_tokens
    finally:
        client.close()


def _responses(base: str, stream: bool) -> Counts:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/r/v1", api_key=KEY, max_retries=0, timeout=60.0)
    try:
        if stream:
            usage: Any = None
            for event in client.responses.create(model="tiny-a", input="north south east west", stream=True,
                                                 max_output_tokens=10):
                if event.type == "response.completed":
                    usage = event.response.usage
        else:
            usage = client.responses.create(model="tiny-a", input="north south east", max_output_tokens=7).usage
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        return usage.input_tokens - cached, cached, usage.output_tokens
    finally:
        client.close()


REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "tiny-a", "messages": [{"role": "user", "content": "hello cat"}],
                              "max_tokens": 6}),
    ("/v1/chat/completions", {"model": "tiny-a", "messages": [{"role": "user", "content": "hello cat"}],
                              "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "tiny-a", "messages": [{"role": "user", "content": "blue dog"}],
                              "max_tokens": 5, "stream": True}),
    ("/v1/completions", {"model": "tiny-a", "prompt": "the quiet window", "max_tokens": 4, "stream": True}),
    ("/completion", {"prompt": "green stone light", "n_predict": 5}),
    ("/completion", {"prompt": "green stone light", "n_predict": 6, "stream": True}),
    ("/infill", {"input_prefix": "def route(", "input_suffix": "):\n    return host\n",
                 "input_extra": [{"filename": "a.py", "text": "proxy = 1\n"}], "n_predict": 4}),
    ("/infill", {"input_prefix": "x = (", "input_suffix": ")\n", "n_predict": 3, "stream": True}),
    # long answers: a stream of hundreds of events, and a JSON answer far over the
    # 16 KiB tail (token probabilities), read from their tails
    ("/v1/chat/completions", {"model": "tiny-a", "messages": [{"role": "user", "content": "a long one"}],
                              "max_tokens": 300, "stream": True}),
    ("/completion", {"prompt": "many words", "n_predict": 120, "n_probs": 5}),
    # a name no host lists: served by the single-model host (fallback), counted as "other"
    ("/v1/chat/completions", {"model": "gpt-4o-from-a-client", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 3}),
]


class TokensRealTests(unittest.TestCase):
    timeout = 300

    def setUp(self) -> None:
        require_llama_server(self)

    async def _single(self, extra: list[str]) -> tuple[LlamaServer, Any, str]:
        server = LlamaServer("single", extra_args=extra)
        self.addCleanup(server.stop)
        await deferToThread(server.start, 60)
        service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts:
  gpu: {server.url}
routes:
  r:
    hosts: [gpu]
    keys: {{alice: {KEY}}}
""")
        await service.poller.when_first_round_done()
        await wait_for(lambda: service.table.is_healthy("gpu"), timeout=10)
        return server, service, base

    def test_every_api_counts_what_the_host_reported(self) -> object:
        """Raw HTTP for chat (JSON, stream with and without usage), completions,
        /completion, /infill (JSON and stream, long answers included), the anthropic
        SDK (create and stream) and the openai SDK's responses API (create and stream):
        crossbar's tokens equal each answer's figures, their sum, and the host's own
        counters' increase; the log line carries them; a model no host lists is
        labelled ``other``."""

        async def go() -> None:
            server, service, base = await self._single(["--metrics", "-c", "4096"])
            logs = LogCapture(self)
            before = host_counters(await get_text(self, server.url + "/metrics"))
            total: Counts = (0, 0, 0)
            each: list[Counts] = []
            client = http_client(self)
            for path, body in REQUESTS:
                response = await client.post(base + "/r" + path, json.dumps(body).encode(), headers=AUTH)
                data = await treq.content(response)
                self.assertEqual(response.code, 200, (path, data[:300]))
                ctype = response.headers.getRawHeaders(b"content-type")[0].decode()
                figures = reported(data, ctype)
                self.assertGreater(figures[2], 0, path)
                each.append(figures)
                total = add(total, figures)
            for stream in (False, True):
                figures = await deferToThread(_anthropic, base, stream)
                each.append(figures)
                total = add(total, figures)
                figures = await deferToThread(_responses, base, stream)
                each.append(figures)
                total = add(total, figures)
            after = host_counters(await get_text(self, server.url + "/metrics"))
            self.assertEqual(tuple(a - b for a, b in zip(after, before)), total, "the host's own counters")

            lines = [e for e in logs.proxied() if e.get("route") == "r"]
            await wait_for(lambda: len([e for e in logs.proxied() if e.get("route") == "r"]) == len(each))
            lines = [e for e in logs.proxied() if e.get("route") == "r"]
            self.assertEqual([e["tokens"] for e in lines], each)
            self.assertTrue(all(e["ended"] == "complete" for e in lines))
            self.assertRegex(lines[0]["line"], r" tokens=\d+\+\d+/\d+ tps=[\d.]+$")

            metrics = await get_text(self, base + "/_crossbar/metrics")
            by_model = crossbar_tokens(metrics, route="r", host="gpu", key="alice")
            self.assertEqual(set(by_model), {"tiny-a", "other"}, by_model)
            summed = tuple(int(sum(m.get(kind, 0) for m in by_model.values()))
                           for kind in ("prompt", "cached", "generated"))
            self.assertEqual(summed, total)
            # requests naming no model, or one no host lists, count as "other"
            other: Counts = (0, 0, 0)
            for (_, body), figures in zip(REQUESTS, each):
                if body.get("model") != "tiny-a":
                    other = add(other, figures)
            self.assertEqual(tuple(int(by_model["other"][k]) for k in ("prompt", "cached", "generated")), other)
            self.assertNotIn("gpt-4o", metrics)
            self.assertIn('crossbar_generation_tokens_per_second_count{host="gpu",model="tiny-a"}', metrics)
            self.assertIn('crossbar_time_to_first_token_seconds_count{host="gpu",route="r"}', metrics)

            status = json.loads(await get_text(self, base + "/_crossbar/status"))
            self.assertGreater(status["hosts"]["gpu"]["tokens_per_s"], 0)
            share = status["routes"]["r"]["cached_share"]
            self.assertAlmostEqual(share, total[1] / (total[0] + total[1]), places=3)

        return ensureDeferred(go())

    def test_router_mode(self) -> object:
        """A router-mode host: the answers' figures are counted under the model the
        request was chosen for (loaded on demand)."""

        async def go() -> None:
            server = LlamaServer("router")
            self.addCleanup(server.stop)
            await deferToThread(server.start, 60)
            service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts:
  router: {server.url}
routes:
  r:
    hosts: [router]
""")
            await service.poller.when_first_round_done()
            client = http_client(self)
            total: Counts = (0, 0, 0)
            for path, body in [
                ("/v1/chat/completions", {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 5}),
                ("/v1/chat/completions", {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 6, "stream": True}),
                ("/completion", {"model": "tiny-b", "prompt": "red cloud", "n_predict": 4, "stream": True}),
                ("/infill", {"model": "tiny-b", "input_prefix": "a(", "input_suffix": ")", "n_predict": 3}),
            ]:
                response = await client.post(base + "/r" + path, json.dumps(body).encode(),
                                             headers={b"Content-Type": [b"application/json"]})
                data = await treq.content(response)
                self.assertEqual(response.code, 200, (path, data[:300]))
                total = add(total, reported(data, response.headers.getRawHeaders(b"content-type")[0].decode()))
            metrics = await get_text(self, base + "/_crossbar/metrics")
            by_model = crossbar_tokens(metrics, route="r", host="router", key="")
            self.assertEqual(set(by_model), {"tiny-b"})
            self.assertEqual(tuple(int(by_model["tiny-b"][k]) for k in ("prompt", "cached", "generated")), total)

        return ensureDeferred(go())

    def test_conversation_with_affinity_reads_from_the_cache(self) -> object:
        """Eight turns of one conversation over two hosts with affinity: every turn
        lands on one host, and status shows the route's (and that host's) cached share
        of prompt tokens above 80%."""

        async def go() -> None:
            servers = [LlamaServer("single", extra_args=["-c", "4096"]) for _ in range(2)]
            for server in servers:
                self.addCleanup(server.stop)
                await deferToThread(server.start, 60)
            service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts:
  a: {servers[0].url}
  b: {servers[1].url}
routes:
  r:
    hosts: [a, b]
""")
            await service.poller.when_first_round_done()
            await wait_for(lambda: service.table.is_healthy("a") and service.table.is_healthy("b"), timeout=10)
            words = ("river cloud stone light proxy server token stream model health route host " * 5).split()
            messages: list[dict[str, str]] = [{"role": "system", "content": "You help."},
                                              {"role": "user", "content": " ".join(words)}]
            client = http_client(self)
            hosts = set()
            for turn in range(8):
                response = await client.post(base + "/r/v1/chat/completions", json.dumps(
                    {"model": "tiny-a", "messages": messages, "max_tokens": 4}).encode(),
                    headers={b"Content-Type": [b"application/json"]})
                doc = json.loads(await treq.content(response))
                self.assertEqual(response.code, 200, doc)
                hosts.add(response.headers.getRawHeaders(b"x-crossbar-host")[0].decode())
                messages += [{"role": "assistant", "content": doc["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"and then {turn}"}]
            self.assertEqual(len(hosts), 1, hosts)
            status = json.loads(await get_text(self, base + "/_crossbar/status"))
            self.assertGreater(status["routes"]["r"]["cached_share"], 0.8, status["routes"]["r"])
            self.assertGreater(status["hosts"][hosts.pop()]["cached_share"], 0.8)

        return ensureDeferred(go())
