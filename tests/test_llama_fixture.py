"""The real llama-server fixture (tools/llama_server.py) works.

Skipped when no llama-server is provisioned (`python tools/llama_server.py provision`),
except under CI (env CI=true), where a missing llama-server is a failure: CI must run
the real-server tests.  The calls here are blocking on purpose (a few short HTTP
requests to a local process); no reactor work is involved.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial import unittest

from tests.harness import require_llama_server
from tools.llama_server import LlamaServer

FIXTURES = Path(__file__).parent / "fixtures"


def _get(url: str, timeout: float = 10.0) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


def _post(url: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


def _statuses(models: Any) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in models["data"]}


class LlamaServerFixtureTests(unittest.TestCase):
    def setUp(self) -> None:
        require_llama_server(self)

    def test_single_mode(self) -> None:
        server = LlamaServer("single")
        self.addCleanup(server.stop)
        server.start(timeout=60)
        self.assertTrue(server.url.startswith("http://127.0.0.1:"))

        status, body = _get(server.url + "/health")
        self.assertEqual(status, 200)
        self.assertEqual(body, {"status": "ok"})

        status, models = _get(server.url + "/v1/models")
        self.assertEqual(status, 200)
        self.assertEqual([m["id"] for m in models["data"]], ["tiny-a"])
        # single-model mode: entries carry no "status" (crossbar counts them as loaded)
        self.assertNotIn("status", models["data"][0])

        proc = server.proc
        assert proc is not None
        server.stop()
        self.assertIsNotNone(proc.poll(), "llama-server still running after stop()")
        server.stop()  # idempotent

    def test_router_mode_loads_on_demand(self) -> None:
        server = LlamaServer("router")
        self.addCleanup(server.stop)
        server.start(timeout=60)

        status, models = _get(server.url + "/v1/models")
        self.assertEqual(status, 200)
        self.assertEqual(_statuses(models), {"tiny-a": "unloaded", "tiny-b": "unloaded"})

        status, reply = _post(
            server.url + "/v1/chat/completions",
            {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        )
        self.assertEqual(status, 200)
        self.assertEqual(reply["model"], "tiny-b")
        # the tiny models practically never emit EOS: generation runs to max_tokens
        self.assertEqual(reply["choices"][0]["finish_reason"], "length")

        status, models = _get(server.url + "/v1/models")
        self.assertEqual(_statuses(models), {"tiny-a": "unloaded", "tiny-b": "loaded"})


class RecordedShapesTests(unittest.TestCase):
    """The recorded /v1/models samples other tests rely on keep their real shape."""

    def test_single(self) -> None:
        data = json.loads((FIXTURES / "llama_models_single.json").read_text())["data"]
        self.assertEqual([m["id"] for m in data], ["tiny-a"])
        self.assertNotIn("status", data[0])

    def test_router(self) -> None:
        models = json.loads((FIXTURES / "llama_models_router.json").read_text())
        self.assertEqual(_statuses(models), {"tiny-a": "unloaded", "tiny-b": "loaded"})
        unloaded = json.loads((FIXTURES / "llama_models_router_unloaded.json").read_text())
        self.assertEqual(set(_statuses(unloaded).values()), {"unloaded"})
        loading = json.loads((FIXTURES / "llama_models_router_loading.json").read_text())
        self.assertEqual(_statuses(loading)["tiny-b"], "loading")
