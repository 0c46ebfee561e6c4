"""The upstream request body is written in slices (crossbar.proxy.attempt.BytesProducer), so
no reactor turn copies a whole 15 MiB image request (issue 11 item 3, bench (h))."""

from __future__ import annotations

import base64
import json
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase, TestCase

from crossbar.proxy.attempt import BytesProducer
from tests.harness import two_hosts, upstream_requests
from tests.raw import parse_responses, raw_exchange, request_bytes


class PausingConsumer:
    """A consumer that, like a TCP transport over its buffer size, pauses its producer
    on every write; ``drain()`` empties the buffer and resumes it."""

    def __init__(self, producer: BytesProducer) -> None:
        self.producer = producer
        self.writes: list[bytes] = []
        self.buffered = 0

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.buffered += len(data)
        self.producer.pauseProducing()

    def drain(self) -> None:
        self.buffered = 0
        self.producer.resumeProducing()


class BytesProducerTests(SynchronousTestCase):
    def test_small_body_written_at_once(self) -> None:
        producer = BytesProducer(b'{"a": 1}')
        consumer = StringTransport()
        self.successResultOf(producer.startProducing(consumer))
        self.assertEqual(consumer.value(), b'{"a": 1}')
        self.assertEqual(producer.length, 8)

    def test_large_body_one_slice_per_resume(self) -> None:
        body = bytes(range(256)) * (3 * BytesProducer.SLICE // 256) + b"tail"
        producer = BytesProducer(body)
        consumer = PausingConsumer(producer)
        done = producer.startProducing(consumer)
        self.assertEqual(len(consumer.writes), 1)
        self.assertNoResult(done)
        resumes = 0
        while not done.called:
            consumer.drain()
            resumes += 1
            self.assertLessEqual(resumes, 10)
        self.assertEqual(resumes, 3)
        self.assertEqual(b"".join(consumer.writes), body)
        self.assertEqual([len(w) for w in consumer.writes], [BytesProducer.SLICE] * 3 + [4])
        self.assertIsNone(self.successResultOf(done))

    def test_not_paused_writes_every_slice_now(self) -> None:
        body = b"x" * (2 * BytesProducer.SLICE + 1)
        consumer = StringTransport()
        done = BytesProducer(body).startProducing(consumer)
        self.successResultOf(done)
        self.assertEqual(consumer.value(), body)

    def test_stopped_never_writes_again_nor_fires(self) -> None:
        producer = BytesProducer(b"y" * (4 * BytesProducer.SLICE))
        consumer = PausingConsumer(producer)
        done = producer.startProducing(consumer)
        producer.stopProducing()
        consumer.drain()
        self.assertEqual(len(consumer.writes), 1)
        self.assertNoResult(done)

    def test_cancel_stops_writing(self) -> None:
        producer = BytesProducer(b"z" * (4 * BytesProducer.SLICE))
        consumer = PausingConsumer(producer)
        done = producer.startProducing(consumer)
        done.cancel()
        self.failureResultOf(done)
        consumer.drain()
        self.assertEqual(len(consumer.writes), 1)


class ImageRequestTests(TestCase):
    def test_image_request_forwarded_byte_for_byte(self) -> object:
        """A 15 MiB chat request carrying a base64 image goes through crossbar to the
        host its model names, unchanged (slices reassembled in order)."""
        async def go() -> None:
            hosts = await two_hosts(self)
            image = base64.b64encode(bytes(range(256)) * (15 * 2**20 * 3 // 4 // 256)).decode()
            doc: dict[str, Any] = {"model": "model-a", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is in this image?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}]}]}
            body = json.dumps(doc).encode()
            head = request_bytes(b"POST", b"/r/v1/chat/completions",
                                 [(b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode())])
            data, _ = await raw_exchange(hosts.port, head, body, timeout=30)
            [response] = parse_responses(data)
            self.assertEqual((response.status, response.one(b"x-crossbar-host")), (200, b"a"))
            seen = upstream_requests(hosts.a)[-1]
            self.assertEqual(len(seen.body), len(body))
            self.assertTrue(seen.body == body)
        return ensureDeferred(go())
