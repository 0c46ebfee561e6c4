"""resident_models: which models a ``/v1/models`` answer lists as resident (docs/design.md
§"The health table", rule 2), against recorded real llama-server answers and edge cases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.trial.unittest import TestCase

from crossbar.hosts.models import ModelsError, resident_models

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def doc(*entries: Any) -> bytes:
    return json.dumps({"object": "list", "data": list(entries)}).encode()


def routed(model_id: str, value: str, **extra: Any) -> dict[str, Any]:
    return {"id": model_id, "status": {"value": value, **extra}}


class RecordedShapesTests(TestCase):
    def test_single_mode(self) -> None:
        """Recorded llama-server single-model answer: no status -> loaded."""
        self.assertEqual(resident_models(fixture("llama_models_single.json")), ("tiny-a",))

    def test_router_mode_one_loaded(self) -> None:
        """Recorded router answer: tiny-a unloaded, tiny-b loaded."""
        self.assertEqual(resident_models(fixture("llama_models_router.json")), ("tiny-b",))

    def test_router_mode_loading(self) -> None:
        """Recorded router answer while tiny-b loads: loading is not loaded."""
        self.assertEqual(resident_models(fixture("llama_models_router_loading.json")), ())

    def test_router_mode_all_unloaded(self) -> None:
        self.assertEqual(resident_models(fixture("llama_models_router_unloaded.json")), ())


class StatusTests(TestCase):
    def test_only_loaded_status_counts(self) -> None:
        body = doc(
            routed("a", "loaded"),
            routed("b", "loading"),
            routed("c", "unloaded"),
            routed("d", "sleeping"),
            routed("e", "loaded", failed=True),
            routed("f", "unloaded", failed=True, exit_code=1),
            routed("g", "loaded", failed=False),
        )
        self.assertEqual(resident_models(body), ("a", "g"))

    def test_entries_without_status_count(self) -> None:
        """Other OpenAI-compatible servers: every listed model is resident."""
        body = doc({"id": "x", "object": "model"}, {"id": "y"}, routed("z", "unloaded"))
        self.assertEqual(resident_models(body), ("x", "y"))


class IdsTests(TestCase):
    def test_empty_ids_and_duplicates_dropped_sorted(self) -> None:
        body = doc({"id": "b"}, {"id": ""}, {"id": "a"}, {"id": "b"}, {"id": "C"}, routed("a", "loaded"))
        self.assertEqual(resident_models(body), ("C", "a", "b"))

    def test_empty_list(self) -> None:
        self.assertEqual(resident_models(b'{"data": []}'), ())


class BadBodyTests(TestCase):
    def assertModelsError(self, body: bytes, expected: str) -> None:
        with self.assertRaises(ModelsError) as cm:
            resident_models(body)
        message = str(cm.exception)
        self.assertIn(expected, message)
        self.assertNotIn("\n", message)

    def test_bad_json(self) -> None:
        self.assertModelsError(b"<html>oops</html>", "bad JSON")
        self.assertModelsError(b"", "bad JSON")
        self.assertModelsError(b'{"data": [', "bad JSON")

    def test_not_utf8(self) -> None:
        self.assertModelsError(b"\xff\xfe\xfa", "bad JSON")

    def test_not_an_object(self) -> None:
        self.assertModelsError(b"[]", "not a JSON object")
        self.assertModelsError(b'"data"', "not a JSON object")

    def test_data_missing_or_not_a_list(self) -> None:
        self.assertModelsError(b'{"models": []}', '"data" is not a list')
        self.assertModelsError(b'{"data": {"id": "a"}}', '"data" is not a list')

    def test_entry_not_an_object_is_dropped(self) -> None:
        """docs/design.md §health rule 2: a malformed entry is dropped, not a failed poll."""
        self.assertEqual(resident_models(doc({"id": "a"}, "b", None, 7)), ("a",))

    def test_id_not_a_string_is_dropped(self) -> None:
        self.assertEqual(resident_models(doc({"id": 7}, {"name": "a"}, {"id": "b"})), ("b",))

    def test_deep_nesting(self) -> None:
        self.assertModelsError(b"[" * 100_000 + b"]" * 100_000, "bad JSON")
