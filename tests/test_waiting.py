"""Socket-free unit tests of :class:`crossbar.waiting.Condition` ("wait until X")."""

from __future__ import annotations

from twisted.internet.defer import CancelledError
from twisted.trial.unittest import SynchronousTestCase

from crossbar.waiting import Condition


class _Flag:
    """A predicate the test flips, counting how often it is read."""

    def __init__(self, value: bool = False) -> None:
        self.value = value
        self.reads = 0

    def __call__(self) -> bool:
        self.reads += 1
        return self.value


class ConditionTests(SynchronousTestCase):
    def test_fires_at_once_when_true(self) -> None:
        condition = Condition(_Flag(True))
        self.assertIsNone(self.successResultOf(condition.wait()))

    def test_waits_while_false(self) -> None:
        condition = Condition(_Flag(False))
        self.assertNoResult(condition.wait())

    def test_check_while_false_fires_nothing(self) -> None:
        flag = _Flag(False)
        condition = Condition(flag)
        d = condition.wait()
        condition.check()
        self.assertNoResult(d)

    def test_check_fires_every_waiter_once_true(self) -> None:
        flag = _Flag(False)
        condition = Condition(flag)
        first, second = condition.wait(), condition.wait()
        flag.value = True
        condition.check()
        self.assertIsNone(self.successResultOf(first))
        self.assertIsNone(self.successResultOf(second))

    def test_waiters_fire_once(self) -> None:
        """A second check (or the predicate turning false and true again) fires nothing
        twice: a Deferred fired twice would raise AlreadyCalledError."""
        flag = _Flag(False)
        condition = Condition(flag)
        fired: list[None] = []
        condition.wait().addCallback(fired.append)
        flag.value = True
        condition.check()
        condition.check()
        flag.value = False
        condition.check()
        flag.value = True
        condition.check()
        self.assertEqual(fired, [None])

    def test_check_without_waiters_does_not_read_the_predicate(self) -> None:
        flag = _Flag(True)
        condition = Condition(flag)
        condition.check()
        self.assertEqual(flag.reads, 0)

    def test_new_waiter_after_firing_waits_for_the_next_time(self) -> None:
        flag = _Flag(False)
        condition = Condition(flag)
        condition.wait()
        flag.value = True
        condition.check()
        flag.value = False
        later = condition.wait()
        self.assertNoResult(later)
        flag.value = True
        condition.check()
        self.assertIsNone(self.successResultOf(later))

    def test_cancel_forgets_the_waiter(self) -> None:
        flag = _Flag(False)
        condition = Condition(flag)
        cancelled, kept = condition.wait(), condition.wait()
        cancelled.cancel()
        self.failureResultOf(cancelled, CancelledError)
        flag.value = True
        condition.check()  # must not fire the cancelled Deferred again
        self.assertIsNone(self.successResultOf(kept))
        self.assertEqual(condition._waiters, [])

    def test_cancel_after_firing_is_harmless(self) -> None:
        flag = _Flag(False)
        condition = Condition(flag)
        d = condition.wait()
        flag.value = True
        condition.check()
        d.cancel()  # already fired: nothing happens
        self.assertIsNone(self.successResultOf(d))

    def test_waiter_may_wait_again_from_its_callback(self) -> None:
        """A waiter that waits again while being fired gets a Deferred that fires at
        once (the predicate still holds), and check() does not fire it twice."""
        flag = _Flag(False)
        condition = Condition(flag)
        again: list[object] = []
        condition.wait().addCallback(lambda _: again.append(condition.wait()))
        flag.value = True
        condition.check()
        self.assertEqual(len(again), 1)
        self.assertIsNone(self.successResultOf(again[0]))  # type: ignore[arg-type]

    def test_waiter_cancelled_by_another_waiter_while_firing(self) -> None:
        """One waiter's callback cancels another waiter (e.g. the first of two races
        wins): check() must not fire the cancelled one (AlreadyCalledError)."""
        flag = _Flag(False)
        condition = Condition(flag)
        first, second = condition.wait(), condition.wait()
        first.addCallback(lambda _: second.cancel())
        flag.value = True
        condition.check()
        self.assertIsNone(self.successResultOf(first))
        self.failureResultOf(second, CancelledError)
