"""Every counter is the box's total whichever worker answers (docs/design.md §Workers):
a real ``twistd`` with ``workers: 2`` and ``cluster.redis`` over a real Redis that goes
away once, scraped again and again on fresh connections (so both workers answer); each
counter must be the same in every scrape at rest, the sum over the workers, and never go
down, also across a worker killed and restarted."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Request

from tests.harness import FakeLlama, listen, wait_for
from tests.redis_server import start_redis
from tests.test_workers import ask_worker, fresh, served, start_workers, worker_pids

SECRET = "secret-0123456789-abcdef"
PROMPT, GENERATED = 7, 5

Series = tuple[str, tuple[tuple[str, str], ...]]


BOX_GAUGES = ("crossbar_key_spent",)
"""Gauges that are the box's too (a key's spending), compared like the counters."""


def counters(text: str) -> dict[Series, float]:
    """Every sample of every counter and histogram of a scrape, and :data:`BOX_GAUGES`
    (other gauges left out: they are read live and may differ between workers, e.g. a
    worker's own Redis link)."""
    out: dict[Series, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("counter", "histogram") and family.name not in BOX_GAUGES:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # a per-process timestamp, not a count
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def answer_with_usage(request: Request, body: bytes) -> bytes:
    request.setHeader(b"content-type", b"application/json")
    return json.dumps({"object": "chat.completion", "model": "tiny-a",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                       "usage": {"prompt_tokens": PROMPT, "completion_tokens": GENERATED,
                                 "total_tokens": PROMPT + GENERATED}}).encode()


class CountersWhicheverWorkerTests(TestCase):
    timeout = 180

    async def scrape_both(self, proc: Any, rounds: int = 3) -> dict[int, list[dict[Series, float]]]:
        """Scrape on fresh connections until each worker answered ``rounds`` times."""
        seen: dict[int, list[dict[Series, float]]] = defaultdict(list)
        for _ in range(80):
            worker, code, body = await deferToThread(ask_worker, proc, "/_crossbar/metrics")
            self.assertEqual(code, 200)
            seen[worker].append(counters(body.decode()))
            if len(seen) == 2 and min(len(v) for v in seen.values()) >= rounds:
                break
        self.assertEqual(sorted(seen), [0, 1])
        return seen

    def assert_same_everywhere(self, seen: dict[int, list[dict[Series, float]]]) -> dict[Series, float]:
        first = seen[0][0]
        for worker, scrapes in seen.items():
            for scrape in scrapes:
                diff = {s: (first.get(s), scrape.get(s)) for s in set(first) | set(scrape)
                        if first.get(s) != scrape.get(s)}
                self.assertEqual(diff, {}, f"worker {worker} disagrees")
        return first

    def assert_never_down(self, before: dict[Series, float], after: dict[Series, float]) -> None:
        down = {s: (v, after.get(s, 0.0)) for s, v in before.items() if after.get(s, 0.0) < v}
        self.assertEqual(down, {}, "counters went down")

    async def test_every_counter_is_the_box_total(self) -> None:
        redis = start_redis(self)
        host = FakeLlama(["tiny-a"])
        host.handlers[b"/v1/chat/completions"] = answer_with_usage
        url = await listen(self, host)
        yaml = (f"health: {{interval: 60, timeout: 5}}\ndrain: {{delay: 0.01, grace: 1}}\n"
                f"cluster: {{redis: '{redis.url}'}}\n"
                f"hosts:\n  a: {{url: {url}}}\n"
                "routes:\n  r:\n    hosts: [a]\n    affinity: {key: none}\n"
                f"    keys:\n      k: {{secret: {SECRET}, limits: {{tokens_per_day: 100000000}}}}\n")
        proc = await start_workers(self, yaml)
        await wait_for(lambda: redis.command("ZCARD", "crossbar:live") == 2, timeout=20, what="both workers joined")
        http = fresh(self)

        async def send(n: int) -> None:
            for _ in range(n):
                response = await http.post(proc.base + "/r/v1/chat/completions", json={"model": "tiny-a"},
                                           headers={"Authorization": f"Bearer {SECRET}"})
                self.assertEqual(response.code, 200)
                await response.content()

        # The kernel hands each fresh connection to whichever worker accepts first; on a
        # loaded box one worker may win ten in a row, so send until both have served.
        sent = 0
        while sent < 10 or ({e["worker"] for e in served(proc)} != {0, 1} and sent < 80):
            await send(1)
            sent += 1
            await wait_for(lambda: len(served(proc)) >= sent, 10, f"{sent} log lines")
        self.assertEqual({e["worker"] for e in served(proc)}, {0, 1}, f"both workers served ({sent} sent)")

        # Redis goes away once: each worker (an instance of its own) loses it once.
        redis.stop()
        await wait_for(lambda: ensureDeferred(self.every_worker_says(proc, "crossbar_cluster_up", 0.0)),
                       timeout=20, what="both workers alone")
        redis.start()
        await wait_for(lambda: ensureDeferred(self.every_worker_says(proc, "crossbar_cluster_up", 1.0)),
                       timeout=20, what="both workers back")

        first = self.assert_same_everywhere(await self.scrape_both(proc))

        def value(name: str, **labels: str) -> float:
            return sum(v for (n, ls), v in first.items() if n == name and all(dict(ls).get(k) == w
                                                                          for k, w in labels.items()))

        self.assertEqual(value("crossbar_requests_total", route="r", code="200"), sent)
        self.assertEqual(value("crossbar_tokens_total", key="k", kind="generated"), sent * GENERATED)
        self.assertEqual(value("crossbar_affinity_total", route="r"), sent)
        self.assertEqual(value("crossbar_cluster_lost_total"), 2)
        self.assertEqual(value("crossbar_worker_restarts_total"), 0)
        self.assertEqual(value("crossbar_key_spent", key="k", window="tokens_day"), sent * (PROMPT + GENERATED))

        # A worker killed and restarted: what it counted stays counted.
        pids = worker_pids(proc)
        os.kill(pids[1], signal.SIGKILL)
        await wait_for(lambda: sum('"message": "worker 1 is ready"' in line for line in proc.out) == 2,
                       timeout=60, what="worker 1 ready again")
        await wait_for(lambda: redis.command("ZCARD", "crossbar:live") >= 2, timeout=20, what="worker 1 rejoined")
        logged = len(served(proc))
        await send(4)
        await wait_for(lambda: len(served(proc)) >= logged + 4, 10, "their 4 log lines")  # counted by then
        after = self.assert_same_everywhere(await self.scrape_both(proc))
        self.assert_never_down(first, after)
        self.assertEqual(sum(v for (n, ls), v in after.items() if n == "crossbar_requests_total"), sent + 4)
        self.assertEqual(sum(v for (n, ls), v in after.items() if n == "crossbar_cluster_lost_total"), 2)
        self.assertEqual(sum(v for (n, ls), v in after.items() if n == "crossbar_worker_restarts_total"), 1)
        self.assertEqual(sum(v for (n, ls), v in after.items() if n == "crossbar_affinity_total"), sent + 4)
        self.assertEqual(after[("crossbar_key_spent", (("key", "k"), ("route", "r"), ("window", "tokens_day")))],
                         (sent + 4) * (PROMPT + GENERATED))

    async def every_worker_says(self, proc: Any, name: str, wanted: float) -> bool:
        said: dict[int, float] = {}
        for _ in range(20):
            worker, _, body = await deferToThread(ask_worker, proc, "/_crossbar/metrics")
            for family in text_string_to_metric_families(body.decode()):
                for sample in family.samples:
                    if sample.name == name:
                        said[worker] = sample.value
            if len(said) == 2:
                break
        return len(said) == 2 and all(v == wanted for v in said.values())


class DeadWorkerSharesTests(SynchronousTestCase):
    """When a worker dies its row is cleared (its in-flight and waiting requests are
    gone), but the supervisor keeps its share of every counter cell: affinity outcomes,
    token totals (status' tokens/s and cached share), Redis losses."""

    def test_counters_of_a_dead_worker_stay_counted(self) -> None:
        from twisted.internet.error import ProcessTerminated
        from twisted.python.failure import Failure

        from crossbar.config import load_config
        from crossbar.process.supervisor import Supervisor
        from crossbar.state.shared import SharedCounts
        from crossbar.state.cells import AFFINITY, CLUSTER_LOST, HOST_INFLIGHT, token_cell
        from crossbar.state.worker_counts import WorkerCounts
        from tests.test_workers import _SpawnReactor

        path = self.mktemp()
        with open(path, "w") as f:
            f.write("listen: tcp:0\nworkers: 2\nhosts: {a: 'http://h:1'}\nroutes: {r: {hosts: [a]}}\n")
        config = load_config(path)
        supervisor = Supervisor(config, _SpawnReactor(failures=0), environ={}, handle_signals=False)
        supervisor.startService()
        self.addCleanup(shutil.rmtree, supervisor.files.directory, True)
        assert supervisor.counts is not None
        shared = os.path.join(supervisor.files.directory, "counts")
        w0, w1 = (WorkerCounts(SharedCounts(shared, 3, row), config) for row in (0, 1))
        generated, lost, none = token_cell("h", "a", "generated"), CLUSTER_LOST.cell(), AFFINITY.cell("r", "none")
        for counts, n in ((w0, 1), (w1, 2)):
            counts.publish(lost, n)
            counts.publish(generated, 100 * n)
            counts.publish(none, 10 * n)
            counts.publish(HOST_INFLIGHT.cell("a"), n)
        fleet = supervisor.counts
        before = (fleet.total(lost), fleet.total(generated), fleet.total(none))
        self.assertEqual(before, (3, 300, 30))
        worker = supervisor.workers[1]
        assert worker is not None
        worker.processEnded(Failure(ProcessTerminated(signal=9)))
        self.assertEqual((fleet.total(lost), fleet.total(generated), fleet.total(none)), before)
        self.assertEqual(fleet.total(HOST_INFLIGHT.cell("a")), 1)  # its in-flight requests are gone with it
        # the restarted worker starts its own share from 0, on top of the kept one
        w1.shared.clear_row()
        w1.publish(lost, 1)
        self.assertEqual(fleet.total(lost), 4)
        # and a reload (which clears the supervisor's row) keeps the dead worker's share
        self.assertTrue(supervisor.reload())
        self.assertEqual(fleet.total(lost), 4)


class FleetCountersTests(SynchronousTestCase):
    """A collector's per-process counter made the box's (``ops.metrics.FleetCounters``
    over ``Runtime.counter``), without processes: two runtimes share one counts file."""

    def test_the_answering_worker_gives_the_sum(self) -> None:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from crossbar.config import parse_config
        from crossbar.ops.metrics import FleetCounters
        from crossbar.state.runtime import Runtime
        from crossbar.state.shared import SharedCounts
        from crossbar.state.cells import CLUSTER_LOST
        from crossbar.state.worker_counts import WorkerCounts

        config = parse_config("listen: tcp:0\nhosts: {a: 'http://h:1'}\nroutes: {r: {hosts: [a]}}\n", "c.yaml", {})
        path = self.mktemp()
        SharedCounts.create(path, 3)
        lost = {0: 1, 1: 2}
        runtimes = []
        for row in (0, 1):
            runtime = Runtime(config, lambda: 0.0)
            runtime.own_counters[CLUSTER_LOST] = lambda row=row: lost[row]
            runtime.attach(WorkerCounts(SharedCounts(path, 3, row), config))
            runtimes.append(runtime)

        class Link:
            """A collector of this process only, like the cluster's."""

            def collect(self) -> list[Any]:
                up = GaugeMetricFamily("crossbar_cluster_up", "up")
                up.add_metric((), 1)
                own = CounterMetricFamily("crossbar_cluster_lost", "lost")
                own.add_metric((), 99)
                return [up, own]

        def scrape(runtime: Runtime) -> str:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(FleetCounters(Link(), {"crossbar_cluster_lost": lambda: runtime.counter(CLUSTER_LOST)}))
            return generate_latest(registry).decode()

        for runtime in runtimes:
            text = scrape(runtime)
            self.assertIn("crossbar_cluster_lost_total 3.0", text)
            self.assertIn("crossbar_cluster_up 1.0", text)  # gauges pass through
        lost[1] = 5  # grown in worker 1, which has not published yet: worker 0 reads 1 + 2
        self.assertIn("crossbar_cluster_lost_total 3.0", scrape(runtimes[0]))
        runtimes[1].publish_counters()  # what its cluster-change hook does
        self.assertIn("crossbar_cluster_lost_total 6.0", scrape(runtimes[0]))
        alone = Runtime(config, lambda: 0.0)
        alone.own_counters[CLUSTER_LOST] = lambda: 4
        self.assertEqual(alone.counter(CLUSTER_LOST), 4)  # one process: its own
