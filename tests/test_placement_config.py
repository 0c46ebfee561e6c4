"""Configuration of a route's ``placement`` and a host's ``models_max`` (docs/design.md
§Configuration, §Where models live): defaults, and one clear line per mistake."""

from __future__ import annotations

from typing import Any

from crossbar.config import PlacementSettings
from tests.test_config import _Case, _RouteCase, doc, parse


class PlacementConfigTests(_RouteCase):
    def test_absent_is_off(self) -> None:
        self.assertIsNone(self.route().placement)

    def test_empty_takes_the_defaults(self) -> None:
        self.assertEqual(self.route(placement={}).placement, PlacementSettings(5.0, None, ()))
        self.assertEqual(self.route(placement=None).placement, PlacementSettings(5.0, None, ()))

    def test_values(self) -> None:
        placement = self.route(placement={"spread_after": 2.5, "idle_unload": 900, "keep_loaded": ["m1", "m2"]}).placement
        self.assertEqual(placement, PlacementSettings(2.5, 900.0, ("m1", "m2")))
        self.assertEqual(self.route(placement={"spread_after": None}).placement, PlacementSettings(None, None, ()))

    def test_refused(self) -> None:
        self.rejected({"placement": 3}, "placement", "must be a mapping, not a number")
        self.rejected({"placement": {"spread": 1}}, "placement.spread",
                      "unknown key (expected one of: spread_after, idle_unload, keep_loaded)")
        self.rejected({"placement": {"spread_after": 0}}, "placement.spread_after",
                      "must be a positive number of seconds, not 0")
        self.rejected({"placement": {"idle_unload": -5}}, "placement.idle_unload",
                      "must be a positive number of seconds, not -5")
        self.rejected({"placement": {"keep_loaded": "m1"}}, "placement.keep_loaded",
                      "must be a list of model ids, not a string")
        self.rejected({"placement": {"keep_loaded": [""]}}, "placement.keep_loaded[0]", "must not be empty")
        self.rejected({"placement": {"keep_loaded": ["m", "m"]}}, "placement.keep_loaded[1]",
                      "model 'm' is listed twice")


class ModelsMaxConfigTests(_Case):
    def test_default_and_value(self) -> None:
        self.assertEqual(parse(doc(hosts={"a": "http://h"})).hosts["a"].models_max, 4)
        self.assertEqual(parse(doc(hosts={"a": {"url": "http://h", "models_max": 2}})).hosts["a"].models_max, 2)
        self.assertEqual(parse(doc(hosts={"a": {"url": "http://h", "models_max": 0}})).hosts["a"].models_max, 0)

    def test_refused(self) -> None:
        self.assertRejected(doc(hosts={"a": {"url": "http://h", "models_max": -1}}),
                            "x.yaml: hosts.a.models_max: must be at least 0, not -1")
        self.assertRejected(doc(hosts={"a": {"url": "http://h", "models_max": 1.5}}),
                            "x.yaml: hosts.a.models_max: must be a whole number, not 1.5")

    def test_kept_models_that_fill_every_place_are_warned_of(self) -> None:
        """Kept models are never evicted: as many as the route's places leave no place for
        another model (its requests wait, then 503): one warning line, the config loads."""
        hosts = {"a": {"url": "http://h", "models_max": 1}, "b": {"url": "http://i", "models_max": 2}}

        def warnings(kept: list[str], **extra: Any) -> tuple[str, ...]:
            routes = {"r": {"hosts": ["a", "b"], "placement": {"keep_loaded": kept}}}
            return parse(doc(hosts={**hosts, **extra}, routes=routes)).warnings

        self.assertEqual(warnings(["m1", "m2"]), ())
        self.assertEqual(warnings(["m1", "m2", "m3"]), (
            "x.yaml: routes.r.placement.keep_loaded: its 3 model(s) fill every place of the route's hosts "
            "(models_max in all: 3): requests for any other model will wait for a place that never frees "
            "(503 after queue.timeout)",))
        self.assertEqual(warnings(["m1", "m2", "m3"], b={"url": "http://i", "models_max": 0}), ())  # no limit
