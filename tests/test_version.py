"""crossbar's version is written once (``crossbar.__version__``; pyproject.toml reads it)
and ``twistd crossbar --version`` shows it, through a real ``twistd``."""

from __future__ import annotations

import os
import subprocess
import tomllib

import twisted
from twisted.trial.unittest import SynchronousTestCase

import crossbar
from tests.process import ROOT, twistd_argv, twistd_env


def _twistd_crossbar(*args: str) -> subprocess.CompletedProcess[str]:
    argv = twistd_argv("unused.yaml", ())
    argv = argv[: argv.index("crossbar") + 1] + list(args)
    return subprocess.run(argv, env=twistd_env(), capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


class VersionTests(SynchronousTestCase):
    def test_twistd_crossbar_version(self) -> None:
        done = _twistd_crossbar("--version")
        self.assertEqual((done.returncode, done.stderr), (0, ""))
        self.assertEqual(done.stdout, f"crossbar {crossbar.__version__} (Twisted {twisted.__version__})\n")

    def test_help_lists_version(self) -> None:
        done = _twistd_crossbar("--help")
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("--version", done.stdout)

    def test_written_once(self) -> None:
        """pyproject.toml takes the version from crossbar/__init__.py, not a copy."""
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            project = tomllib.load(f)
        self.assertNotIn("version", project["project"])
        self.assertIn("version", project["project"]["dynamic"])
        self.assertEqual(project["tool"]["setuptools"]["dynamic"]["version"], {"attr": "crossbar.__version__"})
        self.assertRegex(crossbar.__version__, r"^\d+\.\d+\.\d+")
