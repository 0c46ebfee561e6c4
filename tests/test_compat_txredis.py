"""The txredisapi fence (crossbar/compat/txredis.py) and Twisted's touchpoint 10
(``ClientService._log``): the version bound, what moved, and the fallback to
txredisapi's own connecting (issue 30 item 1)."""

from __future__ import annotations

import pathlib
import tomllib
from importlib.metadata import version
from typing import Any

import txredisapi
from packaging.requirements import Requirement
from twisted.application.internet import ClientService
from twisted.trial.unittest import SynchronousTestCase

import crossbar.compat.twisted as twisted_fence
import crossbar.compat.txredis as fence


class TxredisFenceTests(SynchronousTestCase):
    def test_pyproject_bounds_it_to_the_checked_range(self) -> None:
        with open(pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
        (req,) = [d for d in deps if d.name == "txredisapi"]
        (lo_major, lo_minor), (hi_major, hi_minor) = fence.CHECKED
        for inside in (f"{lo_major}.{lo_minor}.0", f"{hi_major}.{hi_minor}.9"):
            self.assertIn(inside, req.specifier)
        for outside in (f"{lo_major}.{lo_minor - 1}.9", f"{hi_major}.{hi_minor + 1}.0", f"{hi_major + 1}.0.0"):
            self.assertNotIn(outside, req.specifier)
        self.assertIn(version("txredisapi"), req.specifier)

    def test_nothing_moved_in_this_version(self) -> None:
        self.assertEqual(fence.moved(), [], "txredisapi moved what crossbar/compat/txredis.py relies on")
        self.assertIsNone(fence.FALLBACK)
        self.assertIsNot(fence.Protocol, txredisapi.RedisProtocol)  # hiredis packs the commands
        self.assertIsNot(twisted_fence.QuietClientService, ClientService)

    def test_moved_names_it(self) -> None:
        self.patch(txredisapi, "_SlotFactory", None)
        self.patch(txredisapi._PoolSlot, "_retryDelay", None)
        self.assertEqual(fence.moved(), ["txredisapi._PoolSlot._retryDelay (it is gone)",
                                         "txredisapi._SlotFactory (it is gone)"])

    def test_client_service_log_moved(self) -> None:
        self.patch(ClientService, "_log", None)
        self.assertIn("touchpoint 10: ClientService._log (not a Logger)", twisted_fence.moved())

    def test_quiet_service_logs_nothing(self) -> None:
        from twisted.logger import globalLogPublisher

        events: list[Any] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        twisted_fence.QuietClientService._log.info("attempt")
        ClientService._log.info("attempt")  # Twisted's own does reach the log
        self.assertEqual([e["log_format"] for e in events], ["attempt"])

    def test_fallback_is_start_connecting(self) -> None:
        self.patch(fence, "FALLBACK", "txredisapi 9.1 is outside the range")
        calls: list[Any] = []

        class Factory:
            poolsize = 1

            def startConnecting(self, endpoint: Any) -> None:
                calls.append(endpoint)

        fence.connect(Factory(), "endpoint", on_lost=calls.append, on_first_failure=calls.append)
        self.assertEqual(calls, ["endpoint"])
