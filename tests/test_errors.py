"""crossbar's error answers (docs/design.md §The proxy, rule 9): one shape, one set of
headers, whichever path writes them (issue 29 item 11, issue 30 item 3)."""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from crossbar.errors import error_headers, error_type, json_error_bytes, phrase, raw_error_answer


class ShapeTests(SynchronousTestCase):
    def test_llama_servers_shape(self) -> None:
        self.assertEqual(json.loads(json_error_bytes(404, "unknown route")),
                         {"error": {"code": 404, "message": "unknown route", "type": "invalid_request_error"}})
        self.assertEqual(json.loads(json_error_bytes(502, "upstream failed", host="gpu-a")),
                         {"error": {"code": 502, "message": "upstream failed", "type": "server_error", "host": "gpu-a"}})

    def test_types_follow_the_status(self) -> None:
        expected = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                    429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "unavailable_error",
                    504: "server_error", 431: "invalid_request_error", 507: "server_error"}
        self.assertEqual({code: error_type(code) for code in expected}, expected)


class HeaderTests(SynchronousTestCase):
    def test_every_503_says_when_to_come_back(self) -> None:
        self.assertEqual(error_headers(503), [(b"Retry-After", b"1"), (b"Content-Type", b"application/json")])
        self.assertEqual(error_headers(503, [(b"Retry-After", b"7")]),
                         [(b"Retry-After", b"7"), (b"Content-Type", b"application/json")])
        self.assertEqual(error_headers(404), [(b"Content-Type", b"application/json")])

    def test_raw_answer(self) -> None:
        answer, sent = raw_error_answer(401, "invalid api key", extra=[(b"WWW-Authenticate", b"Bearer")])
        head, body = answer.split(b"\r\n\r\n", 1)
        self.assertEqual(head.split(b"\r\n"), [
            b"HTTP/1.1 401 Unauthorized", b"WWW-Authenticate: Bearer", b"Content-Type: application/json",
            b"Content-Length: %d" % len(body), b"Connection: close"])
        self.assertEqual(json.loads(body)["error"]["type"], "authentication_error")
        self.assertEqual(sent, len(body))

    def test_raw_answer_to_a_head_has_no_body(self) -> None:
        full, _ = raw_error_answer(413, "body too large")
        answer, sent = raw_error_answer(413, "body too large", head_only=True)
        self.assertEqual((answer, sent), (full.split(b"\r\n\r\n")[0] + b"\r\n\r\n", 0))
        self.assertTrue(answer.startswith(b"HTTP/1.1 413 Content Too Large\r\n"))
        self.assertIn(b"Content-Length: %d\r\n" % len(json_error_bytes(413, "body too large")), answer)

    def test_phrases(self) -> None:
        self.assertEqual([phrase(c) for c in (400, 429, 503, 599)],
                         [b"Bad Request", b"Too Many Requests", b"Service Unavailable", b"Error"])
