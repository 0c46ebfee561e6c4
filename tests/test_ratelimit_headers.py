"""OpenAI's rate-limit headers on a limited key's answers (docs/design.md §Access):
:func:`crossbar.proxy.ratelimit.duration` and :func:`~crossbar.proxy.ratelimit.rate_limit_headers`
against a model of what OpenAI documents, then through crossbar on loopback.

OpenAI documents (platform.openai.com, "Rate limits in headers"): ``x-ratelimit-limit-*``
the most permitted, ``x-ratelimit-remaining-*`` what remains, ``x-ratelimit-reset-*``
"the time until the rate limit resets to its initial state", written as a duration
(``1s``, ``6m0s``, ``12ms``).
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Request

from crossbar.config import KeyLimits
from crossbar.proxy.ratelimit import duration, rate_limit_headers
from crossbar.state.limits import KeyLimiter
from tests.harness import FakeLlama, http_client, listen, port_of, start_crossbar
from tests.raw import parse_responses, raw_exchange, request_bytes
from tests.test_limits import NOON, Clock


class OpenAIModel:
    """What OpenAI's documentation says the headers show after a sequence of admitted
    requests and spent tokens (a sliding minute; the UTC day)."""

    def __init__(self, limits: KeyLimits) -> None:
        self.limits = limits
        self.admitted: list[float] = []
        self.spent: list[tuple[float, int]] = []

    def headers(self, now: float) -> dict[str, str]:
        out: dict[str, str] = {}
        rpm, tpm, tpd = self.limits.requests_per_minute, self.limits.tokens_per_minute, self.limits.tokens_per_day
        if rpm is not None:
            window = [t for t in self.admitted if t > now - 60]
            out |= {"limit-requests": str(rpm), "remaining-requests": str(max(0, rpm - len(window))),
                    "reset-requests": duration(max(window) + 60 - now) if window else "0s"}
        if tpm is not None:
            window2 = [(t, n) for t, n in self.spent if t > now - 60]
            out |= {"limit-tokens": str(tpm), "remaining-tokens": str(max(0, tpm - sum(n for _, n in window2))),
                    "reset-tokens": duration(max(t for t, _ in window2) + 60 - now) if window2 else "0s"}
        elif tpd is not None:
            today = [n for t, n in self.spent if t // 86400 == now // 86400]
            midnight = (now // 86400 + 1) * 86400
            out |= {"limit-tokens": str(tpd), "remaining-tokens": str(max(0, tpd - sum(today))),
                    "reset-tokens": duration(midnight - now) if sum(today) else "0s"}
        return out


def as_dict(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    prefix = b"x-ratelimit-"
    out = {}
    for name, value in headers:
        assert name.startswith(prefix), name
        out[name[len(prefix):].decode()] = value.decode()
    return out


class Durations(SynchronousTestCase):
    def test_as_openai_writes_them(self) -> None:
        """Go's time.Duration to the millisecond, rounded up."""
        cases = {0: "0s", -1: "0s", 0.012: "12ms", 0.1204: "121ms", 0.999: "999ms", 1: "1s", 6: "6s", 6.25: "6.25s",
                 8.64: "8.64s", 59.9999: "1m0s", 60: "1m0s", 61.5: "1m1.5s", 360: "6m0s", 3600: "1h0m0s",
                 86399: "23h59m59s"}
        for seconds, text in cases.items():
            self.assertEqual(duration(seconds), text, seconds)


class HeadersAgainstTheModel(SynchronousTestCase):
    def run_sequence(self, limits: KeyLimits, steps: list[tuple[float, str, int]]) -> None:
        """Each step: seconds later, ``admit`` or ``spend`` (n tokens); after each the
        headers equal the model's."""
        clock = Clock()
        limiter = KeyLimiter(clock)
        model = OpenAIModel(limits)
        for later, what, n in steps:
            clock.now += later
            if what == "admit":
                limiter.admitted("r", "k")
                model.admitted.append(clock.now)
            else:
                limiter.spend("r", "k", n)
                model.spent.append((clock.now, n))
            self.assertEqual(as_dict(rate_limit_headers(limits, limiter, "r", "k")), model.headers(clock.now),
                             (clock.now - NOON, what, n))

    def test_requests_and_tokens_per_minute(self) -> None:
        limits = KeyLimits(requests_per_minute=3, tokens_per_minute=1000, tokens_per_day=5000)
        self.run_sequence(limits, [
            (0, "admit", 0), (0.5, "spend", 300), (1, "admit", 0), (10.25, "spend", 800), (20, "admit", 0),
            (29.5, "admit", 0), (0.012, "spend", 5), (59, "admit", 0), (61, "spend", 1), (120, "admit", 0),
        ])

    def test_tokens_per_day_alone(self) -> None:
        self.run_sequence(KeyLimits(tokens_per_day=500), [
            (0, "spend", 100), (3600, "spend", 450), (11 * 3600 + 1, "spend", 7),  # past midnight: a new day
        ])

    def test_no_limits_no_headers(self) -> None:
        self.assertEqual(rate_limit_headers(KeyLimits(), KeyLimiter(Clock()), "r", "k"), [])

    def test_what_a_first_answer_shows(self) -> None:
        clock = Clock()
        limiter = KeyLimiter(clock)
        limits = KeyLimits(requests_per_minute=60, tokens_per_minute=150000)
        limiter.admitted("r", "k")
        self.assertEqual(as_dict(rate_limit_headers(limits, limiter, "r", "k")), {
            "limit-requests": "60", "remaining-requests": "59", "reset-requests": "1m0s",
            "limit-tokens": "150000", "remaining-tokens": "150000", "reset-tokens": "0s"})

    def test_a_refusal_says_a_limit_is_spent(self) -> None:
        """A 429 of the key's limits decided by the fleet (cluster.redis) while this box
        counts less says 0 remaining for the key's first limit, reset at its Retry-After;
        where this box already counts a limit spent, the headers are its own."""
        clock = Clock()
        limiter = KeyLimiter(clock)
        limits = KeyLimits(requests_per_minute=5, tokens_per_minute=150000)
        limiter.admitted("r", "k")
        clock.now += 10
        self.assertEqual(as_dict(rate_limit_headers(limits, limiter, "r", "k", refused=50)), {
            "limit-requests": "5", "remaining-requests": "0", "reset-requests": "50s",
            "limit-tokens": "150000", "remaining-tokens": "150000", "reset-tokens": "0s"})
        tokens_only = KeyLimits(tokens_per_minute=100)
        self.assertEqual(as_dict(rate_limit_headers(tokens_only, limiter, "r", "k", refused=7)), {
            "limit-tokens": "100", "remaining-tokens": "0", "reset-tokens": "7s"})
        for _ in range(4):
            limiter.admitted("r", "k")
        own = rate_limit_headers(limits, limiter, "r", "k")
        self.assertEqual(rate_limit_headers(limits, limiter, "r", "k", refused=50), own)


def answer_with_tokens(request: Request, body: bytes) -> bytes:
    """A chat completion that read 10 prompt tokens and generated 5 (llama-server's timings)."""
    request.setHeader(b"content-type", b"application/json")
    return (b'{"object": "chat.completion", "choices": [], '
            b'"timings": {"prompt_n": 10, "cache_n": 0, "predicted_n": 5}}')


class ThroughCrossbar(TestCase):
    """Every answer of a key with limits carries the headers; others none."""

    timeout = 30

    async def test_relayed_and_own_answers(self) -> None:
        host = FakeLlama(["m"])
        host.handlers[b"/v1/chat/completions"] = answer_with_tokens
        url = await listen(self, host)
        service, base = await start_crossbar(self, (
            "health: {interval: 60, timeout: 5}\n"
            f"hosts:\n  h: {url}\n"
            "routes:\n  r:\n    hosts: [h]\n    keys:\n"
            "      ci:\n        secret: ci-secret-1\n"
            "        limits: {requests_per_minute: 3, tokens_per_minute: 1000}\n"
            "      alice: alice-secret-1\n"
            "  open:\n    hosts: [h]\n"))
        await service.poller.when_first_round_done()
        clock = Clock()
        service.runtime.limits.now = clock
        model = OpenAIModel(KeyLimits(requests_per_minute=3, tokens_per_minute=1000))
        client = http_client(self)

        async def call(secret: str = "ci-secret-1", path: str = "/r/v1/chat/completions") -> tuple[int, dict[str, str], Any]:
            response = await client.post(base + path, json={"model": "m"}, headers={"Authorization": f"Bearer {secret}"})
            body = await response.json()
            got = {name.decode().lower()[len("x-ratelimit-"):]: values[0].decode()
                   for name, values in response.headers.getAllRawHeaders()
                   if name.decode().lower().startswith("x-ratelimit-")}
            return response.code, got, body

        for step in range(3):
            model.admitted.append(clock.now)
            code, got, _ = await call()
            self.assertEqual((code, got), (200, model.headers(clock.now)), step)
            model.spent.append((clock.now, 15))  # spent once the answer ended
            clock.now += 1
        code, got, body = await call()  # the fourth in a minute: crossbar's own 429
        self.assertEqual(body["error"]["code"], 429)
        self.assertEqual((code, got), (429, model.headers(clock.now)))
        self.assertEqual(got, {"limit-requests": "3", "remaining-requests": "0", "reset-requests": "59s",
                               "limit-tokens": "1000", "remaining-tokens": "955", "reset-tokens": "59s"})
        code, got, _ = await call(path="/r/nowhere")  # crossbar's 404 for a path it does not forward
        self.assertEqual((code, got["remaining-requests"]), (404, "0"))
        self.assertEqual((await call("alice-secret-1"))[:2], (200, {}))  # a key without limits
        self.assertEqual((await call("nobody", "/open/v1/chat/completions"))[:2], (200, {}))
        self.assertEqual((await call("wrong"))[:2], (401, {}))
        # an early refusal on the head (a body over 16 MiB: 413, never read) carries them too
        received, _ = await raw_exchange(port_of(base), request_bytes(
            b"POST", b"/r/v1/chat/completions",
            [(b"Authorization", b"Bearer ci-secret-1"), (b"Content-Length", b"%d" % (17 * 1024 * 1024))]))
        [refused] = parse_responses(received)
        headers = {n.decode()[len("x-ratelimit-"):]: v.decode() for n, v in refused.headers
                   if n.startswith(b"x-ratelimit-")}
        self.assertEqual((refused.status, headers), (413, model.headers(clock.now)))


class SpentReadsOneKey(SynchronousTestCase):
    """``ILimitCounts.spent`` (what the headers and the fair order read per answer) equals
    the key's entry of ``spending`` (status), in one process and over two workers' rows."""

    def test_process_and_box(self) -> None:
        from crossbar.config import parse_config
        from crossbar.state.box_limits import BoxLimits, limited_keys
        from crossbar.state.limits import Spending
        from tests.test_limits import keys_yaml

        config = parse_config(keys_yaml(3, "{requests_per_minute: 50, tokens_per_minute: 9000}", 0), "c.yaml", {})
        path = self.mktemp() + "-limits"
        BoxLimits.create(path, 3, 256)
        clock = Clock()
        boxes = [BoxLimits(path, 3, row, config) for row in (0, 1)]
        limiters = [KeyLimiter(clock), KeyLimiter(clock), KeyLimiter(clock)]
        limiters[0].counts, limiters[1].counts = boxes
        keys = sorted(key for (_, key) in limited_keys(config))
        for step in range(150):
            limiter = limiters[step % 3]
            key = keys[step % len(keys)]
            if step % 2:
                limiter.admitted("r", key)
            else:
                limiter.spend("r", key, 10 + step)
            clock.now += 0.7
            for reader in limiters:
                spending = reader.counts.spending(clock.now)
                for k in keys + ["never"]:
                    self.assertEqual(reader.counts.spent("r", k, clock.now),
                                     spending.get(("r", k), Spending(0, 0, 0)), (step, k))
