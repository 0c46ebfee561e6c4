"""Unit and property tests of the fair order (docs/design.md §Access, "Fair shares";
§Choosing a host, rule 4): :func:`crossbar.state.fair.fair_order` as a pure function,
and :class:`crossbar.state.queue.RouteQueues` trying its waiters in that order."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from crossbar.state.fair import NO_KEY, Waiting, fair_order, fair_turns
from crossbar.state.queue import RouteQueues

if TYPE_CHECKING:
    from crossbar.state.runtime import Runtime

KEYS = ("a", "b", "c", "d")


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[Waiting[int]], dict[str, int], dict[str, int]]:
    """Waiting requests (items 0..n-1 in arrival order) of a few keys with random
    priorities, shares, in-flight counts and spent tokens."""
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    priority = {k: draw(st.integers(-2, 2)) for k in keys}
    share = {k: draw(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])) for k in keys}
    arrivals = draw(st.lists(st.sampled_from(keys), min_size=0, max_size=40))
    waiting = [Waiting(i, k, priority[k], share[k]) for i, k in enumerate(arrivals)]
    inflight = {k: draw(st.integers(0, 5)) for k in keys}
    spent = {k: draw(st.sampled_from([0, 100, 1000])) for k in keys}
    return waiting, inflight, spent


class FairOrderProperties(SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(situations())
    def test_no_request_lost_or_duplicated(self, case: tuple[list[Waiting[int]], dict[str, int], dict[str, int]]) -> None:
        waiting, inflight, spent = case
        self.assertEqual(sorted(fair_order(waiting, inflight, spent)), [w.item for w in waiting])

    @settings(max_examples=300, deadline=None)
    @given(situations())
    def test_never_behind_a_lower_priority(self, case: tuple[list[Waiting[int]], dict[str, int], dict[str, int]]) -> None:
        waiting, inflight, spent = case
        by_item = {w.item: w for w in waiting}
        priorities = [by_item[i].priority for i in fair_order(waiting, inflight, spent)]
        self.assertEqual(priorities, sorted(priorities, reverse=True))

    @settings(max_examples=300, deadline=None)
    @given(situations())
    def test_arrival_order_within_a_key(self, case: tuple[list[Waiting[int]], dict[str, int], dict[str, int]]) -> None:
        waiting, inflight, spent = case
        by_item = {w.item: w for w in waiting}
        order = fair_order(waiting, inflight, spent)
        for key in KEYS:
            mine = [i for i in order if by_item[i].key == key]
            self.assertEqual(mine, sorted(mine))

    @settings(max_examples=300, deadline=None)
    @given(situations())
    def test_each_pick_is_the_key_whose_turn_it_is(
            self, case: tuple[list[Waiting[int]], dict[str, int], dict[str, int]]) -> None:
        """The rule as DESIGN states it, at every step: highest priority, then fewest in
        flight / share (each request placed counts as in flight), then fewer tokens
        spent, then the earlier arrival."""
        waiting, inflight, spent = case
        by_item = {w.item: w for w in waiting}
        left = [w.item for w in waiting]
        placed: Counter[str] = Counter()
        for item in fair_order(waiting, inflight, spent):
            heads = {}
            for i in left:
                heads.setdefault(by_item[i].key, i)

            def rank(key: str) -> tuple[int, float, int, int]:
                w = by_item[heads[key]]
                return (-w.priority, (inflight.get(key, 0) + placed[key]) / w.share, spent.get(key, 0), heads[key])

            best = min(heads, key=rank)
            self.assertEqual(rank(by_item[item].key), rank(best))
            placed[by_item[item].key] += 1
            left.remove(item)

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.sampled_from("ab"), min_size=2, max_size=40), st.integers(0, 4))
    def test_equal_keys_alternate(self, arrivals: list[str], inflight: int) -> None:
        """Two keys of one priority and share with as many in flight take turns while
        both wait: neither is ever served two requests ahead of the other (a tie goes
        to the earlier arrival); the earliest request goes first."""
        waiting = [Waiting(i, k) for i, k in enumerate(arrivals)]
        order = fair_order(waiting, {"a": inflight, "b": inflight}, {})
        self.assertEqual(order[0], 0)
        served: Counter[str] = Counter()
        total = Counter(arrivals)
        for i in order:
            served[arrivals[i]] += 1
            if served["a"] < total["a"] and served["b"] < total["b"]:
                self.assertLessEqual(abs(served["a"] - served["b"]), 1)

    @settings(max_examples=100, deadline=None)
    @given(st.integers(1, 30), st.integers(1, 30), st.sampled_from([1.5, 2.0, 3.0]))
    def test_shares_divide_the_turns(self, n_big: int, n_small: int, share: float) -> None:
        """A key of share s gets about s turns for every one of a key of share 1."""
        waiting = [Waiting(i, "big", 0, share) for i in range(n_big)]
        waiting += [Waiting(n_big + i, "small") for i in range(n_small)]
        served: Counter[str] = Counter()
        for item in fair_order(waiting, {}, {}):
            served["big" if item < n_big else "small"] += 1
            if served["big"] < n_big and served["small"] < n_small:
                self.assertLessEqual(abs(served["big"] / share - served["small"]), 1.0)


class FairTurnsProperties(SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(situations(), st.lists(st.booleans(), min_size=40, max_size=40))
    def test_turns_with_requests_that_stay(
            self, case: tuple[list[Waiting[int]], dict[str, int], dict[str, int]], placed: list[bool]) -> None:
        """Whatever goes or stays: every request once, never behind a lower priority,
        arrival order within a key; only placed requests count for their key's turn."""
        waiting, inflight, spent = case
        by_item = {w.item: w for w in waiting}
        turns = fair_turns(waiting, inflight, spent)
        order: list[int] = []
        left = [w.item for w in waiting]
        counted: Counter[str] = Counter()
        try:
            item = next(turns)
            while True:
                heads: dict[str, int] = {}
                for i in left:
                    heads.setdefault(by_item[i].key, i)

                def rank(key: str) -> tuple[int, float, int, int]:
                    w = by_item[heads[key]]
                    return (-w.priority, (inflight.get(key, 0) + counted[key]) / w.share, spent.get(key, 0), heads[key])

                self.assertEqual(rank(by_item[item].key), rank(min(heads, key=rank)))
                order.append(item)
                left.remove(item)
                went = placed[len(order) - 1]
                counted[by_item[item].key] += went
                item = turns.send(went)
        except StopIteration:
            pass
        self.assertEqual(sorted(order), [w.item for w in waiting])
        priorities = [by_item[i].priority for i in order]
        self.assertEqual(priorities, sorted(priorities, reverse=True))

    def test_a_request_that_stays_does_not_count(self) -> None:
        """a0 cannot go (its model's hosts are full): a's turn stands, so a1 (another
        model) goes before b0; placed, a0 would have made it b0's turn."""
        waiting = [Waiting("a0", "a"), Waiting("a1", "a"), Waiting("b0", "b"), Waiting("b1", "b")]
        turns = fair_turns(waiting, {}, {})
        self.assertEqual([next(turns), turns.send(False), turns.send(True), turns.send(True)], ["a0", "a1", "b0", "b1"])
        self.assertEqual(fair_order(waiting, {}, {}), ["a0", "b0", "a1", "b1"])


class FairOrderExamples(SynchronousTestCase):
    def test_empty_and_one_key(self) -> None:
        self.assertEqual(fair_order([], {}, {}), [])
        self.assertEqual(fair_order([Waiting(i, "ci", -1, 2.0) for i in range(3)], {"ci": 9}, {}), [0, 1, 2])

    def test_batch_flood_and_an_interactive_key(self) -> None:
        """A batch key (priority -1) with 200 waiting: the interactive request arriving
        last goes first."""
        waiting = [Waiting(f"ci{i}", "ci", -1) for i in range(200)] + [Waiting("alice0", "alice")]
        self.assertEqual(fair_order(waiting, {"ci": 4}, {})[:2], ["alice0", "ci0"])

    def test_fewest_in_flight_for_its_share(self) -> None:
        waiting = [Waiting("b0", "b"), Waiting("a0", "a", 0, 2.0), Waiting("a1", "a", 0, 2.0)]
        # a: 2 in flight / share 2 = 1; b: 1 / 1 = 1: tie, no tokens: arrival (b0 first)
        self.assertEqual(fair_order(waiting, {"a": 2, "b": 1}, {}), ["b0", "a0", "a1"])
        # a: 1 / 2 = 0.5 < b's 1; after a0, a: 2 / 2 = 1 ties b, which arrived first
        self.assertEqual(fair_order(waiting, {"a": 1, "b": 1}, {}), ["a0", "b0", "a1"])

    def test_ties_go_to_fewer_tokens_then_arrival(self) -> None:
        waiting = [Waiting("a0", "a"), Waiting("b0", "b")]
        self.assertEqual(fair_order(waiting, {}, {"a": 500, "b": 20}), ["b0", "a0"])
        self.assertEqual(fair_order(waiting, {}, {"a": 20, "b": 20}), ["a0", "b0"])

    def test_requests_without_a_key_are_one_key(self) -> None:
        waiting = [Waiting("n0", NO_KEY), Waiting("n1", NO_KEY), Waiting("a0", "a")]
        self.assertEqual(fair_order(waiting, {}, {}), ["n0", "a0", "n1"])


class Waiter:
    """A waiting request of client key ``key`` whose retry takes a slot if one is free."""

    def __init__(self, queues: FairQueueTests, name: str, key: str, route: str = "r") -> None:
        self.owner, self.name, self.key, self.route_name = queues, name, key, route
        self.queued_at: float | None = queues.clock.seconds()
        self.retries = 0

    def retry(self) -> bool:
        self.retries += 1
        return self.owner.take(self)


class Standing:
    """A :class:`crossbar.state.queue.Standing` over fixed settings; counts its calls."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[int, float]] = {}
        self.counts: Counter[str] = Counter()
        self.tokens: dict[str, int] = {}
        self.calls = 0

    def settings(self, route: str, key: str) -> tuple[int, float]:
        self.calls += 1
        return self.keys.get(key, (0, 1.0))

    def requests(self, route: str, key: str) -> int:
        self.calls += 1
        return self.counts[key]

    def spent(self, route: str, key: str) -> int:
        self.calls += 1
        return self.tokens.get(key, 0)


class FairQueueTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.standing = Standing()
        self.queues = RouteQueues(self.clock.seconds, self.standing)
        self.slots = 0
        self.served: list[str] = []

    def take(self, waiter: Waiter) -> bool:
        if self.slots <= 0:
            return False
        self.slots -= 1
        self.served.append(waiter.name)
        return True

    def add(self, name: str, key: str) -> Waiter:
        waiter = Waiter(self, name, key)
        self.queues.add(waiter)
        self.standing.counts[key] += 1  # the runtime counts a waiting request of a key
        return waiter

    def test_interactive_key_passes_the_flood(self) -> None:
        self.standing.keys = {"ci": (-1, 1.0), "alice": (0, 1.0)}
        for i in range(50):
            self.add(f"ci{i}", "ci")
        self.add("alice0", "alice")
        self.slots = 2
        self.queues.wake()
        self.assertEqual(self.served, ["alice0", "ci0"])
        self.assertEqual(self.queues.queued("r"), 49)

    def test_in_flight_is_the_keys_count_less_what_waits_here(self) -> None:
        """Equal keys: the one holding fewer requests (its count less its waiting ones) goes first."""
        for i in range(3):
            self.add(f"a{i}", "a")
        self.add("b0", "b")
        self.standing.counts["a"] += 2  # two of a's requests in flight
        self.standing.counts["b"] += 1
        self.assertEqual((self.queues.inflight("r", "a"), self.queues.inflight("r", "b")), (2, 1))
        self.slots = 1
        self.queues.wake()
        self.assertEqual(self.served, ["b0"])
        self.assertEqual(self.queues.status("r"), {"a": {"priority": 0, "share": 1.0, "queued": 3, "inflight": 2}})

    def test_one_key_costs_nothing_more(self) -> None:
        """No waiter, or waiters of one key only: the standing is never read (arrival order)."""
        self.queues.wake()
        for i in range(3):
            self.add(f"a{i}", "a")
        self.slots = 2
        self.queues.wake()
        self.assertEqual(self.served, ["a0", "a1"])
        self.assertEqual(self.standing.calls, 0)

    def test_a_later_request_may_still_pass_one_whose_tier_is_full(self) -> None:
        self.standing.keys = {"hi": (1, 1.0)}
        full = self.add("hi-big", "hi")
        full.retry = lambda: False  # type: ignore[method-assign]
        self.add("lo0", "lo")
        self.slots = 1
        self.queues.wake()
        self.assertEqual(self.served, ["lo0"])
        self.assertEqual(self.queues.waiters(), [full])

    def test_removed_waiters_leave_the_key_counts(self) -> None:
        a = self.add("a0", "a")
        b = self.add("b0", "b")
        self.assertTrue(self.queues.remove(a))
        self.assertEqual(list(self.queues.status("r")), ["b"])
        self.assertTrue(self.queues.remove(b))
        self.assertEqual((self.queues.status("r"), len(self.queues)), ({}, 0))


class RuntimeStandingTests(SynchronousTestCase):
    """:class:`crossbar.state.standing.RuntimeStanding`: what the runtime's queues read."""

    def runtime(self, keys: str) -> "Runtime":
        from crossbar.config import parse_config
        from crossbar.state.runtime import Runtime

        text = ('listen: "tcp:0"\nhosts: {a: "http://127.0.0.1:9"}\n'
                f"routes:\n  r:\n    hosts: [a]\n    keys:\n{keys}")
        return Runtime(parse_config(text, "x.yaml"), Clock().seconds)

    def test_settings_counts_and_tokens(self) -> None:
        from crossbar.config import parse_config

        runtime = self.runtime("      ci: {secret: c-1, priority: -1, share: 2}\n      alice: a-1\n")
        standing = runtime.queues.standing
        assert standing is not None
        self.assertEqual((standing.settings("r", "ci"), standing.settings("r", "alice")), ((-1, 2.0), (0, 1.0)))
        self.assertEqual(standing.settings("r", NO_KEY), (0, 1.0))
        runtime.key_inflight[("r", "ci")] = 3
        self.assertEqual((standing.requests("r", "ci"), standing.requests("r", NO_KEY)), (3, 0))
        runtime.spend("r", "alice", 120)
        self.assertEqual((standing.spent("r", "alice"), standing.spent("r", "ci"), standing.spent("r", NO_KEY)),
                         (120, 0, 0))
        # a reload that removes ci: its waiting requests are ordered as a key of priority 0, share 1
        runtime.config = parse_config('listen: "tcp:0"\nhosts: {a: "http://127.0.0.1:9"}\n'
                                      "routes:\n  r:\n    hosts: [a]\n    keys: {alice: a-1}\n", "x.yaml")
        self.assertEqual((standing.settings("r", "ci"), standing.requests("r", "ci")), ((0, 1.0), 3))

    def test_fleet_wide_counts(self) -> None:
        """With workers the key's count is every worker's; with a joined cluster, this
        instance's plus the others' (docs/design.md §Workers, §Several crossbars)."""
        runtime = self.runtime("      ci: c-1\n")
        standing = runtime.queues.standing
        assert standing is not None
        runtime.key_inflight[("r", "ci")] = 2

        class Fleet:
            def total(self, name: str) -> int:
                return 7 if name == "k\0r\0ci" else 0

        class Cluster:
            joined = True

            def others(self, name: str) -> int:
                return 5 if name == "k\0r\0ci" else 0

        runtime.counts.fleet = Fleet()  # type: ignore[assignment]
        self.assertEqual(standing.requests("r", "ci"), 7)
        runtime.counts.cluster = Cluster()  # type: ignore[assignment]
        self.assertEqual(standing.requests("r", "ci"), 2 + 5)
