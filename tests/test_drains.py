"""One process's drained hosts (crossbar/state/drains.py): the rules a worker, its
supervisor and an instance apply alike (docs/design.md §Operations)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from crossbar.state.drains import HostDrains


class HostDrainsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.hosts = {"a", "b", "c"}
        self.drains = HostDrains(lambda: self.hosts)

    def test_only_configured_hosts_drain(self) -> None:
        self.assertTrue(self.drains.set("a", True))
        self.assertFalse(self.drains.set("zz", True))
        self.assertEqual(self.drains.drained, {"a"})
        self.assertTrue(self.drains.set("a", False))
        self.assertEqual(self.drains.drained, set())

    def test_changes_of_news_and_of_a_whole_set(self) -> None:
        self.drains.set("a", True)
        self.assertEqual(self.drains.changes({"a": True, "b": True, "zz": True}, whole=False), {"b": True})
        self.assertEqual(self.drains.changes({"b": True}, whole=True), {"a": False, "b": True})
        self.assertEqual(self.drains.drained, {"a"})  # changes say, set does

    def test_a_reload_forgets_removed_hosts(self) -> None:
        self.drains.set("a", True)
        self.drains.set("c", True)
        self.hosts = {"a", "b"}
        self.drains.forget_removed()
        self.assertEqual(self.drains.drained, {"a"})
