"""One request head (issue 17; docs/design.md §The proxy, rules 1-4, §Access): parsed once,
the checks on the head and on the whole request in their order, the body and model."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import parse_config
from crossbar.paths import PathKind
from crossbar.proxy.head import Refusal, RequestHead, check_on_head, check_path, wanted_model
from crossbar.proxy.peek import NOTHING, Peeked

_CONFIG = """\
listen: "tcp:0"
hosts:
  a: http://127.0.0.1:9
routes:
  open:
    hosts: [a]
    default_model: tiny
    aliases: {gpt-4o: tiny-a}
  keyed:
    hosts: [a]
    keys:
      alice: {secret: s3cret}
"""


class HeadTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = parse_config(_CONFIG, "test.yaml", environ={})

    def head(self, target: bytes, method: bytes = b"POST") -> RequestHead:
        return RequestHead.parse(self.config, method, target)

    def test_repr_never_shows_the_query_the_config_or_the_body(self) -> None:
        """A head in a traceback or a debug line (rule 8: the query string is never logged)."""
        head = self.head(b"/open/v1/chat/completions?api_key=SECRET").with_body([b'{"prompt": "PRIVATE"}'], NOTHING)
        text = repr(head)
        self.assertIn("/v1/chat/completions", text)
        for hidden in ("SECRET", "PRIVATE", "Config("):
            self.assertNotIn(hidden, text)

    def test_parsed_once(self) -> None:
        head = self.head(b"/open/v1/chat/completions?x=1")
        self.assertEqual((head.route_name, head.rest, head.path, head.query),
                         ("open", b"/v1/chat/completions", b"/open/v1/chat/completions", b"?x=1"))
        self.assertIs(head.route, self.config.routes["open"])
        self.assertEqual(head.route_label, "open")
        self.assertNotIn("x=1", repr(head), "the query string is never shown")

    def test_unknown_and_missing_routes(self) -> None:
        self.assertEqual((self.head(b"/nope/v1/x").route, self.head(b"/nope/v1/x").route_label), (None, "-"))
        missing = self.head(b"//x")
        self.assertEqual((missing.route_name, missing.rest, missing.route_label), (None, b"", "-"))

    def test_check_on_head_order(self) -> None:
        keyed = self.head(b"/keyed/v1/chat/completions")
        good = [b"Bearer s3cret"]
        self.assertEqual(check_on_head(keyed, [b"h"], b"HTTP/1.1", good, True), "alice")
        self.assertEqual(check_on_head(keyed, [], b"HTTP/1.1", good, True), Refusal(400, "bad host header"))
        self.assertEqual(check_on_head(keyed, [b"h", b"h"], b"HTTP/1.1", good, True), Refusal(400, "bad host header"))
        self.assertEqual(check_on_head(keyed, [], b"HTTP/1.0", good, True), "alice")
        self.assertEqual(check_on_head(self.head(b"*", b"OPTIONS"), [b"h"], b"HTTP/1.1", None, False),
                         Refusal(400, "missing route"))
        self.assertEqual(check_on_head(keyed, [b"h"], b"HTTP/1.1", [b"Bearer nope"], True),
                         Refusal(401, "invalid api key", ((b"WWW-Authenticate", b"Bearer"),)))
        self.assertEqual(check_on_head(self.head(b"/keyed/v1/x", b"OPTIONS"), [b"h"], b"HTTP/1.1", None, False), "")
        self.assertEqual(check_on_head(self.head(b"/open/v1/x"), [b"h"], b"HTTP/1.1", None, True), "")

    def test_check_path_order(self) -> None:
        cases = [
            (b"/", b"POST", Refusal(400, "missing route")),
            (b"/nope/v1/../x", b"POST", Refusal(404, "unknown route")),
            (b"/open/v1/%2e%2e/slots", b"POST", Refusal(400, "bad path")),
            (b"/open/slots", b"TRACE", Refusal(405, "method not allowed")),
            (b"/open/slots", b"POST", Refusal(403, "forbidden path")),
            (b"/open/v1/slots", b"GET", Refusal(403, "forbidden path")),
            (b"/open/nowhere", b"POST", Refusal(404, "not found")),
            (b"/open/v1/chat/completions", b"POST", PathKind.FORWARD),
            (b"/open/infill", b"POST", PathKind.FORWARD),
            (b"/open/v1/models", b"GET", PathKind.MODEL_LIST),
            (b"/open/models", b"HEAD", PathKind.MODEL_LIST),
        ]
        for target, method, expected in cases:
            self.assertEqual(check_path(self.head(target, method)), expected, target)

    def test_body_and_model(self) -> None:
        route = self.config.routes["open"]
        head = self.head(b"/open/v1/chat/completions?x=1")
        self.assertEqual((head.body, wanted_model(head, route), head.peeked), ((), ("tiny", b"?x=1"), NOTHING))
        full = head.with_key("k").with_body([b"a", b"b"], Peeked("m", "k:1"))
        self.assertEqual((full.body, wanted_model(full, route), full.key), ([b"a", b"b"], ("m", b"?x=1"), "k"))
        aliased = head.with_body([b"{}"], Peeked("gpt-4o", None))
        self.assertEqual(wanted_model(aliased, route), ("tiny-a", b"?x=1"), "a body's alias: the body is not rewritten")
        props = self.head(b"/open/props?model=gpt-4o&x=1", b"GET")
        self.assertEqual(wanted_model(props, route), ("tiny-a", b"?model=tiny-a&x=1"), "a query's alias is rewritten")
        self.assertEqual(head.body, (), "the head it came from is unchanged")
        get = self.head(b"/open/health", b"GET")
        self.assertIsNone(get.body)
        self.assertEqual(get.with_body([b"x"], NOTHING).body, [b"x"], "a GET's body is forwarded when sent")

    def test_copies_keep_every_other_field(self) -> None:
        head = self.head(b"/keyed/v1/x?q=1").with_body([b"{}"], Peeked("m", "k:1")).with_key("alice")
        other = dataclasses.replace(head.config, routes=MappingProxyType({}))
        for copy, changed in ((head.with_key("bob"), "key"), (head.with_body([b"x"], NOTHING), "peeked chunks"),
                              (head.under(other), "config route")):
            for name in head._fields:
                if name not in changed.split():
                    self.assertEqual(getattr(copy, name), getattr(head, name), name)
        self.assertEqual((head.key, head.peeked, head.chunks), ("alice", Peeked("m", "k:1"), [b"{}"]))
        self.assertEqual((head.under(other).config, head.under(other).route), (other, None))
        self.assertIs(head.under(head.config).route, head.route)
