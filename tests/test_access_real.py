"""Keys with the real ``openai`` client and a real llama-server (docs/design.md §Access).

- The client's ``api_key=`` is crossbar's key of a keyed route; it streams through.
- A llama-server started with ``--api-key`` behind a host with ``api_key: ${...}``:
  the client knows only crossbar's key, polls and requests succeed (the server refuses
  anything without its own key, so success proves crossbar sent it).

Skipped when no llama-server can be had, except under CI (``CI=true``): a failure.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from twisted.internet.threads import deferToThread
from twisted.trial import unittest

from tests.accesskit import start_file
from tests.harness import require_llama_server, wait_for
from tests.logs import LogCapture
from tools.llama_server import LlamaServer

CLIENT_KEY = "crossbar-client-Rr5t8-secret"
SERVER_KEY = "llama-server-Vv2n6-secret"


def _stream(base: str, route: str, api_key: str) -> tuple[list[str], str | None]:
    """A streamed chat completion with the ``openai`` client: (tokens, finish_reason)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/{route}/v1", api_key=api_key, max_retries=0, timeout=60.0)
    try:
        tokens: list[str] = []
        finish = None
        for chunk in client.chat.completions.create(
            model="tiny-a", messages=[{"role": "user", "content": "Say hello."}], stream=True, max_tokens=16,
        ):
            for choice in chunk.choices:
                if choice.delta.content:
                    tokens.append(choice.delta.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
        return tokens, finish
    finally:
        client.close()


def _refused(base: str, route: str, api_key: str) -> Any:
    """The ``openai`` client's exception for a request with ``api_key``."""
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=f"{base}/{route}/v1", api_key=api_key, max_retries=0, timeout=30.0)
    try:
        client.models.list()
    except AuthenticationError as e:
        return e
    finally:
        client.close()
    raise AssertionError("not refused")


def _direct_error(url: str, key: str) -> Any:
    """The llama-server's own error document for ``GET /v1/models`` with ``key``."""
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as e:
        return json.loads(e.read())
    raise AssertionError("not refused")


def _direct_status(url: str, key: str) -> int:
    """The llama-server's own answer to a one-token chat completion with ``key``."""
    body = json.dumps({"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


class RealKeysTests(unittest.TestCase):
    timeout = 180

    def setUp(self) -> None:
        require_llama_server(self)

    async def start(self, extra: list[str], host: str) -> tuple[LlamaServer, Any, str]:
        server = LlamaServer("single", extra_args=extra)
        self.addCleanup(server.stop)
        await deferToThread(server.start, 60)
        config = (
            "health: {interval: 0.5, timeout: 5}\n"
            f"hosts:\n  gpu: {host.format(url=server.url)}\n"
            "routes:\n  r:\n    hosts: [gpu]\n    keys: {alice: ${T_REAL_CLIENT_KEY}}\n"
        )
        service, base, _ = await start_file(
            self, config, {"T_REAL_CLIENT_KEY": CLIENT_KEY, "T_REAL_SERVER_KEY": SERVER_KEY}
        )
        await wait_for(lambda: service.table.is_healthy("gpu"), timeout=15, what="gpu healthy")
        return server, service, base

    async def test_openai_client_streams_through_a_keyed_route(self) -> None:
        log = LogCapture(self)
        _, service, base = await self.start([], "{url}")
        tokens, finish = await deferToThread(_stream, base, "r", CLIENT_KEY)
        self.assertGreater(len(tokens), 1, "no tokens streamed")
        self.assertIn(finish, ("length", "stop"))
        error = await deferToThread(_refused, base, "r", CLIENT_KEY + "x")
        self.assertEqual(error.status_code, 401)
        self.assertEqual([(e["status"], e["key"]) for e in log.proxied()][-2:], [(200, "alice"), (401, "")])
        log.assert_never_contains(self, CLIENT_KEY.encode())

    async def test_llama_server_with_its_own_api_key(self) -> None:
        log = LogCapture(self)
        server, service, base = await self.start(["--api-key", SERVER_KEY], "{{url: {url}, api_key: ${{T_REAL_SERVER_KEY}}}}")
        # The server really checks its key: the client's crossbar key alone is refused there.
        self.assertEqual(await deferToThread(_direct_status, server.url, CLIENT_KEY), 401)
        self.assertEqual(await deferToThread(_direct_status, server.url, SERVER_KEY), 200)
        # Issue 29 item 11, rule 9: crossbar's 401 has the host's own shape, read alike by
        # the openai client (error.message, error.type).
        theirs = (await deferToThread(_direct_error, server.url, CLIENT_KEY))["error"]
        refused = await deferToThread(_refused, base, "r", CLIENT_KEY + "x")
        self.assertEqual((refused.status_code, refused.body["code"], refused.body["type"]),
                         (401, theirs["code"], theirs["type"]))
        self.assertEqual(set(refused.body), set(theirs))
        self.assertEqual(refused.body["message"], "invalid api key")
        # Polls succeed: several more rounds keep the host healthy, its model listed.
        await wait_for(lambda: (s := service.table.get("gpu")) is not None and s.consecutive >= 3, 10,
                       "two more poll rounds")  # (interval 0.5 s; later on a loaded machine)
        self.assertTrue(service.table.is_healthy("gpu"))
        status = service.table.get("gpu")
        assert status is not None
        self.assertEqual(status.last_err, "")
        self.assertIn("tiny-a", status.loaded)
        self.assertGreaterEqual(status.consecutive, 3)
        tokens, finish = await deferToThread(_stream, base, "r", CLIENT_KEY)
        self.assertGreater(len(tokens), 1, "no tokens streamed")
        self.assertIn(finish, ("length", "stop"))
        for secret in (CLIENT_KEY, SERVER_KEY):
            log.assert_never_contains(self, secret.encode())
