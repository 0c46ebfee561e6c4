"""The real ``openai`` Python client through crossbar to a real llama-server.

A llama-server in single mode (tools/llama_server.py) behind an in-process crossbar;
the blocking ``openai`` client runs in a thread (``deferToThread``) so the reactor
keeps serving. Skipped when no llama-server can be had, except under CI (env
``CI=true``), where that is a failure.
"""

from __future__ import annotations

import time
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.trial import unittest

from tests.harness import require_llama_server, start_routes, wait_for
from tests.upstreams import host_status
from tools.llama_server import LlamaServer

_MESSAGES = [{"role": "user", "content": "Say hello."}]


def _client(base: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base + "/r/v1", api_key="not-checked", max_retries=0, timeout=60.0)


def _stream(base: str) -> tuple[str | None, list[tuple[float, str]], str | None]:
    """A streamed chat completion: (X-Crossbar-Host, [(arrival, token)], finish_reason)."""
    client = _client(base)
    try:
        with client.chat.completions.with_streaming_response.create(
            model="tiny-a", messages=_MESSAGES, stream=True, max_tokens=24  # type: ignore[arg-type]
        ) as response:
            host = response.headers.get("x-crossbar-host")
            tokens: list[tuple[float, str]] = []
            finish = None
            for chunk in response.parse():
                for choice in chunk.choices:
                    if choice.delta.content:
                        tokens.append((time.monotonic(), choice.delta.content))
                    if choice.finish_reason:
                        finish = choice.finish_reason
            return host, tokens, finish
    finally:
        client.close()


def _complete(base: str) -> tuple[str | None, Any]:
    """A non-streamed chat completion: (X-Crossbar-Host, the parsed ChatCompletion)."""
    client = _client(base)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-a", messages=_MESSAGES, max_tokens=8  # type: ignore[arg-type]
        )
        return raw.headers.get("x-crossbar-host"), raw.parse()
    finally:
        client.close()


class OpenAIClientTests(unittest.TestCase):
    timeout = 180

    def setUp(self) -> None:
        require_llama_server(self)

    def test_openai_client_through_crossbar(self) -> object:
        """Streaming: tokens arrive and ``X-Crossbar-Host`` names the host; a plain
        completion works too; nothing is left in flight and nothing marked down."""

        async def go() -> None:
            server = LlamaServer("single")
            self.addCleanup(server.stop)
            await deferToThread(server.start, 60)
            service, base = await start_routes(self, {"gpu": server.url})
            await wait_for(lambda: service.table.is_healthy("gpu"), timeout=10)

            host, tokens, finish = await deferToThread(_stream, base)
            self.assertEqual(host, "gpu")
            self.assertGreater(len(tokens), 1, "no tokens streamed")
            self.assertTrue("".join(t for _, t in tokens).strip())
            self.assertIn(finish, ("length", "stop"))

            host, completion = await deferToThread(_complete, base)
            self.assertEqual(host, "gpu")
            self.assertEqual(completion.object, "chat.completion")
            self.assertTrue(completion.choices[0].message.content)

            status = (await host_status(self, base))["gpu"]
            self.assertTrue(status["healthy"])
            self.assertEqual(status["last_err"], "")
            self.assertEqual(status["inflight"], 0)

        return ensureDeferred(go())
