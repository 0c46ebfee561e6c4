"""Socket-free unit tests of :mod:`crossbar.state.inflight` (docs/design.md §Choosing a host,
rule 2: the one in-flight count that status, metrics and choosing read)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from crossbar.state.inflight import Inflight, Lease


class InflightTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.released = 0
        self.inflight = Inflight(on_release=self.count_release)

    def count_release(self) -> None:
        self.released += 1

    def test_empty(self) -> None:
        self.assertEqual(self.inflight.host("a"), 0)
        self.assertEqual(self.inflight.by_host(), {})
        self.assertEqual(self.inflight.by_route_host(), {})

    def test_counts_per_host_and_per_route_host(self) -> None:
        self.inflight.enter("chat", "a")
        self.inflight.enter("chat", "a")
        self.inflight.enter("embed", "a")
        self.inflight.enter("chat", "b")
        self.assertEqual(self.inflight.host("a"), 3)
        self.assertEqual(self.inflight.host("b"), 1)
        self.assertEqual(self.inflight.by_host(), {"a": 3, "b": 1})
        self.assertEqual(
            self.inflight.by_route_host(), {("chat", "a"): 2, ("embed", "a"): 1, ("chat", "b"): 1}
        )

    def test_release(self) -> None:
        lease = self.inflight.enter("chat", "a")
        other = self.inflight.enter("embed", "a")
        lease.release()
        self.assertEqual(self.inflight.host("a"), 1)
        self.assertEqual(self.inflight.by_route_host(), {("chat", "a"): 0, ("embed", "a"): 1})
        self.assertEqual(self.released, 1)
        other.release()
        self.assertEqual(self.inflight.host("a"), 0)
        self.assertEqual(self.released, 2)

    def test_released_host_leaves_by_host_but_pair_reads_zero(self) -> None:
        """A host back to 0 leaves ``by_host``; its (route, host) pair stays at 0 so a
        metric once seen reads 0 rather than vanishing."""
        self.inflight.enter("chat", "a").release()
        self.assertEqual(self.inflight.by_host(), {})
        self.assertEqual(self.inflight.by_route_host(), {("chat", "a"): 0})

    def test_release_is_idempotent(self) -> None:
        lease = self.inflight.enter("chat", "a")
        keep = self.inflight.enter("chat", "a")
        lease.release()
        lease.release()
        lease.release()
        self.assertEqual(self.inflight.host("a"), 1)
        self.assertEqual(self.inflight.by_route_host(), {("chat", "a"): 1})
        self.assertEqual(self.released, 1)  # on_release once per lease
        self.assertIsNone(lease.host)
        self.assertEqual(keep.host, "a")

    def test_never_negative(self) -> None:
        """Leaving a host with nothing counted (a bug elsewhere) leaves the count at 0."""
        self.inflight._leave("chat", "a")
        self.assertEqual(self.inflight.host("a"), 0)
        self.assertEqual(self.inflight.by_host(), {})
        self.assertNotIn(("chat", "a"), self.inflight.by_route_host())
        lease = self.inflight.enter("chat", "a")
        self.assertEqual(self.inflight.host("a"), 1)
        lease.release()
        self.inflight._leave("chat", "a")
        self.assertEqual(self.inflight.host("a"), 0)
        self.assertEqual(self.inflight.by_route_host(), {("chat", "a"): 0})

    def test_failover_moves_the_count(self) -> None:
        """A failover releases the first host's lease and enters the next host."""
        lease = self.inflight.enter("chat", "a")
        lease.release()
        moved = self.inflight.enter("chat", "b")
        self.assertEqual(self.inflight.by_host(), {"b": 1})
        self.assertEqual(self.released, 1)
        self.assertEqual(moved.route, "chat")

    def test_on_release_is_optional(self) -> None:
        inflight = Inflight()
        lease = inflight.enter("chat", "a")
        self.assertIsInstance(lease, Lease)
        lease.release()
        self.assertEqual(inflight.host("a"), 0)

    def test_on_release_sees_the_new_count(self) -> None:
        """on_release runs after the count dropped (a queue listening there may use the
        freed slot at once)."""
        seen: list[int] = []
        inflight = Inflight(on_release=lambda: seen.append(inflight.host("a")))
        inflight.enter("chat", "a")
        inflight.enter("chat", "a").release()
        self.assertEqual(seen, [1])
