"""No secret leaks (docs/design.md §Access): one scenario exercising every secret of the
config — client keys (one with ``max_inflight``), a host ``api_key``, the ops token, a
mutual-TLS client key file, a client's wrong key — through 200s, 401s, a 429, failed
hosts (a dead one with an ``api_key``, a TLS host that refuses the handshake) and a
reload that rotates a key. Then every log event (text and JSON lines), the status and
metrics documents, every error answer (head and body) and the headers of every
upstream request that must not carry a secret are scanned for each secret."""

from __future__ import annotations

import os
from typing import Any

import trustme
from twisted.internet.defer import ensureDeferred
from twisted.logger import formatEvent
from twisted.trial.unittest import TestCase

from crossbar.ops.jsonlog import event_as_line
from tests.accesskit import auth_headers, serve_tls, start_file, write_pem
from tests.harness import FakeLlama, http_client, listen, upstream_requests, wait_for
from tests.logs import LogCapture
from tests.test_access_keys import Held
from tests.upstreams import Die

ENV = {
    "T_SCAN_ALICE": "scan-alice-Qw3e-secret",
    "T_SCAN_CI": "scan-ci-Er4t-secret",
    "T_SCAN_HOST": "scan-host-Ty5u-secret",
    "T_SCAN_DEAD": "scan-dead-Ui6o-secret",
    "T_SCAN_OPS": "scan-ops-Op7p-secret",
    "T_SCAN_ROTATED": "scan-rotated-As8d-secret",
}
WRONG = "scan-wrong-Df9g-secret"
CHAT = b'{"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]}'

_CONFIG = """\
health: {{interval: 60, timeout: 2}}
ops: {{token: ${{T_SCAN_OPS}}}}
hosts:
  a: {{url: {a}, max_inflight: 1}}
  k: {{url: {k}, api_key: ${{T_SCAN_HOST}}}}
  dead: {{url: {dead}, api_key: ${{T_SCAN_DEAD}}}}
  t: {{url: '{t}', tls: {{client_cert: {cert}, client_key: {key}}}}}
routes:
  r:
    hosts: [a]
    queue: {{max: 5, timeout: 10}}
    keys:
      alice: ${{T_SCAN_ALICE}}
      ci: {{secret: ${{T_SCAN_CI}}, max_inflight: 1}}
  u:
    hosts: [dead, k]
    primary: dead
    keys: {{alice2: ${{T_SCAN_ROTATED}}}}
  v:
    hosts: [t, k]
    primary: t
    keys: {{alice2: ${{T_SCAN_ROTATED}}}}
"""


def _bearer(secret: str) -> dict[bytes, list[bytes]]:
    return {b"Authorization": [b"Bearer " + secret.encode()], b"Content-Type": [b"application/json"]}


class SecretScanTests(TestCase):
    timeout = 60

    async def test_no_secret_anywhere(self) -> None:
        log = LogCapture(self)
        a, k, dead = FakeLlama(), FakeLlama(), FakeLlama()
        dead.health_code = 200
        a_url, k_url, dead_url = [await listen(self, h) for h in (a, k, dead)]
        ca = trustme.CA()
        leaf = ca.issue_cert("localhost")
        client = trustme.CA().issue_cert("crossbar")
        cert = write_pem(self, "client.pem", client.cert_chain_pems[0].bytes())
        key = write_pem(self, "client.key", client.private_key_pem.bytes())
        key_body = [line for line in client.private_key_pem.bytes().decode().splitlines() if "-----" not in line]
        tls_port = await serve_tls(self, FakeLlama(), leaf)  # a CA crossbar does not know: refused
        text = _CONFIG.format(a=a_url, k=k_url, dead=dead_url, t=f"https://localhost:{tls_port}", cert=cert, key=key)
        service, base, path = await start_file(self, text, ENV)
        await service.poller.when_first_round_done()
        http = http_client(self)
        answers: list[str] = []

        async def call(method: str, url: str, headers: Any = None, data: bytes | None = None) -> int:
            response = await http.request(method, base + url, headers=headers, data=data)
            body = await response.content()
            if response.code >= 400 or url.startswith("/_crossbar"):
                answers.append(repr(list(response.headers.getAllRawHeaders())) + body.decode("latin-1"))
            return response.code  # type: ignore[no-any-return]

        chat = "/r/v1/chat/completions"
        self.assertEqual(await call("POST", chat, _bearer(ENV["T_SCAN_ALICE"]), CHAT), 200)
        self.assertEqual(await call("POST", chat, _bearer(WRONG), CHAT), 401)
        self.assertEqual(await call("POST", chat + "?api_key=" + ENV["T_SCAN_ALICE"], None, CHAT), 401)
        self.assertEqual(await call("POST", "/u/v1/chat/completions", _bearer(ENV["T_SCAN_ALICE"]), CHAT), 401)
        # 429: ci holds a's only slot.
        a.handlers[b"/v1/chat/completions"] = held = Held()
        first = ensureDeferred(call("POST", chat, _bearer(ENV["T_SCAN_CI"]), CHAT))
        await wait_for(lambda: held.requests, what="ci at the host")
        self.assertEqual(await call("POST", chat, _bearer(ENV["T_SCAN_CI"]), CHAT), 429)
        held.release()
        self.assertEqual(await first, 200)
        del a.handlers[b"/v1/chat/completions"]
        # Failures: dead (api_key) dies once it has the request (502: a POST already
        # sent is not retried), t refuses the handshake (fail over to k: 200).
        dead.handlers[b"/v1/chat/completions"] = Die(delay=0)
        service.table.record_success("t", ["tiny-a"])
        service.table.record_success("t", ["tiny-a"])
        self.assertEqual(await call("POST", "/u/v1/chat/completions", _bearer(ENV["T_SCAN_ROTATED"]), CHAT), 502)
        self.assertEqual(await call("POST", "/v/v1/chat/completions", _bearer(ENV["T_SCAN_ROTATED"]), CHAT), 200)
        self.assertFalse(service.table.is_healthy("dead"))
        self.assertFalse(service.table.is_healthy("t"))
        # Reload rotating u's key and the host key; the old key is refused.
        with open(path, encoding="utf-8") as f:
            text = f.read()
        os.environ["T_SCAN_HOST2"] = "scan-host2-Gh0j-secret"
        self.addCleanup(os.environ.pop, "T_SCAN_HOST2", None)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace("alice2: ${T_SCAN_ROTATED}", "alice3: ${T_SCAN_ALICE}x").replace("${T_SCAN_HOST}", "${T_SCAN_HOST2}"))
        self.assertTrue(service.reload())
        self.assertEqual(await call("POST", "/u/v1/chat/completions", _bearer(ENV["T_SCAN_ROTATED"]), CHAT), 401)
        # A bad reload (one secret under two names) is refused and logged: by key path, not value.
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace("alice: ${T_SCAN_ALICE}", "alice: ${T_SCAN_ALICE}\n      ci2: ${T_SCAN_CI}"))
        self.assertFalse(service.reload())
        ops = {b"Authorization": [b"Bearer " + ENV["T_SCAN_OPS"].encode()]}
        self.assertEqual(await call("GET", "/_crossbar/status", ops), 200)
        self.assertEqual(await call("GET", "/_crossbar/metrics", ops), 200)
        self.assertEqual(await call("GET", "/_crossbar/status", _bearer(WRONG)), 401)

        # The scan.
        secrets = [*ENV.values(), "scan-host2-Gh0j-secret", WRONG, *key_body]
        texts = [formatEvent(e) or "" for e in log.events] + [event_as_line(e) for e in log.events]
        self.assertTrue(any("reload refused" in t for t in texts), "the bad reload was not logged")
        self.assertTrue(any("unknown CA" in t for t in texts), "the TLS failure was not logged")
        self.assertTrue(any("key=alice" in t for t in texts), "the key name is not logged")
        self.assertTrue(any("crossbar_requests_total" in a for a in answers), "no metrics scanned")
        self.assertTrue(any('"last_err"' in a and "unknown CA" in a for a in answers), "no status scanned")
        self.assertGreaterEqual(sum(a.count("invalid api key") for a in answers), 4)
        everything = "\n".join(texts + answers)
        for secret in secrets:
            self.assertNotIn(secret, everything)
            log.assert_never_contains(self, secret.encode())
        # Upstream requests: a (no api_key) never gets a client key; k only its own key.
        for seen in a.seen:
            self.assertEqual(auth_headers(seen), [], seen.uri)
        for seen in k.seen + dead.seen:
            for value in auth_headers(seen):
                self.assertIn(value.decode().removeprefix("Bearer "),
                              ("scan-host-Ty5u-secret", "scan-host2-Gh0j-secret", "scan-dead-Ui6o-secret"))
        self.assertIn([b"Bearer scan-dead-Ui6o-secret"], [auth_headers(s) for s in dead.seen])
        self.assertNotIn([b"Bearer scan-host-Ty5u-secret"], [auth_headers(s) for s in dead.seen])
        self.assertNotIn([b"Bearer scan-dead-Ui6o-secret"], [auth_headers(s) for s in k.seen])
        self.assertEqual(len(upstream_requests(k)), 1)
