"""Weighted rendezvous hashing with bounded load (crossbar.hosts.affinity; docs/design.md §"Cache
affinity"; the property tests issue 12 lists)."""

from __future__ import annotations

import math
import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from crossbar.hosts.affinity import Candidate, Pick, bound, pick, rank, score

_names = st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=12),
                  min_size=1, max_size=8, unique=True)
_keys = st.text(max_size=40)


def keys(seed: int, n: int) -> list[str]:
    rnd = random.Random(seed)
    return [f"m:{rnd.getrandbits(128):032x}" for _ in range(n)]


def homes(hosts: list[tuple[str, float]], ks: list[str]) -> Counter[str]:
    return Counter(rank(k, hosts)[0] for k in ks)


class RankTests(SynchronousTestCase):
    @given(_keys, _names, st.randoms())
    def test_same_key_same_ranking(self, key: str, names: list[str], rnd: random.Random) -> None:
        hosts = [(n, 1.0 + i % 3) for i, n in enumerate(names)]
        first = rank(key, hosts)
        self.assertEqual(sorted(first), sorted(names))
        shuffled = hosts[:]
        rnd.shuffle(shuffled)
        self.assertEqual(rank(key, shuffled), first)
        self.assertEqual(rank(key, hosts), first)

    def test_stable_across_processes(self) -> None:
        """blake2b, not hash(): a fixed key ranks fixed hosts the same in every run."""
        self.assertEqual(rank("m:0123", [("a", 1.0), ("b", 1.0), ("c", 1.0)]),
                         rank("m:0123", [("c", 1.0), ("a", 1.0), ("b", 1.0)]))
        self.assertAlmostEqual(score("k", "a", 1.0), score("k", "a", 1.0))
        self.assertEqual(score("k", "a", 2.0), 2 * score("k", "a", 1.0))
        self.assertEqual(score("k", "a", 0.0), 0.0)

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(st.integers(2, 6), st.integers(0, 2**32))
    def test_equal_hosts_even_home_split(self, n: int, seed: int) -> None:
        hosts = [(f"host{i}", 1.0) for i in range(n)]
        ks = keys(seed, 4000 * n)
        counts = homes(hosts, ks)
        for name, _ in hosts:
            self.assertLess(abs(counts[name] - 4000) / 4000, 0.10, counts)

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(_names.filter(lambda names: len(names) >= 2), st.integers(0, 2**32), st.data())
    def test_removing_a_host_moves_only_its_keys(self, names: list[str], seed: int, data: st.DataObject) -> None:
        hosts = [(n, float(1 + i % 3)) for i, n in enumerate(names)]
        gone = data.draw(st.sampled_from(names))
        rest = [h for h in hosts if h[0] != gone]
        for k in keys(seed, 500):
            before, after = rank(k, hosts)[0], rank(k, rest)[0]
            if before != gone:
                self.assertEqual(after, before, k)
            # and the rest of the ranking keeps its order
            self.assertEqual(rank(k, rest), [h for h in rank(k, hosts) if h != gone])

    @settings(max_examples=6, deadline=None, derandomize=True)
    @given(st.integers(0, 2**32))
    def test_weights_two_to_one(self, seed: int) -> None:
        counts = homes([("big", 2.0), ("small", 1.0)], keys(seed, 30000))
        self.assertLess(abs(counts["big"] / counts["small"] - 2.0) / 2.0, 0.10, counts)
        counts = homes([("a", 2.0), ("b", 1.0), ("c", 1.0)], keys(seed, 30000))
        self.assertLess(abs(counts["a"] / counts["b"] - 2.0) / 2.0, 0.10, counts)


_candidates = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 20), st.booleans()), min_size=1, max_size=6,
).map(lambda rows: [Candidate(f"h{i}", float(w), n, room) for i, (w, n, room) in enumerate(rows)])
_balance = st.floats(1.0, 3.0) | st.sampled_from([1.0, 1.25, 2.0])


class PickTests(SynchronousTestCase):
    @given(_keys, _candidates, _balance)
    def test_bound_never_exceeded(self, key: str, candidates: list[Candidate], balance: float) -> None:
        total = sum(c.weight for c in candidates)
        tier = sum(c.inflight for c in candidates)
        may = {c.name for c in candidates if c.has_room and c.inflight < bound(balance, tier, c.weight, total)}
        ranking = rank(key, [(c.name, c.weight) for c in candidates])
        got = pick(key, candidates, balance)
        if not may:
            self.assertIsNone(got)
            return
        assert got is not None
        self.assertIn(got.host, may)  # has room and below its bound
        self.assertEqual(got.host, [n for n in ranking if n in may][0])  # the first that may
        self.assertEqual(got.outcome, "home" if got.host == ranking[0] else "spill")

    @settings(max_examples=30, deadline=None)
    @given(st.lists(st.integers(1, 3), min_size=2, max_size=5), _balance, st.integers(0, 2**32))
    def test_loaded_tier_never_over_bound(self, weights: list[int], balance: float, seed: int) -> None:
        """Requests arriving one by one (and some ending) with one hot key: every host
        stays within its bound at the moment it takes a request, and some host with room
        may always take one (the bounds add up to more than the tier's in-flight)."""
        rnd = random.Random(seed)
        inflight = [0] * len(weights)
        total = float(sum(weights))
        for _ in range(300):
            if rnd.random() < 0.3 and sum(inflight):
                i = rnd.choice([i for i, n in enumerate(inflight) if n])
                inflight[i] -= 1
                continue
            key = "hot" if rnd.random() < 0.7 else f"k{rnd.random()}"
            candidates = [Candidate(f"h{i}", float(w), inflight[i], True) for i, w in enumerate(weights)]
            got = pick(key, candidates, balance)
            assert got is not None  # every host has room here
            i = int(got.host[1:])
            self.assertLess(inflight[i], bound(balance, sum(inflight), weights[i], total))
            inflight[i] += 1

    def test_home_then_spill(self) -> None:
        hosts = [Candidate("a", 1.0, 0, True), Candidate("b", 1.0, 0, True)]
        key = next(k for k in keys(1, 100) if rank(k, [("a", 1.0), ("b", 1.0)])[0] == "a")
        self.assertEqual(pick(key, hosts, 1.25), Pick("a", "home"))
        # a at 2 of a tier of 2: bound ceil(1.25 * 3 / 2) = 2, so b takes it
        busy = [Candidate("a", 1.0, 2, True), Candidate("b", 1.0, 0, True)]
        self.assertEqual(pick(key, busy, 1.25), Pick("b", "spill"))
        self.assertEqual(pick(key, busy, 2.0), Pick("a", "home"))  # ceil(2 * 3 / 2) = 3
        # no room on the home host: spill; no room anywhere: None
        self.assertEqual(pick(key, [Candidate("a", 1.0, 0, False), Candidate("b", 1.0, 0, True)], 1.25),
                         Pick("b", "spill"))
        self.assertIsNone(pick(key, [Candidate("a", 1.0, 0, False), Candidate("b", 1.0, 5, False)], 1.25))
        self.assertIsNone(pick(key, [], 1.25))

    def test_bound_arithmetic(self) -> None:
        self.assertEqual(bound(1.25, 0, 1.0, 2.0), 1)
        self.assertEqual(bound(1.0, 3, 1.0, 1.0), 4)
        self.assertEqual(bound(1.12, 24, 1.0, 1.0), 28)  # 1.12 * 25 is 28.000000000000004 in floats
        self.assertEqual(bound(1.5, 5, 2.0, 3.0), 6)
        self.assertEqual(bound(1.0, 0, 1.0, 3.0), math.ceil(1 / 3))
        with self.assertRaises(ValueError):
            bound(0.5, 0, 1.0, 1.0)
        with self.assertRaises(ValueError):
            pick("k", [Candidate("a", 1.0, 0, True)], 0.9)


class OneHostTests(SynchronousTestCase):
    """A one-host tier skips the hash (issue 14: per request on one-host routes) and
    answers as the ranking of one always would."""

    def test_one_host(self) -> None:
        self.assertEqual(rank("k", [("a", 1.0)]), ["a"])
        self.assertEqual(rank("k", [("a", 0.0)]), ["a"])
        self.assertEqual(pick("k", [Candidate("a", 2.0, 0, True)], 1.25), Pick("a", "home"))
        self.assertEqual(pick("k", [Candidate("a", 2.0, 5, True)], 1.25), Pick("a", "home"))  # bound: ceil(1.25 * 6) = 8
        self.assertIsNone(pick("k", [Candidate("a", 2.0, 5, False)], 1.25))  # no room
        self.assertIsNone(pick("k", [Candidate("a", 0.0, 0, True)], 1.25))  # no positive weight
