"""Never crash (docs/design.md §The proxy, rule 9): random requests over raw sockets.

Hypothesis runs in a worker thread, each example a blocking socket exchange with a real
crossbar serving on the reactor thread, so examples shrink as usual. Every request gets
a well-formed HTTP answer (a syntactically invalid one may get a clean close instead),
crossbar keeps serving, no host is marked down by anything a client sends, and no log
event ever holds the secret marker carried in bodies, Authorization values and query
strings.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.defer import ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from crossbar.proxy.request import MAX_BODY
from tests.harness import two_hosts
from tests.logs import LogCapture
from tests.raw import BadResponse, complete, parse_responses, raw_exchange, request_bytes, still_serving

SECRET = b"fuzz-secret-7d2e"
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")

methods = st.one_of(
    st.just(b"POST"),
    st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE"]),
    st.from_regex(rb"\A[A-Z]{1,12}\Z"),
    st.binary(min_size=1, max_size=8).filter(lambda b: not set(b) & set(b" \r\n")),
)
segments = st.one_of(
    st.sampled_from([b"r", b"d", b"nope", b"_crossbar", b"v1", b"..", b".", b"%2e%2e", b"%2E", b"%2F", b"slots",
                     b"health", b"props", b"chat", b"completions", b"models", b"", b"%00", b"%zz", b"\\", b"..%2f"]),
    st.binary(max_size=6).filter(lambda b: not set(b) & set(b"\r\n")),
)
routed = st.builds(  # requests that reach an upstream: most of the examples
    lambda route, segs, query: b"/" + route + b"/v1/" + b"/".join(segs) + query,
    st.sampled_from([b"r", b"r", b"d"]),
    st.lists(st.from_regex(rb"\A[A-Za-z0-9_~%-]{0,8}\Z"), max_size=3),
    st.sampled_from([b"", b"?k=" + SECRET, b"?a=1&b=%2F"]),
)
odd_paths = st.builds(
    lambda lead, segs, query: lead + b"/".join(segs) + query,
    st.sampled_from([b"/", b"/r/", b"/r/v1/", b"//", b"", b"*", b"http://x/r/v1/"]),
    st.lists(segments, max_size=5),
    st.one_of(st.just(b""), st.just(b"?k=" + SECRET), st.binary(max_size=10).map(lambda b: b"?" + b)
              .filter(lambda b: not set(b) & set(b"\r\n"))),
)
paths = st.one_of(routed, routed, odd_paths)
header_names = st.one_of(
    st.sampled_from([b"Connection", b"Keep-Alive", b"TE", b"Upgrade", b"Expect", b"Host", b"X-Forwarded-For",
                     b"Authorization", b"Content-Type", b"Accept-Encoding", b"Trailer", b"Proxy-Connection",
                     b"Cookie", b"X-Foo", b"Range"]),
    st.from_regex(rb"\A[A-Za-z][A-Za-z0-9-]{0,15}\Z"),
    st.binary(min_size=1, max_size=8).filter(lambda b: not set(b) & set(b":\r\n")),
)
header_values = st.one_of(
    st.sampled_from([b"close", b"keep-alive, X-Foo", b"100-continue", b"chunked", b"gzip", b"Bearer " + SECRET,
                     b"application/json", b"Upgrade", b"", b"bytes=0-1", b"trailers"]),
    st.binary(max_size=20).filter(lambda b: not set(b) & set(b"\r\n")),
)
bodies = st.one_of(
    st.binary(max_size=300).map(lambda b: SECRET + b),
    st.binary(min_size=1, max_size=300),
    st.builds(lambda m: b'{"model": ' + m + b', "secret": "' + SECRET + b'"}',
              st.sampled_from([b'"model-a"', b'"model-b"', b"1", b"null", b"{}", b'"\\ud800"', b'"x'])),
)
framings = st.sampled_from(["length", "length", "chunked", "none", "huge"])


@dataclass
class Case:
    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    framing: str

    def valid(self) -> bool:
        """Whether this is syntactically valid HTTP/1.1 (so an answer is owed)."""
        if not _TOKEN.match(self.method) or not self.path or any(c <= 0x20 or c >= 0x7f for c in self.path):
            return False
        return all(_TOKEN.match(n) and all(0x20 <= c < 0x7f or c == 9 for c in v) for n, v in self.headers)

    def wire(self) -> bytes:
        headers = [(n, v) for n, v in self.headers
                   if n.lower() not in (b"content-length", b"transfer-encoding", b"host", b"connection", b"expect")]
        body = b""
        if self.framing == "length":
            headers.append((b"Content-Length", b"%d" % len(self.body)))
            body = self.body
        elif self.framing == "chunked":
            headers.append((b"Transfer-Encoding", b"chunked"))
            body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(self.body), self.body) if self.body else b"0\r\n\r\n"
        elif self.framing == "huge":
            headers.append((b"Content-Length", b"%d" % (MAX_BODY + 1)))
        return request_bytes(self.method, self.path, headers, body)


cases = st.builds(Case, methods, paths, st.lists(st.tuples(header_names, header_values), max_size=6), bodies, framings)


def exchange(port: int, data: bytes, head: bool) -> tuple[bytes, bool]:
    """Blocking: send ``data``, read until crossbar closes or one whole answer is in."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return received, True
            if not chunk:
                return received, True
            received += chunk
            if not head and complete(received):
                return received, False


class FuzzTests(TestCase):
    timeout = 120

    def test_random_requests_never_crash(self) -> object:
        async def go() -> None:
            log = LogCapture(self)
            hosts = await two_hosts(self)
            port = hosts.port
            seen: list[int] = []

            @settings(max_examples=400, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(cases)
            def prop(case: Case) -> None:
                head = case.method == b"HEAD"
                received, closed = exchange(port, case.wire(), head)
                if not received:
                    assert closed and not case.valid(), f"no answer to a valid request {case.wire()[:300]!r}"
                    return
                try:
                    responses = parse_responses(received, head=head, at_eof=closed)
                except BadResponse as e:
                    raise AssertionError(f"bad answer {received[:300]!r} to {case.wire()[:300]!r}: {e}") from None
                final = [r for r in responses if r.status >= 200]
                assert len(final) == 1, (responses, case)
                answer = final[0]
                assert 200 <= answer.status <= 599
                if answer.status >= 400 and answer.one(b"x-crossbar-host") is None and answer.body:
                    # crossbar's own error answers are JSON (rule 9), never a Twisted error page.
                    assert answer.one(b"content-type") == b"application/json", (answer, case)
                seen.append(final[0].status)

            await deferToThread(prop)
            self.assertGreater(len(seen), 50)
            # crossbar still serves, nothing was marked down, nothing secret was logged.
            await still_serving(self, hosts, log)  # also: no crash logged
            self.assertTrue(log.proxied())
            log.assert_never_contains(self, SECRET)

        return ensureDeferred(go())
