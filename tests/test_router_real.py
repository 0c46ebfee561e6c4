"""Router mode against a real llama-server (docs/design.md §"The health table", rule 2).

llama-server in router mode lists every model it could load, each with a status; only
``loaded`` ones are resident. Here: a model shows as not loaded, a chat completion
through crossbar makes the server load it, and a later poll shows it loaded.

Skipped when no llama-server can be had (``python tools/llama_server.py provision``),
except under CI (env ``CI=true``), where that is a failure.
"""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.harness import http_client, require_llama_server, start_crossbar
from tools.llama_server import LlamaServer


class RouterModeTests(TestCase):
    timeout = 180

    def setUp(self) -> None:
        require_llama_server(self)
        self.server = LlamaServer("router")
        self.addCleanup(self.server.stop)
        self.server.start(timeout=90)  # blocking, before any reactor work of the test

    def test_model_loads_on_request_and_poll_sees_it(self) -> Deferred[None]:
        async def go() -> None:
            service, base = await start_crossbar(
                self,
                f"""
health: {{interval: 0.2, timeout: 5}}
hosts:
  llama: {self.server.url}
routes:
  r:
    hosts: [llama]
    default_model: tiny-a
""",
            )
            await service.poller.when_first_round_done()
            http = http_client(self)

            status: Any = await treq.json_content(await http.get(base + "/_crossbar/status"))
            host = status["hosts"]["llama"]
            self.assertIs(host["healthy"], True, host)  # up, with nothing resident
            self.assertEqual(host["loaded"], [])
            # the models are listed by the server, just not loaded
            listed: Any = await treq.json_content(await http.get(self.server.url + "/v1/models"))
            self.assertEqual({m["id"]: m["status"]["value"] for m in listed["data"]}["tiny-b"], "unloaded")

            response = await http.post(
                base + "/r/v1/chat/completions",
                json={"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=120,
            )
            body: Any = await treq.json_content(response)
            self.assertEqual(response.code, 200, body)
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"llama"])
            self.assertEqual(body["model"], "tiny-b")

            deadline = reactor.seconds() + 30
            while "tiny-b" not in (service.table.get("llama").loaded):  # type: ignore[union-attr]
                self.assertLess(reactor.seconds(), deadline, "no poll saw tiny-b loaded")
                await deferLater(reactor, 0.1)
            status = await treq.json_content(await http.get(base + "/_crossbar/status"))
            host = status["hosts"]["llama"]
            self.assertIs(host["healthy"], True)
            self.assertEqual(host["loaded"], ["tiny-b"])  # tiny-a is still only listed

        return ensureDeferred(go())
