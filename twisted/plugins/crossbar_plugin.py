"""twistd plugin: ``twistd -n crossbar --config crossbar.yaml`` (docs/design.md §Shape)."""

from __future__ import annotations

import os
import sys
from typing import Any

from twisted.application.service import IServiceMaker
from twisted.plugin import IPlugin
from twisted.python import usage
from zope.interface import implementer


class Options(usage.Options):
    optParameters = [
        ["config", "c", "crossbar.yaml", "Path to the crossbar YAML configuration."],
        ["worker-stall", None, None,
         "With workers: seconds a ready worker may send nothing before it is killed and restarted (default 30).",
         float],
    ]
    optFlags = [["check", None, "Validate the configuration, print one line and exit (0: valid, 1: not)."]]

    def postOptions(self) -> None:
        stall = self["worker-stall"]
        if stall is not None and not 0 < stall < 86400:
            raise usage.UsageError("--worker-stall: seconds, more than 0")

    def opt_version(self) -> None:
        """Print crossbar's version (and Twisted's) and exit."""
        import twisted

        from crossbar import __version__

        print(f"crossbar {__version__} (Twisted {twisted.__version__})")
        sys.exit(0)


@implementer(IServiceMaker, IPlugin)
class CrossbarServiceMaker:
    tapname = "crossbar"
    description = "Streaming reverse proxy for a fleet of llama.cpp llama-server hosts."
    options = Options

    def makeService(self, options: Options) -> Any:
        from crossbar.config import ConfigError, load_config
        from crossbar.process.daemon import make_daemon
        from crossbar.process.startup import StartupGuard, check_config, report_and_exit

        # Absolute now: twistd changes directory (--rundir, daemon mode) after this, and
        # a reload (SIGHUP) or a worker reads the file again later.
        path = os.path.abspath(options["config"])
        if options["check"]:
            sys.exit(check_config(path, sys.stdout, sys.stderr))
        try:
            service = make_daemon(load_config(path), getattr(options, "parent", None), stall=options["worker-stall"])
            return StartupGuard(service, path, twistd=getattr(options, "parent", None))
        except ConfigError as e:
            report_and_exit(e, sys.stderr, log=False)


serviceMaker = CrossbarServiceMaker()
