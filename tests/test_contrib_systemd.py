"""contrib/systemd agrees with itself (docs/design.md §Operations; README "Running in
production"): the unit requires the environment file that supplies the variables the
shipped example config needs, the config parses with that file's variables (and not
without them), and the unit's stop timeout covers the example's drain."""

from __future__ import annotations

import os
import re

from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import ConfigError, parse_config

CONTRIB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "contrib", "systemd")


def _read(name: str) -> str:
    with open(os.path.join(CONTRIB, name), encoding="utf-8") as f:
        return f.read()


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` settings of a unit file (all sections), continuation lines joined."""
    out: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def env_file(text: str) -> dict[str, str]:
    """The variables of a systemd ``EnvironmentFile`` (``KEY=value`` lines, comments)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


class SystemdContribTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.unit = unit_settings(_read("crossbar.service"))
        self.config_text = _read("crossbar.yaml")
        self.env = env_file(_read("crossbar.env"))

    def test_environment_file_is_required(self) -> None:
        [env_path] = self.unit["EnvironmentFile"]
        self.assertFalse(env_path.startswith("-"), "the example config needs it: it must not be optional")
        self.assertEqual(os.path.basename(env_path), "crossbar.env")

    def test_config_path_is_the_shipped_example(self) -> None:
        [exec_start] = self.unit["ExecStart"]
        config = exec_start.split("--config", 1)[1].split()[0]
        self.assertEqual(os.path.basename(config), "crossbar.yaml")
        self.assertEqual(os.path.dirname(config), os.path.dirname(self.unit["EnvironmentFile"][0].lstrip("-")))

    def test_example_config_needs_and_gets_its_variables(self) -> None:
        names = set(re.findall(r"\$\{(\w+)\}", self.config_text))
        self.assertTrue(names, "the example shows a ${NAME} reference")
        self.assertLessEqual(names, set(self.env), "every reference is set by crossbar.env")
        config = parse_config(self.config_text, "crossbar.yaml", environ=self.env)
        self.assertEqual(config.ops.token, self.env["CROSSBAR_OPS_TOKEN"])
        self.assertRaises(ConfigError, parse_config, self.config_text, "crossbar.yaml", environ={})

    def test_stop_timeout_covers_the_drain(self) -> None:
        config = parse_config(self.config_text, "crossbar.yaml", environ=self.env)
        [timeout] = self.unit["TimeoutStopSec"]
        self.assertGreater(float(timeout), config.drain.delay + config.drain.grace)

    def test_readme_installs_the_venv_the_unit_runs(self) -> None:
        """Issue 20 item 11: the operations guide's production install is a venv of its own, the
        one ``ExecStart`` runs, not the demo's test ``.venv``; and the unit's
        ``--logger`` names a module crossbar has."""
        [exec_start] = self.unit["ExecStart"]
        twistd = exec_start.split()[0]
        venv = os.path.dirname(os.path.dirname(twistd))
        with open(os.path.join(os.path.dirname(os.path.dirname(CONTRIB)), "docs", "operations.md"), encoding="utf-8") as f:
            readme = f.read()
        install = readme.split("### systemd", 1)[1].split("`contrib/systemd/crossbar.service` runs", 1)[0]
        self.assertIn(f"python3 -m venv {venv}", install)
        self.assertIn(f"{venv}/bin/pip install", install)
        self.assertNotIn(".venv/", install.replace("not the demo's .venv", ""))
        self.assertIn("--check", install)
        logger = re.search(r"--logger=(\S+)", exec_start)
        assert logger is not None
        module, _, name = logger.group(1).rpartition(".")
        import importlib

        self.assertTrue(callable(getattr(importlib.import_module(module), name)), logger.group(1))

    def test_descriptor_limit_is_raised(self) -> None:
        """Issue 20 item 4: the shipped unit sets ``LimitNOFILE`` (systemd's default
        soft limit of 1024 let 1,100 silent connections lock every client out); the
        connection bound follows from it."""
        from crossbar.proxy.connections import connection_limit

        [limit] = self.unit["LimitNOFILE"]
        self.assertGreaterEqual(int(limit), 65536)
        self.assertGreaterEqual(connection_limit(int(limit)), 30000)
