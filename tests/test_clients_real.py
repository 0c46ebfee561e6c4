"""Every client of a llama.cpp fleet, against real llama-servers (issue 18; docs/design.md
§The proxy rules 3-4, §"Model names", §Access, §"Choosing a host" rule 1).

Three llama-servers for the whole class: ``one`` (single-model tiny-a, embeddings on),
``two`` (single-model tiny-a) and ``router`` (router mode: tiny-a and tiny-b, loaded on
demand). Through crossbar:

- llama.cpp's own endpoints (``/infill`` shaped as llama.vim and llama.vscode send it,
  ``/completion``, ``/tokenize``, ``/detokenize``, ``/embedding(s)``, ``/apply-template``,
  ``GET /props?model=...&autoload=false``) answer as they do directly;
- an alias (exact or glob) reaches a router-mode host as its target, and the route model
  list shows it; a request naming no model gets the route's default model on a
  router-mode host (never its 400); a route mixing a single-model and a router-mode host
  never answers 400 for a model nobody serves;
- the ``anthropic`` SDK's ``messages.stream`` with its key in ``X-Api-Key`` works on a
  keyed route (and a fake host shows that the key never leaves crossbar);
- an editor's ``/infill`` session sticks to one host (§"Cache affinity").

Skipped when no llama-server can be had (``python tools/llama_server.py provision``),
except under CI (env ``CI=true``), where that is a failure.
"""

from __future__ import annotations

import atexit
import json
import sys
from collections import Counter
from typing import Any, ClassVar

import treq
from twisted.internet.defer import ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.http_headers import Headers
from twisted.web.server import NOT_DONE_YET, Request

from tests.harness import FakeLlama, http_client, listen, require_llama_server, start_crossbar, upstream_requests
from tools.llama_server import LlamaServer, skip_reason

SECRET = "s3cret-for-anthropic"

VOLATILE = frozenset({"timings", "id_slot", "tokens_cached", "truncated", "generation_settings", "id", "created",
                      "system_fingerprint", "usage", "build_info", "is_sleeping", "n_slots"})
"""Answer fields that depend on the moment or the server's state (the cache), not on the request."""


def stable(doc: Any) -> Any:
    """``doc`` without :data:`VOLATILE` fields (at any depth; ``timings/prompt_n`` is
    how ``response_fields`` names a field of ``timings``)."""
    if isinstance(doc, dict):
        return {k: stable(v) for k, v in doc.items() if k.split("/")[0] not in VOLATILE}
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def chunk(filename: str, text: str) -> dict[str, Any]:
    """One ``input_extra`` chunk as llama.vim sends it (``time`` is vim's ``reltime()``)."""
    return {"text": text, "time": [1733100000, 123456], "filename": filename}


def vim_infill(prefix: str, middle: str, suffix: str, extra: list[dict[str, Any]], n_predict: int = 8) -> dict[str, Any]:
    """A completion request as llama.vim's ``llama#fim`` builds it (autoload/llama.vim),
    with a fixed seed so that two answers can be compared."""
    return {
        "id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": middle,
        "n_predict": n_predict, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "seed": 42,
        "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"],
    }


def vim_warmup(extra: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.vim's ring-buffer warm-up (``s:ring_update``): the new ring, nothing to predict."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}


def vscode_infill(prefix: str, middle: str, suffix: str, extra: list[dict[str, Any]]) -> dict[str, Any]:
    """A completion request as llama.vscode's ``createRequestPayload`` builds it (no model)."""
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": middle,
            "n_predict": 8, "n_cmpl": 1, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000, "seed": 7}


class Servers:
    """The class's three llama-servers, started once (blocking) by its first test and
    stopped when the test process exits (trial has no class fixtures)."""

    one: LlamaServer
    two: LlamaServer
    router: LlamaServer

    def stop(self) -> None:
        for name in ("one", "two", "router"):
            server = getattr(self, name, None)
            if server is not None:
                server.stop()


class ClientsRealTests(TestCase):
    timeout = 240
    servers: ClassVar[Servers | None] = None
    failed: ClassVar[str | None] = None  # why the servers could not start (not tried again)

    @classmethod
    def shared_servers(cls) -> Servers:
        """The three llama-servers, started on the first call."""
        if cls.failed is not None:
            raise RuntimeError(f"the class's llama-servers did not start: {cls.failed}")
        if cls.servers is None:
            servers = Servers()
            servers.one = LlamaServer("single", extra_args=["--embeddings", "--pooling", "mean", "-np", "2"])
            servers.two = LlamaServer("single", extra_args=["-np", "2"])
            servers.router = LlamaServer("router")
            try:
                for server in (servers.one, servers.two, servers.router):
                    server.start(timeout=90)
            except BaseException as e:
                servers.stop()
                cls.failed = repr(e)
                raise
            cls.servers = servers
            atexit.register(servers.stop)
        return cls.servers

    def setUp(self) -> None:
        require_llama_server(self)
        self.s = self.shared_servers()

    async def crossbar(self) -> str:
        s = self.s
        service, base = await start_crossbar(self, f"""
health: {{interval: 0.5, timeout: 5}}
timeouts: {{first_byte: 120}}
hosts:
  one: {s.one.url}
  two: {s.two.url}
  router: {s.router.url}
routes:
  one: {{hosts: [one], default_model: tiny-a}}
  router:
    hosts: [router]
    default_model: tiny-b
    aliases: {{gpt-4o: tiny-b, "claude-*": tiny-a}}
  mixed: {{hosts: [one, router], default_model: tiny-a}}
  fim: {{hosts: [one, two], default_model: tiny-a}}
  fimplain: {{hosts: [one, two], default_model: tiny-a, affinity: {{key: none}}}}
  keyed:
    hosts: [one]
    default_model: tiny-a
    keys: {{editor: {SECRET}}}
""")
        await service.poller.when_first_round_done()
        return base

    async def post(self, url: str, doc: Any) -> tuple[int, Any, str | None]:
        http = http_client(self)
        response = await http.post(url, data=json.dumps(doc).encode(), headers=Headers({b"Content-Type": [b"application/json"]}),
                                   timeout=120)
        text = await treq.content(response)
        host = response.headers.getRawHeaders(b"x-crossbar-host")
        return response.code, json.loads(text) if text else None, host[0].decode() if host else None

    async def get(self, url: str) -> tuple[int, Any]:
        response = await http_client(self).get(url, timeout=60)
        return response.code, json.loads(await treq.content(response))

    def test_native_endpoints_answer_as_they_do_directly(self) -> object:
        async def go() -> None:
            base = await self.crossbar()
            direct = self.s.one.url
            extra = [chunk("src/util.py", "def helper(x):\n    return x * 2\n"),
                     chunk("src/main.py", "import util\nprint(util.helper(3))\n")]
            tokens = (await self.post(direct + "/tokenize", {"content": "hello crossbar"}))[1]["tokens"]
            calls: list[tuple[str, Any]] = [
                ("/infill", vim_infill("def add(a, b):\n", "    return ", "\n\nprint(add(1, 2))\n", extra)),
                ("/infill", vscode_infill("class A:\n", "    def ", "\n", extra)),
                ("/infill", vim_warmup(extra)),
                ("/completion", {"prompt": "The quick brown", "n_predict": 6, "seed": 42, "temperature": 0}),
                ("/completions", {"prompt": "The quick brown", "n_predict": 6, "seed": 42, "temperature": 0}),
                ("/tokenize", {"content": "hello crossbar", "with_pieces": True}),
                ("/detokenize", {"tokens": tokens}),
                ("/embedding", {"content": "hello crossbar"}),
                ("/embeddings", {"content": "hello crossbar"}),
                ("/v1/embeddings", {"input": ["hello crossbar", "bye"], "model": "tiny-a"}),
                ("/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
            ]
            for path, doc in calls:
                d_code, d_doc, _ = await self.post(direct + path, doc)
                c_code, c_doc, host = await self.post(base + "/one" + path, doc)
                self.assertEqual((c_code, host), (d_code, "one"), (path, c_doc))
                self.assertEqual(d_code, 200, (path, d_doc))
                self.assertEqual(stable(c_doc), stable(d_doc), path)
            # the infill answered with text, as an editor needs
            self.assertIn("content", (await self.post(base + "/one/infill", calls[0][1]))[1])
            for route, server in (("one", self.s.one), ("router", self.s.router)):
                target = "/props?model=tiny-a&autoload=false"
                d_code, d_doc = await self.get(server.url + target)
                c_code, c_doc = await self.get(f"{base}/{route}{target}")
                self.assertEqual((c_code, stable(c_doc)), (d_code, stable(d_doc)), route)
            # what changes a host or shows other clients' data: refused (a fake host shows
            # that none sees it: tests/test_model_names.py)
            for method, path in (("GET", "/slots"), ("POST", "/slots/0?action=erase"), ("POST", "/models/load"),
                                 ("GET", "/metrics"), ("POST", "/props")):
                response = await http_client(self).request(method, f"{base}/one{path}", data=b"{}")
                self.assertEqual((response.code, await treq.json_content(response)), (403, {"error": {"code": 403, "message": "forbidden path", "type": "permission_error"}}))
            # Continue posts /completion with no model: the route's default_model, on a router host too
            code, doc, _ = await self.post(base + "/router/completion", {"prompt": "hi", "n_predict": 2, "stream": False})
            self.assertEqual((code, doc.get("model")), (200, "tiny-b"), doc)

        return ensureDeferred(go())

    def test_aliases_reach_a_router_host_as_their_target(self) -> object:
        async def go() -> None:
            base = await self.crossbar()
            for name, target in (("gpt-4o", "tiny-b"), ("claude-sonnet-4-5", "tiny-a"), ("claude-3-haiku", "tiny-a"),
                                 ("tiny-b", "tiny-b")):
                code, doc, host = await self.post(base + "/router/v1/chat/completions", {
                    "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                self.assertEqual((code, host, doc.get("model")), (200, "router", target), (name, doc))
            code, listed = await self.get(base + "/router/v1/models")
            ids = {m["id"]: m for m in listed["data"]}
            self.assertEqual(ids["gpt-4o"]["crossbar"]["alias_of"], "tiny-b")
            self.assertNotIn("claude-*", ids)  # a glob is no model id
            # a GET's model query parameter is an alias too
            d_code, d_doc = await self.get(self.s.router.url + "/props?model=tiny-b&autoload=false")
            c_code, c_doc = await self.get(base + "/router/props?model=gpt-4o&autoload=false")
            self.assertEqual((c_code, stable(c_doc)), (d_code, stable(d_doc)))

        return ensureDeferred(go())

    def test_no_model_on_a_router_host_gets_the_routes_default(self) -> object:
        async def go() -> None:
            base = await self.crossbar()
            code, doc, _ = await self.post(self.s.router.url + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            self.assertEqual(code, 400, doc)  # what the host itself says: the model is missing
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                               ("/infill", vscode_infill("def f(", "", ")\n", [])),
                               ("/completion", {"prompt": "x", "n_predict": 1})):
                code, doc, host = await self.post(base + "/router" + path, body)
                self.assertEqual((code, host), (200, "router"), (path, doc))
                self.assertEqual(doc.get("model"), "tiny-b", path)

        return ensureDeferred(go())

    def test_a_mixed_route_never_answers_400_for_an_unknown_model(self) -> object:
        async def go() -> None:
            base = await self.crossbar()
            answers: Counter[tuple[int, str | None]] = Counter()
            for i in range(12):
                code, _, host = await self.post(base + "/mixed/v1/chat/completions", {
                    "model": "claude-sonnet-4-5", "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"prompt number {i} of twelve"}]})
                answers[(code, host)] += 1
            self.assertEqual(answers, Counter({(200, "one"): 12}))  # the fallback tier: single-model hosts only
            code, doc, host = await self.post(base + "/mixed/v1/chat/completions", {
                "model": "tiny-b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            self.assertEqual((code, host, doc.get("model")), (200, "router", "tiny-b"))

        return ensureDeferred(go())

    def test_anthropic_messages_stream_with_x_api_key_on_a_keyed_route(self) -> object:
        async def go() -> None:
            base = await self.crossbar()

            def stream(key: str) -> tuple[str, str]:
                import anthropic

                client = anthropic.Anthropic(base_url=base + "/keyed", api_key=key, max_retries=0, timeout=60.0)
                with client.messages.stream(model="claude-sonnet-4-5", max_tokens=8,
                                            messages=[{"role": "user", "content": "hi"}]) as s:
                    text = "".join(s.text_stream)
                    final = s.get_final_message()
                return text, final.model

            text, model = await deferToThread(stream, SECRET)
            self.assertTrue(text)
            self.assertEqual(model, "tiny-a")  # the answer says what really served

            def refused() -> int:
                import anthropic

                try:
                    stream("wrong")
                except anthropic.AuthenticationError as e:
                    return e.status_code
                return 200

            self.assertEqual(await deferToThread(refused), 401)

        return ensureDeferred(go())

    async def replay(self, base: str, route: str, run: str, sessions: int) -> tuple[dict[str, list[str]], int, int]:
        """``sessions`` llama.vim sessions (one file each) through ``route``, one after
        the other: the ring's warm-up, keystrokes with a growing prefix, a chunk appended
        to the ring and its warm-up, one more keystroke. Returns each session's hosts in
        order, and over the keystrokes after a session's first two: the prompt tokens
        the hosts read anew (``timings.prompt_n``) and the tokens their slot then held."""
        homes: dict[str, list[str]] = {}
        evaluated = cached = 0
        for n in range(sessions):
            path = f"pkg/{run}_module_{n}.py"
            ring = [chunk(f"pkg/{run}_other_{n}.py", f"def other_{n}(y):  # {run}\n    return y + {n}\n")]
            steps: list[dict[str, Any]] = [vim_warmup(ring)]
            line = f"result_{n} = other_{n}(compute(values))"
            for k in range(8, len(line), 6):  # typing the line, one request per few keystrokes
                steps.append(vim_infill(f"import other_{n}\n\n", line[:k], "\n", ring, n_predict=4))
            ring = [*ring, chunk(path, f"values = [1, 2, 3]\ncompute = sum  # {n}\n")]  # the ring grows
            steps.append(vim_warmup(ring))
            steps.append(vim_infill(f"import other_{n}\n\n", line, "\n", ring, n_predict=4))
            seen = homes[path] = []
            for doc in steps:
                code, answer, host = await self.post(f"{base}/{route}/infill", doc)
                self.assertEqual(code, 200, answer)
                assert host is not None
                seen.append(host)
                if doc["n_predict"] and len(seen) > 2:
                    evaluated += int(answer["timings/prompt_n"])
                    cached += int(answer["tokens_cached"])
        return homes, evaluated, cached

    def test_an_infill_session_sticks_to_one_host(self) -> object:
        """llama.vim sessions replayed through a route of two hosts with affinity on:
        every request of one session lands on one host, whose cache then holds most of
        each next prompt; sessions of other files spread over both hosts. The same
        sessions through a route with ``affinity: {key: none}`` are printed beside."""
        async def go() -> None:
            base = await self.crossbar()
            sessions = 8
            homes, evaluated, cached = await self.replay(base, "fim", "aff", sessions)
            for path, seen in homes.items():
                self.assertEqual(len(set(seen)), 1, (path, seen))
            split = Counter(seen[0] for seen in homes.values())
            p_homes, p_evaluated, p_cached = await self.replay(base, "fimplain", "plain", sessions)
            moved = sum(len(set(seen)) > 1 for seen in p_homes.values())
            print(f"\ninfill, affinity on: sessions per host {dict(split)}, one host each; prompt tokens "
                  f"read anew after a session's first keystroke: {evaluated} of {cached} "
                  f"({evaluated / cached:.0%})\ninfill, affinity off: {moved} of {sessions} sessions on "
                  f"both hosts; read anew: {p_evaluated} of {p_cached} ({p_evaluated / p_cached:.0%})",
                  file=sys.stderr)
            self.assertLess(evaluated / cached, 0.5)  # the host kept the session's prefix
            self.assertEqual(len(split), 2, split)  # sessions of other files do spread

        return ensureDeferred(go())


def anthropic_stream(request: Request, body: bytes) -> Any:
    """A minimal Anthropic ``/v1/messages`` stream (the events the SDK needs)."""
    request.setHeader(b"content-type", b"text/event-stream")
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "fake",
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "hello"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    for name, data in events:
        request.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
    request.finish()
    return NOT_DONE_YET


class ApiKeyHeaderFakeHostTests(TestCase):
    """The host never sees a client's key, whichever header carried it (§Access)."""

    def test_anthropic_stream_key_never_reaches_the_host(self) -> object:
        async def go() -> None:
            fake = FakeLlama(["tiny-a"])
            fake.handlers[b"/v1/messages"] = anthropic_stream
            url = await listen(self, fake)
            service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts: {{h: {url}}}
routes:
  keyed: {{hosts: [h], keys: {{editor: {SECRET}}}}}
""")
            await service.poller.when_first_round_done()

            def stream(api_key: str | None = None, auth_token: str | None = None) -> str:
                import anthropic

                client = anthropic.Anthropic(base_url=base + "/keyed", max_retries=0, timeout=30.0,
                                             api_key=api_key, auth_token=auth_token)
                with client.messages.stream(model="claude-sonnet-4-5", max_tokens=8,
                                            messages=[{"role": "user", "content": "hi"}]) as s:
                    return "".join(s.text_stream)

            self.assertEqual(await deferToThread(stream, api_key=SECRET), "hello")  # X-Api-Key
            self.assertEqual(await deferToThread(stream, auth_token=SECRET), "hello")  # Authorization: Bearer
            seen = upstream_requests(fake)
            self.assertEqual(len(seen), 2)
            for s in seen:
                headers = s.headers
                self.assertFalse(headers.hasHeader(b"x-api-key"))
                self.assertFalse(headers.hasHeader(b"authorization"))
                self.assertTrue(headers.hasHeader(b"anthropic-version"))
                self.assertNotIn(SECRET.encode(), b"".join(v for _, vs in headers.getAllRawHeaders() for v in vs))

        return ensureDeferred(go())
