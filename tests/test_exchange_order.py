"""Issue 17: a request's record is written before its freed host slot dispatches a
waiting request (docs/design.md §The proxy, rule 8; §Choosing a host, rule 4), so its
duration never includes another request's dispatch.

Unit level, on a :class:`~twisted.internet.task.Clock`, with the real exchange, queue,
in-flight counts and Twisted's HTTP/1.1 client over the connect-delayed fake endpoint of
tests/test_ttfb.py: host ``a`` takes one request at a time; a second request waits; the
first one's answer ends.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyChannel

from crossbar.config import parse_config
from crossbar.ops.record import RequestRecord
from crossbar.proxy.head import RequestHead
from crossbar.proxy.peek import peek
from crossbar.proxy.resource import ProxyResource
from crossbar.proxy.web import CrossbarRequest
from crossbar.state.runtime import Runtime
from tests.test_ttfb import BODY, CONNECT_DELAY, HEAD, RecordingLog, SlowPools

_CONFIG = """\
listen: "tcp:0"
hosts:
  a: {url: "http://127.0.0.1:9", max_inflight: 1}
routes:
  r:
    hosts: [a]
    queue: {max: 5, timeout: 30}
"""


class OrderingLog(RecordingLog):
    """Also notes, for each record, how many requests still waited when it was written."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self.runtime = runtime
        self.waiting_at_write: list[int] = []

    def write(self, record: RequestRecord) -> None:
        self.waiting_at_write.append(self.runtime.queues.queued("r"))
        super().write(record)


class RecordBeforeDispatchTests(SynchronousTestCase):
    def test_record_written_before_the_freed_slot_dispatches(self) -> None:
        clock = Clock()
        config = parse_config(_CONFIG, "test.yaml")
        runtime = Runtime(config, clock.seconds)
        runtime.table.record_success("a", ["tiny-a"])
        pools = SlowPools(clock)
        log = OrderingLog(runtime)
        proxy = ProxyResource(runtime, pools, clock, log)  # type: ignore[arg-type]

        def send() -> CrossbarRequest:
            request = CrossbarRequest(DummyChannel())
            request.method = b"POST"
            request.uri = request.path = b"/r/v1/chat/completions"
            request.clientproto = b"HTTP/1.1"
            request.head = RequestHead.parse(config, request.method, request.uri).with_body([BODY], peek(BODY))
            proxy.render(request)
            return request

        send()
        send()
        self.assertEqual(runtime.queues.queued("r"), 1, "the second request waits: host a has no room")
        clock.advance(CONNECT_DELAY)
        [(protocol, _)] = pools.endpoints.protocols
        protocol.dataReceived(HEAD)  # the first answer ends: its slot frees
        [first] = log.records
        self.assertEqual((first.status, first.host), (200, "a"))
        self.assertEqual(log.waiting_at_write, [1], "the record was written after the waiting request left")
        self.assertEqual(runtime.queues.queued("r"), 0, "the freed slot then dispatched the waiting request")
        self.assertEqual(runtime.inflight.host("a"), 1)
