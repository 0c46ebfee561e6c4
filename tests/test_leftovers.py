"""The workers' directories of supervisors that are gone (crossbar/process/leftovers.py):
a supervisor killed with SIGKILL left its ``crossbar-workers-*`` directory for ever; the
next one to start removes it, and never a live supervisor's directory.

A dead owner is a real process killed with SIGKILL after claiming its directory
(:func:`claimed_by_a_killed_process`; the supervisor's own part is in
tests/test_workers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from crossbar.process.leftovers import OWNER, PREFIX, claim, owner_gone, remove_leftovers

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def claimed_by_a_killed_process(parent: str) -> tuple[str, int]:
    """A directory claimed by a process that was then killed with SIGKILL: its path and
    the dead process's pid."""
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, tempfile, time\n"
         "from crossbar.process.leftovers import PREFIX, claim\n"
         "d = tempfile.mkdtemp(prefix=PREFIX, dir=sys.argv[1]); claim(d); os_ = __import__('os')\n"
         "os_.makedirs(d + '/metrics'); print(d, flush=True); time.sleep(60)\n", parent],
        stdout=subprocess.PIPE, cwd=_ROOT, text=True)
    assert child.stdout is not None
    path = child.stdout.readline().strip()
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    return path, child.pid


class LeftoverTests(SynchronousTestCase):
    def parent(self) -> str:
        parent = os.path.abspath(self.mktemp())
        os.makedirs(parent)
        return parent

    def test_only_the_directories_of_dead_owners_are_removed(self) -> None:
        parent = self.parent()
        dead, dead_pid = claimed_by_a_killed_process(parent)
        live = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
        fd = claim(live)  # this process: alive, holding the lock
        self.addCleanup(os.close, fd)
        unmarked = tempfile.mkdtemp(prefix=PREFIX, dir=parent)  # a supervisor making its own right now
        other = tempfile.mkdtemp(prefix="something-else-", dir=parent)
        with open(os.path.join(parent, PREFIX + "file"), "w"):
            pass
        self.assertEqual(owner_gone(dead), dead_pid)
        self.assertIsNone(owner_gone(live))
        self.assertIsNone(owner_gone(unmarked))
        self.assertEqual(remove_leftovers(parent), [(dead, dead_pid)])
        self.assertFalse(os.path.exists(dead))
        for kept in (live, unmarked, other, os.path.join(parent, PREFIX + "file")):
            self.assertTrue(os.path.exists(kept), kept)
        with open(os.path.join(live, OWNER)) as f:
            self.assertEqual(f.read(), f"{os.getpid()}\n")
        self.assertEqual(remove_leftovers(os.path.join(parent, "missing")), [])

    def test_a_reused_pid_does_not_keep_a_leftover(self) -> None:
        """The lock decides, not the pid: a dead owner's pid taken by a live process
        (here: this one's) still makes a leftover."""
        parent = self.parent()
        dead, _ = claimed_by_a_killed_process(parent)
        with open(os.path.join(dead, OWNER), "w") as f:
            f.write(f"{os.getpid()}\n")
        self.assertEqual(remove_leftovers(parent), [(dead, os.getpid())])
