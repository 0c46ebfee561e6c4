"""The exchange's phases (crossbar/proxy/phase.py): every move in NEXT is allowed, any
other raises (issue 30 item 7: illegal moves were dropped silently)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from crossbar.proxy.phase import NEXT, IllegalMove, Phase, Phased


class PhaseTests(SynchronousTestCase):
    def test_every_listed_move_is_allowed_and_every_other_raises(self) -> None:
        for start in Phase:
            for to in Phase:
                thing = Phased()
                thing.phase = start
                if to in NEXT[start]:
                    thing._enter(to)
                    self.assertIs(thing.phase, to)
                else:
                    error = self.assertRaises(IllegalMove, thing._enter, to)
                    self.assertEqual(str(error), f"Phased: {start.value} -> {to.value}")
                    self.assertIs(thing.phase, start)

    def test_nothing_leaves_the_end(self) -> None:
        self.assertEqual(NEXT[Phase.ENDED], frozenset())
