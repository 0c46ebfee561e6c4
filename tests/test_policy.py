"""Rule 7 as one decision (docs/design.md §The proxy, rule 7): :func:`crossbar.proxy.policy.decide`
on every event, without sockets."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from crossbar.hosts.balance import Verdict
from crossbar.proxy.attempt import FailureKind
from crossbar.proxy.policy import Action, Decision, decide
from crossbar.proxy.relay import RelayEnd


class DecideTests(SynchronousTestCase):
    def test_connect_failure_marks_down_and_fails_over(self) -> None:
        self.assertEqual(decide(FailureKind.CONNECT, "a", []), Decision(Action.FAIL_OVER, mark_down=True))
        self.assertEqual(decide(FailureKind.CONNECT, "b", ["a"]), Decision(Action.FAIL_OVER, mark_down=True))

    def test_failure_after_sending_is_a_502_naming_the_host_without_retry(self) -> None:
        self.assertEqual(
            decide(FailureKind.REQUEST, "b", ["a"]),
            Decision(Action.ANSWER, mark_down=True, code=502, message="upstream failed", host="b"),
        )

    def test_no_head_in_time_is_a_504(self) -> None:
        self.assertEqual(
            decide(FailureKind.FIRST_BYTE_TIMEOUT, "a", []),
            Decision(Action.ANSWER, mark_down=True, code=504, message="upstream timed out", host="a"),
        )

    def test_no_head_in_time_from_a_host_alive_meanwhile_marks_nothing(self) -> None:
        """Issue 20 item 5: busy is not dead."""
        self.assertEqual(
            decide(FailureKind.FIRST_BYTE_TIMEOUT, "a", [], alive=True),
            Decision(Action.ANSWER, mark_down=False, code=504, message="upstream timed out", host="a"),
        )
        for kind in (FailureKind.CONNECT, FailureKind.REQUEST):  # only the timeout is spared
            self.assertTrue(decide(kind, "a", [], alive=True).mark_down, kind)

    def test_client_stall_cuts_the_client_and_marks_nothing(self) -> None:
        self.assertEqual(decide(RelayEnd.CLIENT_STALL, "a", []), Decision(Action.ABORT_CLIENT))

    def test_host_dead_or_silent_mid_answer_cuts_the_client(self) -> None:
        for how in (RelayEnd.MID_ANSWER, RelayEnd.IDLE_TIMEOUT):
            self.assertEqual(decide(how, "a", []), Decision(Action.ABORT_CLIENT, mark_down=True), how)

    def test_clean_end_finishes_and_our_stop_does_nothing(self) -> None:
        self.assertEqual(decide(RelayEnd.COMPLETE, "a", []), Decision(Action.FINISH))
        self.assertEqual(decide(RelayEnd.STOPPED, "a", []), Decision(Action.NOTHING))

    def test_no_host_left(self) -> None:
        self.assertEqual(decide(Verdict.NO_HOST, None, []),
                         Decision(Action.ANSWER, code=503, message="no healthy host"))
        self.assertEqual(decide(Verdict.NO_HOST, None, ["a", "b"]),
                         Decision(Action.ANSWER, code=502, message="upstream failed", host="b"))

    def test_no_host_serves_the_model(self) -> None:
        for tried in ([], ["a"]):
            self.assertEqual(decide(Verdict.NO_MODEL, None, tried),
                             Decision(Action.ANSWER, code=404, message="model not found"))

    def test_only_real_host_failures_mark_down(self) -> None:
        events = [*FailureKind, *RelayEnd, Verdict.NO_HOST, Verdict.NO_MODEL]
        marked = {e for e in events if decide(e, "a", []).mark_down}  # type: ignore[arg-type]
        self.assertEqual(marked, {FailureKind.CONNECT, FailureKind.REQUEST, FailureKind.FIRST_BYTE_TIMEOUT,
                                  RelayEnd.MID_ANSWER, RelayEnd.IDLE_TIMEOUT})
