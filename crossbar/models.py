"""Read the resident models out of a ``GET /v1/models`` answer (DESIGN.md §health, rule 2).

llama-server in single-model mode (and other OpenAI-compatible servers) lists models
without a ``status``; in router mode every model it *could* load is listed, each with
``"status": {"value": "loaded" | "loading" | "unloaded" | ...}``. Only entries without a
status, or whose ``status.value`` is ``"loaded"``, are resident.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ModelsError", "resident_models"]


class ModelsError(ValueError):
    """The body is not a ``{"data": [{"id": ...}, ...]}`` document."""


def _is_resident(entry: dict[str, Any]) -> bool:
    if "status" not in entry:
        return True
    status = entry["status"]
    if isinstance(status, dict):
        return status.get("value") == "loaded" and status.get("failed") is not True
    return status == "loaded"


def resident_models(body: bytes) -> tuple[str, ...]:
    """The sorted unique ids of the resident models in ``body``.

    :param body: the raw ``/v1/models`` answer (UTF-8 JSON).
    :raises ModelsError: when the body is not JSON or not of the expected shape; the
        message says which, e.g. ``bad JSON: Expecting value`` or ``"data" is not a list``.
    """
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ModelsError(f"bad JSON: {str(e).split(':')[0]}") from None
    if not isinstance(doc, dict):
        raise ModelsError("not a JSON object")
    data = doc.get("data")
    if not isinstance(data, list):
        raise ModelsError('"data" is not a list')
    ids: set[str] = set()
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ModelsError(f"data[{i}] is not an object")
        model_id = entry.get("id")
        if not isinstance(model_id, str):
            raise ModelsError(f'data[{i}]."id" is not a string')
        if model_id and _is_resident(entry):
            ids.add(model_id)
    return tuple(sorted(ids))
