"""The prometheus_client fence (crossbar/compat/prometheus.py): its version bound, the
private names it relies on (a failure names what moved), and its fallback to the public
``inc``/``observe`` (issue 30 item 1)."""

from __future__ import annotations

import pathlib
import tomllib
from importlib.metadata import version

from packaging.requirements import Requirement
from prometheus_client import CollectorRegistry, Counter, Histogram
from twisted.trial.unittest import SynchronousTestCase

import crossbar.compat.prometheus as fence


class PrometheusFenceTests(SynchronousTestCase):
    def test_pyproject_bounds_it_to_the_checked_range(self) -> None:
        with open(pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
        (req,) = [d for d in deps if d.name.replace("_", "-") == "prometheus-client"]
        (lo_major, lo_minor), (hi_major, hi_minor) = fence.CHECKED
        for inside in (f"{lo_major}.{lo_minor}.0", f"{hi_major}.{hi_minor}.0", f"{hi_major}.{hi_minor}.5"):
            self.assertIn(inside, req.specifier)
        for outside in (f"{lo_major}.{lo_minor - 1}.9", f"{hi_major}.{hi_minor + 1}.0", f"{hi_major + 1}.0.0"):
            self.assertNotIn(outside, req.specifier)
        self.assertIn(version("prometheus_client"), req.specifier)
        self.assertTrue(fence.version_checked(0, 21) and not fence.version_checked(0, 3))

    def test_nothing_moved_in_this_version(self) -> None:
        self.assertEqual(fence.moved(), [], "prometheus_client moved what crossbar/compat/prometheus.py relies on")
        self.assertIsNone(fence.FALLBACK)

    def test_moved_names_it(self) -> None:
        from prometheus_client import values

        self.patch(values, "MutexValue", None)
        self.assertEqual(fence.moved(), ["prometheus_client.values.MutexValue (it is gone)"])

    def test_fallback_is_the_public_api(self) -> None:
        self.patch(fence, "FALLBACK", "prometheus_client 9.1 is outside the range")
        registry = CollectorRegistry()
        counter = Counter("c", "c", ["l"], registry=registry).labels("x")
        histogram = Histogram("h", "h", ["l"], registry=registry).labels("x")
        self.assertEqual(fence.adder(counter), counter.inc)
        self.assertEqual(fence.observer(histogram), histogram.observe)
