"""Client keys (crossbar/proxy/access.py, docs/design.md §Access): the one rule of which key a
request's ``Authorization`` (or ``X-Api-Key``) header presents."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from crossbar.proxy import access
from crossbar.proxy.access import authorize
from crossbar.config import ClientKey, parse_config
from crossbar.proxy.headers import upstream_headers

_CONFIG = """\
listen: tcp:1
hosts: {a: http://h}
routes:
  r:
    hosts: [a]
    keys:
      alice: alice-s3cret
      ci: {secret: ci-s3cret-longer-than-alice, max_inflight: 2}
  s:
    hosts: [a]
    keys: {bob: bob-s3cret}
  open: {hosts: [a]}
"""


class AuthorizeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = parse_config(_CONFIG, "x.yaml", environ={})
        self.keys = self.config.routes["r"].keys

    def test_missing(self) -> None:
        self.assertIsNone(authorize(self.keys, None))

    def test_right(self) -> None:
        self.assertEqual(authorize(self.keys, b"Bearer alice-s3cret"), "alice")
        self.assertEqual(authorize(self.keys, b"Bearer ci-s3cret-longer-than-alice"), "ci")

    def test_wrong(self) -> None:
        for value in (b"Bearer alice-s3creT", b"Bearer alice-s3cret2", b"Bearer alice", b"Bearer x", b"Bearer alice-s3cret x"):
            self.assertIsNone(authorize(self.keys, value), value)

    def test_key_of_another_route(self) -> None:
        self.assertIsNone(authorize(self.keys, b"Bearer bob-s3cret"))
        self.assertEqual(authorize(self.config.routes["s"].keys, b"Bearer bob-s3cret"), "bob")

    def test_scheme_in_any_case_and_whitespace(self) -> None:
        for value in (b"bearer alice-s3cret", b"BEARER alice-s3cret", b"BeArEr alice-s3cret",
                      b"  Bearer   alice-s3cret  ", b"Bearer\talice-s3cret"):
            self.assertEqual(authorize(self.keys, value), "alice", value)

    def test_other_schemes(self) -> None:
        for value in (b"Basic alice-s3cret", b"Basic YWxpY2U6YWxpY2UtczNjcmV0", b"Token alice-s3cret", b"alice-s3cret",
                      b"Bearer-alice-s3cret", b"Bearealice-s3cret"):
            self.assertIsNone(authorize(self.keys, value), value)

    def test_empty(self) -> None:
        for value in (b"", b"   ", b"Bearer", b"Bearer ", b"Bearer    "):
            self.assertIsNone(authorize(self.keys, value), value)

    def test_route_without_keys(self) -> None:
        self.assertIsNone(authorize(self.config.routes["open"].keys, b"Bearer alice-s3cret"))

    def test_non_ascii_bytes(self) -> None:
        self.assertIsNone(authorize(self.keys, b"Bearer \xff\xfe"))

    def test_compares_fixed_length_digests_against_every_key(self) -> None:
        """No early exit: one ``compare_digest`` per key, on 32-byte digests, whichever
        key matches (the first, the last, or none)."""
        calls: list[tuple[int, int]] = []
        compare = hmac.compare_digest

        def recording(a: Any, b: Any) -> bool:
            calls.append((len(a), len(b)))
            return compare(a, b)

        self.patch(access.hmac, "compare_digest", recording)
        keys = {f"k{i}": ClientKey(f"k{i}", f"secret-{i}" * (i + 1)) for i in range(5)}
        for value, expected in ((b"Bearer secret-0", "k0"), (b"Bearer " + b"secret-4" * 5, "k4"), (b"Bearer nope", None)):
            calls.clear()
            self.assertEqual(authorize(keys, value), expected)
            self.assertEqual(calls, [(32, 32)] * 5)

    def test_digest_is_sha256_of_the_secret(self) -> None:
        self.assertEqual(self.keys["alice"].digest, hashlib.sha256(b"alice-s3cret").digest())


class ApiKeyHeaderTests(SynchronousTestCase):
    """``X-Api-Key: <secret>`` (what Anthropic-style clients send) presents a key too,
    and on a keyed route neither key header reaches a host (docs/design.md §Access)."""

    def setUp(self) -> None:
        self.config = parse_config(_CONFIG, "x.yaml", environ={})

    def test_x_api_key_presents_a_key(self) -> None:
        route = self.config.routes["r"]
        self.assertEqual(access.check_key(route, b"POST", None, x_api_key=[b"alice-s3cret"]), "alice")
        self.assertEqual(access.check_key(route, b"POST", None, x_api_key=[b" ci-s3cret-longer-than-alice "]), "ci")

    def test_wrong_or_foreign_x_api_key_is_refused(self) -> None:
        route = self.config.routes["r"]
        for secret in (b"", b"nope", b"bob-s3cret", b"Bearer alice-s3cret"):
            self.assertIsNone(access.check_key(route, b"POST", None, x_api_key=[secret]), secret)

    def test_either_header_may_carry_the_valid_key(self) -> None:
        route = self.config.routes["r"]
        self.assertEqual(access.check_key(route, b"POST", [b"Bearer alice-s3cret"], x_api_key=[b"junk"]), "alice")
        self.assertEqual(access.check_key(route, b"POST", [b"Bearer junk"], x_api_key=[b"alice-s3cret"]), "alice")

    def test_repeated_x_api_key_is_refused(self) -> None:
        route = self.config.routes["r"]
        self.assertIsNone(access.check_key(route, b"POST", None, x_api_key=[b"alice-s3cret", b"alice-s3cret"]))

    def test_unkeyed_route_needs_none(self) -> None:
        self.assertEqual(access.check_key(self.config.routes["open"], b"POST", None, x_api_key=[b"x"]), "")

    def test_health_needs_no_key(self) -> None:
        """Issue 29 item 12, rule 2: GET/HEAD /health and /v1/health need no key, as on
        llama-server; a valid key there is still named; anything else still needs one."""
        route = self.config.routes["r"]
        for method in (b"GET", b"HEAD"):
            for rest in (b"/health", b"/v1/health"):
                self.assertEqual(access.check_key(route, method, None, rest=rest), "", (method, rest))
                self.assertEqual(access.check_key(route, method, [b"Bearer nope"], rest=rest), "")
                self.assertEqual(access.check_key(route, method, [b"Bearer alice-s3cret"], rest=rest), "alice")
        for method, rest in ((b"POST", b"/health"), (b"GET", b"/healthz"), (b"GET", b"/health/"), (b"GET", b"/props"),
                             (b"GET", b"/v1/models")):
            self.assertIsNone(access.check_key(route, method, None, rest=rest), (method, rest))

    def test_no_key_header_reaches_a_host_from_a_keyed_route(self) -> None:
        src = Headers({b"Authorization": [b"Bearer alice-s3cret"], b"X-Api-Key": [b"alice-s3cret"],
                       b"anthropic-version": [b"2023-06-01"]})
        keyed = Headers(dict(upstream_headers(src, keyed=True, api_key=None, client=None, secure=False)))
        self.assertFalse(keyed.hasHeader(b"authorization"))
        self.assertFalse(keyed.hasHeader(b"x-api-key"))
        self.assertEqual(keyed.getRawHeaders(b"anthropic-version"), [b"2023-06-01"])
        with_host_key = Headers(dict(upstream_headers(src, keyed=True, api_key="host-secret", client=None, secure=False)))
        self.assertEqual(with_host_key.getRawHeaders(b"authorization"), [b"Bearer host-secret"])
        self.assertFalse(with_host_key.hasHeader(b"x-api-key"))
        unkeyed = Headers(dict(upstream_headers(src, keyed=False, api_key=None, client=None, secure=False)))
        self.assertEqual(unkeyed.getRawHeaders(b"x-api-key"), [b"alice-s3cret"])  # not crossbar's key: passed on
