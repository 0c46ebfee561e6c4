"""The operations endpoints (docs/design.md §Operations): probes, the ops token, and no
version header. In-process crossbar on real loopback sockets; one real twistd check."""

from __future__ import annotations

import treq
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET

from tests.harness import FakeLlama, http_client, listen, start_crossbar
from tests.process import start_twistd

TOKEN = "s3cret-token-value"


def _config(url: str, token: bool = False, extra_host: str | None = None) -> str:
    hosts = f"  gpu-a: {url}\n" + (f"  gpu-b: {extra_host}\n" if extra_host else "")
    return (
        "health: {interval: 0.2, timeout: 1}\n"
        + (f"ops: {{token: {TOKEN}}}\n" if token else "")
        + "hosts:\n" + hosts
        + "routes:\n  r:\n    hosts: [gpu-a]\n"
    )


class ProbeTests(TestCase):
    def test_readiness_follows_first_round_health_and_drain(self) -> object:
        async def go() -> None:
            upstream = FakeLlama(models=["secret-model"])
            gate: Deferred[None] = Deferred()

            def held(request: object, body: bytes) -> object:
                def finish(_: object) -> None:
                    request.write(b"{}")  # type: ignore[attr-defined]
                    request.finish()  # type: ignore[attr-defined]

                gate.addCallback(finish)
                return NOT_DONE_YET

            upstream.handlers[b"/health"] = held
            url = await listen(self, upstream)
            service, base = await start_crossbar(self, _config(url))
            http = http_client(self)

            async def get(path: str) -> tuple[int, bytes, object]:
                response = await http.get(base + path)
                return response.code, await treq.content(response), response.headers

            # First poll not finished: not ready, but alive.
            self.assertEqual((await get("/_crossbar/readyz"))[:2], (503, b'{"status": "not ready"}'))
            self.assertEqual((await get("/_crossbar/healthz"))[0], 503)
            self.assertEqual((await get("/_crossbar/livez"))[:2], (200, b'{"status": "ok"}'))
            del upstream.handlers[b"/health"]
            gate.callback(None)
            await service.poller.when_first_round_done()
            code, body, headers = await get("/_crossbar/readyz")
            self.assertEqual((code, body), (200, b'{"status": "ready"}'))
            self.assertEqual((await get("/_crossbar/healthz"))[:2], (200, b'{"status": "ready"}'))
            for leak in (b"gpu-a", b"secret-model", b"127.0.0.1", b"Twisted", b"crossbar"):
                self.assertNotIn(leak, body)
            self.assertIsNone(headers.getRawHeaders(b"server"))  # type: ignore[attr-defined]
            # HEAD works for load balancers that probe with it.
            head = await http.head(base + "/_crossbar/readyz")
            self.assertEqual(head.code, 200)

            # No healthy host: not ready.
            service.table.mark_down("gpu-a", "test")
            self.assertEqual((await get("/_crossbar/readyz"))[0], 503)
            service.table.record_success("gpu-a", ["m"])
            service.table.record_success("gpu-a", ["m"])
            self.assertEqual((await get("/_crossbar/readyz"))[0], 200)
            # Draining: not ready, still alive.
            service.runtime.draining = True
            self.assertEqual((await get("/_crossbar/readyz"))[0], 503)
            self.assertEqual((await get("/_crossbar/livez"))[0], 200)
            service.runtime.draining = False

        return ensureDeferred(go())

    def test_no_server_version_header_anywhere(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            service, base = await start_crossbar(self, _config(url))
            await service.poller.when_first_round_done()
            http = http_client(self)
            for method, path in (("GET", "/_crossbar/livez"), ("GET", "/_crossbar/readyz"),
                                 ("GET", "/_crossbar/status"), ("GET", "/_crossbar/metrics"),
                                 ("GET", "/_crossbar/nope"), ("POST", "/_crossbar/livez"),
                                 ("GET", "/"), ("GET", "/unknown/v1/models"), ("GET", "/r/v2/x")):
                response = await http.request(method, base + path)
                await treq.content(response)
                self.assertIsNone(response.headers.getRawHeaders(b"server"), (method, path))

        return ensureDeferred(go())


class TokenTests(TestCase):
    def test_status_and_metrics_need_the_token_probes_do_not(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            service, base = await start_crossbar(self, _config(url, token=True))
            await service.poller.when_first_round_done()
            http = http_client(self)
            for path in ("/_crossbar/status", "/_crossbar/metrics"):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
                    response = await http.get(base + path, headers=headers)
                    self.assertEqual(response.code, 401, (path, headers))
                    self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
                    self.assertEqual(await treq.json_content(response), {"error": {"code": 401, "message": "unauthorized", "type": "authentication_error"}})
                for good in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}"):  # RFC 9110 §11.1
                    response = await http.get(base + path, headers={"Authorization": good})
                    self.assertEqual(response.code, 200, (path, good))
                    await treq.content(response)
            for path in ("/_crossbar/livez", "/_crossbar/readyz", "/_crossbar/healthz"):
                response = await http.get(base + path)
                self.assertEqual(response.code, 200, path)
                await treq.content(response)

        return ensureDeferred(go())

    def test_compare_is_constant_time(self) -> None:
        import inspect

        from crossbar.ops import app as ops

        self.assertIn("hmac.compare_digest", inspect.getsource(ops.OpsApp._authorized))


class TwistdOpsTests(TestCase):
    timeout = 60

    def test_probes_and_token_through_twistd(self) -> object:
        async def go() -> None:
            url = await listen(self, FakeLlama())
            proc = await start_twistd(self, _config(url, token=True))  # waits for readyz 200
            http = http_client(self)
            live = await http.get(proc.base + "/_crossbar/livez")
            self.assertEqual((live.code, await treq.content(live)), (200, b'{"status": "ok"}'))
            self.assertIsNone(live.headers.getRawHeaders(b"server"))
            denied = await http.get(proc.base + "/_crossbar/status")
            self.assertEqual(denied.code, 401)
            await treq.content(denied)
            allowed = await http.get(proc.base + "/_crossbar/status", headers={"Authorization": f"Bearer {TOKEN}"})
            self.assertTrue((await treq.json_content(allowed))["hosts"]["gpu-a"]["healthy"])
            proc.signal("TERM")
            await proc.ended

        return ensureDeferred(go())
