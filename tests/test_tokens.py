"""Tokens through crossbar from loopback hosts that misbehave (docs/design.md §What the
answers say; §The proxy rule 8): an answer cut by a dying host counts no tokens and is
logged and counted as cut; figures of unexpected shapes count nothing, break nothing
and reach the client byte for byte; with workers, one fleet-wide ledger.
The agreement with real llama-servers is in tests/test_tokens_real.py."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import NOT_DONE_YET, Request

from tests.harness import FakeLlama, http_client, listen, start_routes, wait_for
from tests.logs import LogCapture
from crossbar.config import parse_config
from crossbar.state.shared import SharedCounts
from crossbar.state.tokens import TokenLedger
from crossbar.state.cells import token_cell
from crossbar.state.worker_counts import WorkerCounts

TIMINGS = {"cache_n": 3, "prompt_n": 4, "predicted_n": 5, "predicted_per_second": 50.0}


def _json_answer(body: bytes) -> Any:
    def handler(request: Request, _: bytes) -> bytes:
        request.setHeader(b"content-type", b"application/json")
        return body
    return handler


def _dies_after_figures(request: Request, _: bytes) -> Any:
    """A stream whose figures arrive, and then the host dies before the answer ends."""
    request.setHeader(b"content-type", b"text/event-stream")
    request.write(b'data: {"choices":[{"delta":{"content":" a"}}]}\n\n')
    request.write(b"data: " + json.dumps({"choices": [], "timings": TIMINGS}).encode() + b"\n\n")
    transport = request.channel.transport
    reactor.callLater(0.05, transport.abortConnection)  # type: ignore[attr-defined]
    return NOT_DONE_YET


def tokens_samples(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("crossbar_tokens_total")]


HOSTILE = {
    "strings": json.dumps({"timings": {"prompt_n": "4", "predicted_n": "5"}}).encode(),
    "negative": json.dumps({"usage": {"prompt_tokens": -4, "completion_tokens": 5}}).encode(),
    "huge": json.dumps({"usage": {"prompt_tokens": 10 ** 40, "completion_tokens": 5}}).encode(),
    "float": json.dumps({"timings": {"prompt_n": 1.5, "predicted_n": 2}}).encode(),
    "nested": b'{"usage": ' + b'{"usage": ' * 50000 + b"1" + b"}" * 50000 + b"}",
    "megabyte": json.dumps({"usage": {"pad": "x" * (1 << 20), "prompt_tokens": 5, "completion_tokens": 5}}).encode(),
    "cached over prompt": json.dumps({"usage": {"prompt_tokens": 2, "completion_tokens": 5,
                                                "prompt_tokens_details": {"cached_tokens": 9}}}).encode(),
}


class ThroughCrossbarTests(TestCase):
    timeout = 60

    def test_cut_answer_counts_nothing_and_is_logged_cut(self) -> object:
        async def go() -> None:
            host = FakeLlama(["tiny-a"])
            host.handlers[b"/v1/chat/completions"] = _dies_after_figures
            service, base = await start_routes(self, {"a": await listen(self, host)})
            logs = LogCapture(self)
            response = await http_client(self).post(base + "/r/v1/chat/completions",
                                                    b'{"model": "tiny-a", "stream": true}')
            self.assertEqual(response.code, 200)
            with self.assertRaises(Exception):
                await treq.content(response)  # a truncated answer, never a clean end
            lines = await wait_for(lambda: logs.proxied(), what="the log line")
            self.assertEqual(lines[0]["ended"], "cut")
            self.assertIsNone(lines[0]["tokens"])
            self.assertIn(" ended=cut", lines[0]["line"])
            self.assertNotIn("tokens=", lines[0]["line"])
            metrics = await treq.text_content(await http_client(self).get(base + "/_crossbar/metrics"))
            self.assertIn('crossbar_unfinished_answers_total{ended="cut",host="a",route="r"} 1.0', metrics)
            self.assertEqual(tokens_samples(metrics), [])
            status = json.loads(await treq.text_content(await http_client(self).get(base + "/_crossbar/status")))
            self.assertIsNone(status["routes"]["r"]["cached_share"])
            self.assertEqual(status["hosts"]["a"]["tokens_per_s"], 0)

        return ensureDeferred(go())

    def test_hostile_figures_count_nothing_and_pass_unchanged(self) -> object:
        async def go() -> None:
            host = FakeLlama(["tiny-a"])
            service, base = await start_routes(self, {"a": await listen(self, host)})
            logs = LogCapture(self)
            client = http_client(self)
            for name, body in HOSTILE.items():
                host.handlers[b"/v1/chat/completions"] = _json_answer(body)
                response = await client.post(base + "/r/v1/chat/completions", b'{"model": "tiny-a"}')
                self.assertEqual(response.code, 200, name)
                self.assertEqual(await treq.content(response), body, name)
            # and a well-formed one still counts
            host.handlers[b"/v1/chat/completions"] = _json_answer(json.dumps({"timings": TIMINGS}).encode())
            response = await client.post(base + "/r/v1/chat/completions", b'{"model": "tiny-a"}')
            await treq.content(response)
            lines = await wait_for(lambda: len(logs.proxied()) == len(HOSTILE) + 1 and logs.proxied())
            self.assertEqual([e["tokens"] for e in lines], [None] * len(HOSTILE) + [(4, 3, 5)])
            self.assertEqual(logs.errors(), [])
            metrics = await treq.text_content(await client.get(base + "/_crossbar/metrics"))
            self.assertEqual(sorted(tokens_samples(metrics)), sorted(
                f'crossbar_tokens_total{{host="a",key="",kind="{kind}",model="tiny-a",route="r"}} {n}.0'
                for kind, n in (("prompt", 4), ("cached", 3), ("generated", 5))))

        return ensureDeferred(go())


def _attach(ledger: TokenLedger, fleet: WorkerCounts) -> None:
    """The ledger of a worker whose counts are ``fleet`` (what ``Runtime.attach`` does)."""
    ledger.counts.fleet = fleet
    ledger.attach()


class FleetLedgerTests(SynchronousTestCase):
    """Two workers' ledgers over one shared file: the same totals and last minute
    whichever worker is asked (docs/design.md §Workers)."""

    def test_two_workers_one_total(self) -> None:
        config = parse_config("listen: 'tcp:0'\nhosts: {a: 'http://127.0.0.1:1', b: 'http://127.0.0.1:2'}\n"
                              "routes: {r: {hosts: [a, b]}}\n", "t.yaml")
        path = os.path.join(tempfile.mkdtemp(prefix="crossbar-tokens-"), "shared")
        SharedCounts.create(path, 3)
        clock = Clock()
        clock.advance(1000)
        ledgers = []
        for row in (1, 2):
            ledger = TokenLedger(clock.seconds, tuple(config.hosts), tuple(config.routes))
            _attach(ledger, WorkerCounts(SharedCounts(path, 3, row), config))
            ledgers.append(ledger)

        def advance(seconds: float) -> None:  # each worker's timer runs
            clock.advance(seconds)
            for ledger in ledgers:
                ledger.tick()

        ledgers[0].add("r", "a", 10, 90, 30)
        advance(10)
        ledgers[1].add("r", "a", 0, 100, 30)
        ledgers[1].add("r", "b", 20, 0, 6)
        generated_a = token_cell("h", "a", "generated")
        for ledger in ledgers:
            window = ledger.window()
            self.assertEqual(window.seconds, 60)
            self.assertEqual(window.generated_per_second("a"), 1.0)  # 60 tokens over the minute
            self.assertEqual(window.cached_share("r", "r"), round(190 / 220, 4))
            self.assertEqual(window.cached_share("h", "b"), 0.0)
            buckets = ledger.buckets()
            self.assertEqual((buckets[1000][generated_a], buckets[1010][generated_a]), (30, 30))
        # the first bucket leaves the minute a second at a time: half of it at 1065
        advance(55)
        self.assertEqual([ledger.window().generated_per_second("a") for ledger in ledgers], [0.75, 0.75])
        advance(10)
        self.assertEqual(ledgers[1].window().generated_per_second("a"), 0.25)
        # a minute after the last tokens the window is empty
        advance(15)
        self.assertEqual(ledgers[0].window().generated_per_second("a"), 0.0)
        self.assertIsNone(ledgers[0].window().cached_share("r", "r"))

    def test_a_restarted_worker_takes_the_boxs_history_back(self) -> None:
        """A worker's samples go to its row's file; the worker restarted in that row
        reads them back: its buckets, last minute and chart are its sibling's."""
        from crossbar.state.token_history import TokenHistory

        config = parse_config("listen: 'tcp:0'\nhosts: {a: 'http://127.0.0.1:1'}\nroutes: {r: {hosts: [a]}}\n",
                              "t.yaml")
        path = os.path.join(tempfile.mkdtemp(prefix="crossbar-tokens-"), "shared")
        SharedCounts.create(path, 3)
        clock = Clock()
        clock.advance(10_000)

        def worker(row: int) -> TokenLedger:
            ledger = TokenLedger(clock.seconds, ("a",), ("r",))
            ledger.counts.fleet = WorkerCounts(SharedCounts(path, 3, row), config)
            ledger.attach(TokenHistory.of_row(path, row))
            return ledger

        dying, sibling = worker(1), worker(2)
        for _ in range(12):  # two minutes of answers, both workers' timers running
            dying.add("r", "a", 1, 2, 30)
            sibling.add("r", "a", 0, 0, 10)
            clock.advance(10)
            dying.tick()
            sibling.tick()
        # worker 1 dies: the supervisor keeps its share of the counters, its row is cleared
        supervisor = WorkerCounts(SharedCounts(path, 3, 0), config)
        for name in supervisor.counter_cells():
            supervisor.publish(name, supervisor.of_row(name, 1))
        supervisor.shared.clear_row(1)
        clock.advance(3)
        restarted = worker(1)
        self.assertEqual(restarted.buckets(), sibling.buckets())
        self.assertEqual(restarted.window().generated_per_second("a"), sibling.window().generated_per_second("a"))
        self.assertEqual(restarted.window().generated_per_second("a"), round((0.7 * 40 + 5 * 40) / 60, 2))
        # the file stays bounded: rewritten with what is still needed
        for _ in range(300):
            clock.advance(10)
            restarted.tick()
        with open(TokenHistory.of_row(path, 1).path) as f:
            self.assertLessEqual(len(f.readlines()), 2 * (15 * 60 // 10 + 3))

    def test_tokens_counted_before_the_fleet_are_published_with_it(self) -> None:
        """In one process an answer's tokens wait in its cells; attaching the fleet (a
        worker's start, a reload) publishes them with the rest."""
        config = parse_config("listen: 'tcp:0'\nhosts: {a: 'http://127.0.0.1:1'}\nroutes: {r: {hosts: [a]}}\n", "t.yaml")
        path = os.path.join(tempfile.mkdtemp(prefix="crossbar-tokens-"), "shared")
        SharedCounts.create(path, 3)
        clock = Clock()
        alone = TokenLedger(clock.seconds, ("a",), ("r",))
        alone.add("r", "a", 10, 90, 30)
        self.assertEqual(alone.totals()[token_cell("h", "a", "generated")], 30)
        alone.add("r", "a", 1, 2, 3)  # pending again when the fleet comes
        _attach(alone, WorkerCounts(SharedCounts(path, 3, 1), config))
        other = TokenLedger(clock.seconds, ("a",), ("r",))
        _attach(other, WorkerCounts(SharedCounts(path, 3, 2), config))
        totals = other.totals()
        self.assertEqual((totals[token_cell("h", "a", "prompt")], totals[token_cell("h", "a", "cached")],
                          totals[token_cell("h", "a", "generated")], totals[token_cell("r", "r", "cached")]),
                         (11, 92, 33, 92))


class WorkersTests(TestCase):
    """``workers: 2`` (real processes): the token metrics and status are the fleet's,
    whichever worker answers (docs/design.md §Workers), and status and the dashboard
    show the same tokens/s and cached share."""

    timeout = 120

    def test_same_totals_whichever_worker_answers(self) -> object:
        from twisted.internet.threads import deferToThread

        from tests.test_workers import ask_worker, fresh, host_yaml, metric, start_workers, until_both_workers_served

        async def go() -> None:
            host = FakeLlama(["tiny-a"])
            host.handlers[b"/v1/chat/completions"] = _json_answer(json.dumps({"timings": TIMINGS}).encode())
            proc = await start_workers(self, host_yaml(await listen(self, host)))
            lines = await until_both_workers_served(self, proc, fresh(self), "r")
            n = len(lines)
            self.assertEqual({e["worker"] for e in lines}, {0, 1})
            self.assertEqual({tuple(e["tokens"]) for e in lines}, {(4, 3, 5)})
            answered: list[int] = []
            for _ in range(200):  # until each worker answered twice (the kernel picks: one may win many in a row)
                worker, _, body = await deferToThread(ask_worker, proc, "/_crossbar/metrics")
                text = body.decode()
                for kind, per in (("prompt", 4), ("cached", 3), ("generated", 5)):
                    self.assertEqual(metric(text, "crossbar_tokens_total", route="r", host="a", kind=kind,
                                            model="tiny-a"), per * n, text)
                worker, _, body = await deferToThread(ask_worker, proc, "/_crossbar/status")
                doc = json.loads(body)
                self.assertEqual(doc["routes"]["r"]["cached_share"], round(3 / 7, 4))
                self.assertEqual(doc["hosts"]["a"]["cached_share"], round(3 / 7, 4))
                self.assertEqual(doc["hosts"]["a"]["tokens_per_s"], round(5 * n / 60, 2))
                answered.append(worker)
                # the dashboard's data, from whichever worker: the same figures
                _, _, body = await deferToThread(ask_worker, proc, "/_crossbar/dashboard.json")
                data = json.loads(body)
                self.assertEqual([h["tps"] for h in data["hosts"] if h["name"] == "a"],
                                 [doc["hosts"]["a"]["tokens_per_s"]])
                self.assertEqual([r["cached_share"] for r in data["routes"] if r["name"] == "r"],
                                 [doc["routes"]["r"]["cached_share"]])
                self.assertGreater(sum(data["chart"]["hosts"]["a"][-7:]), 0)
                if min(answered.count(0), answered.count(1)) >= 2:
                    break
            self.assertGreaterEqual(min(answered.count(0), answered.count(1)), 2, answered)

        return ensureDeferred(go())


class DashboardReadsTheRecordTests(SynchronousTestCase):
    def test_recent_entry_shows_the_figures(self) -> None:
        from crossbar.ops.figures import Figures
        from crossbar.ops.record import RequestRecord
        from crossbar.ops.recent import entry

        record = RequestRecord(route="r", host="a", method="POST", path="/v1/chat/completions",
                               target="/r/v1/chat/completions", status=200, bytes=10, duration=0.5,
                               figures=Figures(4, 3, 5, 100.0, 50.0), model="tiny-a", ended="complete",
                               named="tiny-a", resolved="tiny-a")
        e = entry(1.0, record)
        self.assertEqual((e["model"], e["ended"]), ("tiny-a", "complete"))
        self.assertEqual(e["tokens"], {"prompt": 4.0, "cached": 3.0, "generated": 5.0, "tps": 50.0})


class KeySpendTests(TestCase):
    timeout = 60

    def test_a_keys_answer_tokens_are_spent(self) -> object:
        """A complete answer's tokens count against its key's token limits (docs/design.md
        §Access): every prompt token, cached or read, and every generated one."""
        from tests.harness import start_crossbar

        async def go() -> None:
            host = FakeLlama(["tiny-a"])
            host.handlers[b"/v1/chat/completions"] = _json_answer(json.dumps({"timings": TIMINGS}).encode())
            url = await listen(self, host)
            service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts: {{a: {url}}}
routes:
  r:
    hosts: [a]
    keys: {{ci: {{secret: ci-Tq8z1-secret, limits: {{tokens_per_minute: 100000}}}}}}
""")
            await service.poller.when_first_round_done()
            for _ in range(2):
                response = await http_client(self).post(
                    base + "/r/v1/chat/completions", b'{"model": "tiny-a"}',
                    headers={b"Authorization": [b"Bearer ci-Tq8z1-secret"]})
                self.assertEqual(response.code, 200)
                await treq.content(response)
            spent = await wait_for(lambda: service.runtime.limits.spending().get(("r", "ci")))
            self.assertEqual((spent.tokens_minute, spent.tokens_day), (2 * 12, 2 * 12))

        return ensureDeferred(go())
