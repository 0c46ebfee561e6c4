"""JSON log lines (``twistd --logger crossbar.ops.jsonlog.observer``) and the readable
default text log, through a real twistd process."""

from __future__ import annotations

import io
import json

import treq
from twisted.internet.defer import ensureDeferred
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from crossbar.ops.jsonlog import event_as_line, observer_to
from tests.harness import FakeLlama, http_client, listen
from tests.process import start_twistd

REQUEST_FIELDS = {"route", "host", "method", "path", "status", "bytes", "ttfb_ms", "ms"}


class EventTests(TestCase):
    def test_one_line_with_fields_message_and_failure(self) -> None:
        out = io.StringIO()
        log = Logger(namespace="crossbar.proxy", observer=observer_to(out))
        log.info("{method} {target} -> {host} {status}", method="GET", target="/r/v1/models",
                 host="a", status=200, raw=b"\xff", obj=object(), nested={"k": (1, 2)})
        try:
            1 / 0
        except ZeroDivisionError:
            log.failure("boom on {host}", Failure(), host="b")
        lines = out.getvalue().splitlines()
        self.assertEqual(len(lines), 2)
        first, second = (json.loads(line) for line in lines)
        self.assertEqual(first["message"], "GET /r/v1/models -> a 200")
        self.assertEqual(first["level"], "info")
        self.assertEqual(first["namespace"], "crossbar.proxy")
        self.assertRegex(first["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
        self.assertEqual((first["host"], first["status"], first["raw"]), ("a", 200, "\ufffd"))
        self.assertEqual(first["nested"], {"k": [1, 2]})
        self.assertTrue(first["obj"].startswith("<object object"))
        self.assertFalse(any(k.startswith("log_") for k in first))
        self.assertEqual(second["level"], "critical")
        self.assertIn("ZeroDivisionError", second["failure"])

    def test_unformattable_event_still_one_line(self) -> None:
        line = event_as_line({"log_format": "{missing", "log_level": LogLevel.warn, "log_time": 0.0, "x": float("nan")})
        self.assertTrue(line.endswith("\n"))
        self.assertEqual(line.count("\n"), 1)
        doc = json.loads(line)
        self.assertEqual(doc["level"], "warn")


    def test_a_lone_surrogate_does_not_lose_the_line(self) -> None:
        """A host's model id (or any text from outside) with a lone surrogate: the line
        is still written, as valid JSON, to a UTF-8 file."""
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        Logger(namespace="crossbar.health", observer=observer_to(out)).info(
            "host {host} is healthy (models: {models})", host="b", models="\ud800", loaded=["\ud800", "ok"])
        out.flush()
        doc = json.loads(out.buffer.getvalue().decode("utf-8"))  # type: ignore[attr-defined]
        self.assertEqual(doc["loaded"], ["\ud800", "ok"])


class TwistdLogTests(TestCase):
    timeout = 60

    async def _traffic(self, base: str) -> None:
        http = http_client(self)
        response = await http.post(base + "/r/v1/chat/completions?q=1", json={"model": "tiny-a", "messages": []},
                                   headers={"Authorization": "Bearer sk-never-logged"})
        self.assertEqual(response.code, 200)
        await treq.content(response)

    def test_json_lines_through_twistd_logger(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            proc = await start_twistd(self, f"drain: {{delay: 0.2, grace: 1}}\nhosts:\n  a: {url}\nroutes:\n  r:\n    hosts: [a]\n",
                                      logger="crossbar.ops.jsonlog.observer")
            await self._traffic(proc.base)
            await proc.line(lambda line: '"namespace": "crossbar.proxy' in line, 10)
            proc.signal("TERM")
            await proc.ended
            docs = []
            for line in proc.out:
                if line.strip():
                    docs.append(json.loads(line))  # every line is one JSON object
            self.assertTrue(any("twistd" in d["message"] and "starting up" in d["message"] for d in docs))
            (request,) = [d for d in docs if d["namespace"].startswith("crossbar.proxy")]
            self.assertLessEqual(REQUEST_FIELDS, set(request))
            self.assertEqual((request["route"], request["host"], request["method"], request["path"], request["status"]),
                             ("r", "a", "POST", "/v1/chat/completions", 200))
            self.assertGreater(request["bytes"], 0)
            self.assertIsInstance(request["ms"], float)
            self.assertIn("POST /r/v1/chat/completions -> a 200", request["message"])
            self.assertNotIn("sk-never-logged", proc.text())
            self.assertNotIn("Traceback", proc.text())

        return ensureDeferred(go())

    def test_default_text_log_stays_readable(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            proc = await start_twistd(self, f"drain: {{delay: 0.2, grace: 1}}\nhosts:\n  a: {url}\nroutes:\n  r:\n    hosts: [a]\n")
            await self._traffic(proc.base)
            line = await proc.line(lambda line: "[crossbar.proxy#" in line, 10)
            self.assertRegex(line, r"^\d{4}-\d\d-\d\dT\S+ \[crossbar\.proxy\S*#info\] POST /r/v1/chat/completions -> a 200 \d+B ttfb=[\d.]+ms [\d.]+ms \(loaded least-busy affinity=none\)$")
            self.assertFalse(line.lstrip().startswith("{"))
            proc.signal("TERM")
            await proc.ended

        return ensureDeferred(go())
