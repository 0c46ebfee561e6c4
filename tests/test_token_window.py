"""The one token store status and the dashboard read (docs/design.md §What the answers
say; §Operations, the dashboard): 10-second buckets, the last minute and the chart read
from them by one rule, and a ledger's buckets in one process across bucket starts and a
reload."""

from __future__ import annotations

import json

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from crossbar.config import parse_config
from crossbar.ops.app import OpsApp
from crossbar.ops.dashboard import snapshot
from crossbar.ops.metrics import Metrics
from crossbar.ops.recent import RecentRequests
from crossbar.state.cells import token_cell
from crossbar.state.runtime import Runtime
from crossbar.state.token_window import BUCKET, chart, chart_starts, window
from crossbar.state.tokens import TokenLedger

GEN_A = token_cell("h", "a", "generated")


class WindowTests(SynchronousTestCase):
    def test_the_oldest_bucket_counts_for_its_part_inside_the_minute(self) -> None:
        buckets = {1000: {GEN_A: 60.0}, 1050: {GEN_A: 30.0}}
        self.assertEqual(window(buckets, 1059).generated_per_second("a"), 1.5)  # both whole
        self.assertEqual(window(buckets, 1065).generated_per_second("a"), 1.0)  # half of the first
        self.assertEqual(window(buckets, 1070).generated_per_second("a"), 0.5)
        self.assertEqual(window(buckets, 1200).generated_per_second("a"), 0.0)
        self.assertIsNone(window(buckets, 1065).cached_share("h", "a"))

    def test_cached_share_of_the_same_minute(self) -> None:
        buckets = {1000: {token_cell("r", "r", "prompt"): 10.0, token_cell("r", "r", "cached"): 30.0}}
        self.assertEqual(window(buckets, 1030).cached_share("r", "r"), 0.75)
        self.assertEqual(window(buckets, 1030).cached_share("h", "a"), None)

    def test_chart_is_tokens_per_second_per_bucket_over_15_minutes(self) -> None:
        now = 10_005.0
        starts = chart_starts(now)
        self.assertEqual((len(starts), starts[-1]), (15 * 60 // BUCKET, 10_000))
        series = chart({10_000: {GEN_A: 50.0}, 9_990: {GEN_A: 20.0}}, ["a", "b"], now)
        self.assertEqual(series["a"][-2:], [2.0, 10.0])  # the filling bucket over its 5 s
        self.assertEqual(set(series["b"]), {0.0})


class LedgerTests(SynchronousTestCase):
    def test_one_process_tokens_land_in_the_bucket_they_ended_in(self) -> None:
        clock = Clock()
        clock.advance(1005)
        ledger = TokenLedger(clock.seconds, ("a",), ("r",))
        ledger.add("r", "a", 1, 2, 30)
        clock.advance(7)  # a bucket started at 1010; nothing read until now
        ledger.add("r", "a", 1, 2, 12)
        buckets = ledger.buckets()
        self.assertEqual((buckets[1000][GEN_A], buckets[1010][GEN_A]), (30, 12))
        self.assertEqual(ledger.window().generated_per_second("a"), 0.7)
        self.assertEqual(ledger.window().cached_share("r", "r"), round(4 / 6, 4))

    def test_a_reload_keeps_the_history_and_a_new_name_starts_at_zero(self) -> None:
        clock = Clock()
        clock.advance(1000)
        ledger = TokenLedger(clock.seconds, ("a",), ("r",))
        ledger.add("r", "a", 0, 0, 60)
        ledger.add("r", "b", 0, 0, 600)  # b not configured yet: counted, not shown
        clock.advance(20)
        ledger.configure(("a", "b"), ("r",))
        self.assertEqual(ledger.window().generated_per_second("a"), 1.0)
        self.assertEqual(ledger.window().generated_per_second("b"), 0.0)
        ledger.add("r", "b", 0, 0, 6)
        self.assertEqual(ledger.window().generated_per_second("b"), 0.1)


class StatusAndDashboardTests(SynchronousTestCase):
    """One process: status and the dashboard's data show the same figures, read from
    the same store at the same moment."""

    def test_the_same_tokens_per_second_and_cached_share(self) -> None:
        config = parse_config("listen: 'tcp:0'\nhosts: {a: 'http://127.0.0.1:1', b: 'http://127.0.0.1:2'}\n"
                              "routes: {r: {hosts: [a, b]}}\n", "t.yaml")
        clock = Clock()
        clock.advance(50_000)
        runtime = Runtime(config, clock.seconds)
        recent = RecentRequests(clock.seconds)
        runtime.tokens.add("r", "a", 17, 40, 100)
        clock.advance(33)
        runtime.tokens.add("r", "b", 3, 0, 11)
        clock.advance(30)  # the first answer's bucket is partly outside the minute
        request = DummyRequest([b"status"])
        status = json.loads(self.successResultOf(OpsApp(runtime, Metrics(), recent, clock).status(request)))
        data = snapshot(runtime, recent)
        self.assertEqual({h["name"]: h["tps"] for h in data["hosts"]},
                         {name: h["tokens_per_s"] for name, h in status["hosts"].items()})
        self.assertEqual({r["name"]: r["cached_share"] for r in data["routes"]},
                         {name: r["cached_share"] for name, r in status["routes"].items()})
        self.assertEqual(status["hosts"]["a"]["tokens_per_s"], 1.17)  # 70 of its 100 over 60 s
        self.assertEqual(status["routes"]["r"]["cached_share"], round(28 / (11.9 + 3 + 28), 4))
