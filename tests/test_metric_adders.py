"""crossbar.ops.metrics.adder / observer: a request's token counters and generation speed
histogram updated without prometheus_client's per-call checks (issue 19's cost) must
expose exactly what the public ``inc``/``observe`` would, in one process and with workers
(prometheus_client's multiprocess mode, docs/design.md §Workers)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString
from twisted.trial.unittest import SynchronousTestCase

from crossbar.compat.prometheus import adder, observer
from crossbar.ops.metrics import Metrics

AMOUNTS = [0, 1, 7, 2**31 - 1, 3, 0.5]
SPEEDS = [0.0, 0.5, 1.0, 1.0000001, 2.0, 34.99, 35.0, 122.38, 9999.0, 10000.0, 10000.5, 1e8, 5.0, 5]


def _series(metrics: Metrics, fast: bool) -> None:
    counter = metrics.tokens.labels("r", "h", "k", "m", "prompt")
    histogram = metrics.generation_speed.labels("h", "m")
    inc = adder(counter) if fast else counter.inc
    observe = observer(histogram) if fast else histogram.observe
    for amount in AMOUNTS:
        inc(amount)
    for speed in SPEEDS:
        observe(speed)


def _text(registry: CollectorRegistry) -> list[str]:
    """The exposition without the ``_created`` lines (timestamps)."""
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


class AdderTests(SynchronousTestCase):
    def test_same_exposition_as_inc_and_observe(self) -> None:
        public, fast = Metrics(), Metrics()
        _series(public, False)
        _series(fast, True)
        self.assertEqual(_text(public.registry), _text(fast.registry))
        self.assertIn('crossbar_tokens_total{host="h",key="k",kind="prompt",model="m",route="r"} '
                      + floatToGoString(sum(AMOUNTS)), _text(fast.registry))

    def test_with_workers_multiprocess_files(self) -> None:
        """Each worker writes its own file; the scrape sums them: the same totals."""
        saved, saved_dir = values.ValueClass, os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self.addCleanup(setattr, values, "ValueClass", saved)
        self.addCleanup(lambda: os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None) if saved_dir is None
                        else os.environ.__setitem__("PROMETHEUS_MULTIPROC_DIR", saved_dir))
        totals = []
        for fast in (False, True):
            directory = tempfile.mkdtemp(prefix="adders.")
            self.addCleanup(shutil.rmtree, directory, True)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
            for pid in (101, 102):  # two workers
                values.ValueClass = values.MultiProcessValue(lambda pid=pid: pid)  # type: ignore[misc]
                metrics = Metrics()
                _series(metrics, fast)
                if fast:  # the file's value written without its lock and pid check (issue 33)
                    counter = metrics.tokens.labels("r", "h", "k", "m", "prompt")
                    self.assertEqual(adder(counter).__qualname__, "_file_inc.<locals>.add",
                                     "prometheus_client's MmapedValue moved (_file, _key, _value, _timestamp)")
            registry = CollectorRegistry()
            MultiProcessCollector(registry, directory)
            totals.append(_text(registry))
        self.assertEqual(totals[0], totals[1])
        self.assertTrue(any(line.startswith("crossbar_tokens_total") and line.endswith(" " + floatToGoString(2 * sum(AMOUNTS)))
                            for line in totals[1]), totals[1])

    def test_children_without_the_parts_get_their_public_methods(self) -> None:
        class Child:
            def __init__(self) -> None:
                self.calls: list[Any] = []

            def inc(self, amount: float) -> None:
                self.calls.append(("inc", amount))

            def observe(self, amount: float) -> None:
                self.calls.append(("observe", amount))

        child = Child()
        adder(child)(3)
        observer(child)(2.5)
        self.assertEqual(child.calls, [("inc", 3), ("observe", 2.5)])

    def test_a_parent_metric_is_not_bypassed(self) -> None:
        """A labelled metric without its labels raises like inc/observe do."""
        registry = CollectorRegistry()
        counter = Counter("c", "c", ("a",), registry=registry)
        histogram = Histogram("h", "h", ("a",), registry=registry)
        self.assertRaises(ValueError, adder(counter), 1)
        self.assertRaises(ValueError, observer(histogram), 1.0)
