"""A newcomer's first run (README "After the quick start"): the README says where
``twistd`` is after ``./demo/run``, how to start real hosts where the shipped
``crossbar.yaml`` expects them (with commands the tool accepts), and what
``KEEP=1 ./demo/run`` does, which demo/run really implements."""

from __future__ import annotations

import os
import re
import shlex
from urllib.parse import urlsplit

from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import load_config
from tests.process import ROOT
from tools.llama_server import build_parser


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


class FirstRunTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.readme = _read("README.md")

    def test_twistd_on_path_after_demo(self) -> None:
        self.assertIn(". .venv/bin/activate", self.readme)
        self.assertIn('export PATH="$PWD/.venv/bin:$PATH"', self.readme)
        self.assertIn(".venv/bin/twistd", _read("demo", "run"))  # where demo/run puts it
        self.assertIn("twistd crossbar --version", self.readme)

    def test_real_hosts_for_the_shipped_config(self) -> None:
        """Every host of crossbar.yaml gets a ``tools/llama_server.py start PORT`` line
        the tool's own parser accepts; the single-mode one serves the default model."""
        config = load_config(os.path.join(ROOT, "crossbar.yaml"), environ={})
        commands = [shlex.split(line.split("#", 1)[0])
                    for line in self.readme.splitlines() if "tools/llama_server.py start" in line]
        started = {}
        for argv in commands:
            args = build_parser().parse_args(argv[argv.index("tools/llama_server.py") + 1:])
            started[args.port] = args.mode
        for name, host in config.hosts.items():
            url = urlsplit(host.url.url)
            self.assertEqual(url.hostname, "127.0.0.1", name)
            self.assertIn(url.port, started, f"README starts no host for {name} ({host.url.url})")
        single = [p for p, mode in started.items() if mode == "single"]
        self.assertTrue(single)
        for route in config.routes.values():
            self.assertEqual(route.default_model, "tiny-a")  # what single mode serves
        listen_port = re.search(r"tcp:(\d+)", config.listen)
        assert listen_port is not None
        self.assertIn(f"demo/chat.py {listen_port.group(1)} --route {next(iter(config.routes))}", self.readme)

    def test_keep_documented_and_implemented(self) -> None:
        self.assertIn("KEEP=1 ./demo/run", self.readme)
        self.assertIn('"${KEEP:-0}" = 1', _read("demo", "run"))

    def test_gibberish_explained(self) -> None:
        self.assertRegex(self.readme, r"gibberish on purpose: `tiny-a` and `tiny-b` are ~1 MB\s+random-weight")


class CIRunTests(SynchronousTestCase):
    def test_ci_run_shows_skip_reasons(self) -> None:
        """.ci/run's pytest call reports why each skipped test skipped (``-rs``)."""
        [call] = [line for line in _read(".ci", "run").splitlines() if "-m pytest" in line]
        argv = shlex.split(call)
        self.assertTrue(any(a.startswith("-r") and "s" in a[2:] for a in argv), call)
