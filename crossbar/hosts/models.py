"""Read a host's ``GET /v1/models`` answer (docs/design.md §The health table, rule 2).

llama-server in single-model mode (and other OpenAI-compatible servers) lists models
without a ``status``: each counts as loaded. In router mode every model it *could* load
is listed, each with ``"status": {"value": "loaded" | "loading" | "unloaded" | ...}``:
``loaded`` counts as loaded, ``loading`` as loading, any other value as available (the
router loads it on demand). An entry that is not an object or has no string id is
dropped; only a document that is not ``{"data": [...]}`` is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["ModelList", "ModelsError", "parse_models", "resident_models"]


class ModelsError(ValueError):
    """The body is not a ``{"data": [...]}`` document."""


@dataclass(frozen=True)
class ModelList:
    """What a host lists, each id in exactly one of the three tuples (sorted, unique).

    :ivar loaded: ids resident now.
    :ivar loading: ids being loaded.
    :ivar available: ids the host lists and can load on demand.
    :ivar entries: id -> the host's entry for it, as compact JSON text (immutable; the
        route model list of rule 10 is made of these).
    :ivar router: some entry carries a ``status``: the host is a llama-server in router
        mode, which refuses a request naming no model or one it does not list
        (docs/design.md §Choosing a host rule 1, §Model names).
    :ivar aliases: a name the host reports in an entry's ``aliases`` -> that entry's id;
        a request naming such an alias fits the host as the id does (§Model names).
    """

    loaded: tuple[str, ...] = ()
    loading: tuple[str, ...] = ()
    available: tuple[str, ...] = ()
    entries: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    router: bool = False
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of_loaded(cls, ids: Any) -> ModelList:
        """A list where every id of ``ids`` is loaded and has the entry ``{"id": id}``
        (empty ids and duplicates dropped)."""
        loaded = tuple(sorted({m for m in ids if m}))
        entries = {m: json.dumps({"id": m}) for m in loaded}
        return cls(loaded=loaded, entries=MappingProxyType(entries))


def _state(entry: dict[str, Any]) -> str:
    """``loaded``, ``loading`` or ``available`` for one entry."""
    if "status" not in entry:
        return "loaded"
    status = entry["status"]
    value = status.get("value") if isinstance(status, dict) else status
    if value == "loaded" and not (isinstance(status, dict) and status.get("failed") is True):
        return "loaded"
    if value == "loading":
        return "loading"
    return "available"


def parse_models(body: bytes) -> ModelList:
    """The models listed in ``body`` (the raw ``/v1/models`` answer, UTF-8 JSON).

    :raises ModelsError: when the body is not JSON or not of the shape
        ``{"data": [...]}``; the message says which, e.g. ``bad JSON: Expecting value``
        or ``"data" is not a list``.
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
    states: dict[str, str] = {}
    entries: dict[str, str] = {}
    reported: list[tuple[str, str]] = []
    router = False
    for entry in data:
        if not isinstance(entry, dict):
            continue
        model_id = entry.get("id")
        if not isinstance(model_id, str) or not model_id or model_id in states:
            continue
        router = router or "status" in entry
        states[model_id] = _state(entry)
        entries[model_id] = json.dumps(entry, separators=(",", ":"))
        names = entry.get("aliases")
        if isinstance(names, list):
            reported.extend((a, model_id) for a in names if isinstance(a, str) and a)
    aliases: dict[str, str] = {}
    for alias, model_id in reported:  # an id wins over an alias; the first alias wins
        if alias not in states and alias not in aliases:
            aliases[alias] = model_id
    return ModelList(
        loaded=tuple(sorted(m for m, s in states.items() if s == "loaded")),
        loading=tuple(sorted(m for m, s in states.items() if s == "loading")),
        available=tuple(sorted(m for m, s in states.items() if s == "available")),
        entries=MappingProxyType(entries),
        router=router,
        aliases=MappingProxyType(aliases),
    )


def resident_models(body: bytes) -> tuple[str, ...]:
    """The sorted unique ids of the models loaded according to ``body``.

    :raises ModelsError: as :func:`parse_models`.
    """
    return parse_models(body).loaded
