"""The route model list: ``GET /{route}/v1/models`` answered from the health table
(docs/design.md §The proxy, rule 10).

Clients fill model pickers from ``/v1/models``; behind crossbar that list is every model
a healthy host of the route has loaded, loading or available, not just what the one
host a request lands on happens to list.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from crossbar.config import Route
from crossbar.hosts.health import HostStatus

__all__ = ["models_body", "route_models"]

_STATES = ("loaded", "loading", "available")

_STATUS_KEYS = ("value", "failed", "exit_code")
"""What a router-mode host's ``status`` may pass to clients: its state, never the
``args`` (the model's command line: absolute paths) or the ``preset`` (the same as an
INI text) (docs/design.md §The proxy, rule 10)."""


def _public(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` without what only the host's operator should see."""
    status = entry.get("status")
    if isinstance(status, dict):
        entry = dict(entry, status={k: status[k] for k in _STATUS_KEYS if k in status})
    return entry


def route_models(route: Route, statuses: Mapping[str, HostStatus]) -> dict[str, Any] | None:
    """The ``{"object": "list", "data": [...]}`` document for ``route``, or None when no
    host of the route is healthy (the caller answers 503).

    Each entry, sorted by id, is the one its first listing host (route order) reported,
    without a router-mode host's command line (``status`` keeps its ``value``,
    ``failed`` and ``exit_code`` only),
    plus ``"crossbar": {"hosts": {host: "loaded" | "loading" | "available"}}`` over the
    healthy hosts that list it; each exact alias of the route whose target is listed
    appears as the target's entry under the alias's id, with ``"alias_of"`` added
    (docs/design.md §Model names).
    """
    healthy = [h for h in route.hosts if h in statuses and statuses[h].healthy]
    if not healthy:
        return None
    entries: dict[str, dict[str, Any]] = {}
    where: dict[str, dict[str, str]] = {}
    for host in healthy:
        status = statuses[host]
        for state in _STATES:
            for model in getattr(status, state):
                if model not in entries:
                    text = status.entries.get(model)
                    entry = json.loads(text) if text is not None else {"id": model}
                    entries[model] = _public(entry) if isinstance(entry, dict) else {"id": model}
                where.setdefault(model, {})[host] = state
    listed: dict[str, dict[str, Any]] = {}
    for model, entry in entries.items():
        listed[model] = {**entry, "crossbar": {"hosts": where[model]}}
    for alias, target in route.aliases.items():
        # §Model names: an exact alias whose target some healthy host lists; a real id wins.
        if "*" not in alias and target in entries and alias not in listed:
            listed[alias] = {**entries[target], "id": alias, "crossbar": {"alias_of": target, "hosts": where[target]}}
    return {"object": "list", "data": [listed[m] for m in sorted(listed)]}


def models_body(route: Route, statuses: Mapping[str, HostStatus]) -> bytes | None:
    """:func:`route_models` as the JSON body of the answer, or None (503: no healthy host)."""
    doc = route_models(route, statuses)
    return None if doc is None else json.dumps(doc).encode("utf-8")
