"""The dashboard's page and data (docs/design.md §Operations: ``GET /_crossbar/``).

The page is four static files shipped in the package (``crossbar/ops/dashboard/``:
``index.html``, ``app.js``, ``style.css``, ``favicon.svg``), read once and served with a
Content-Security-Policy that allows scripts, styles and connections from crossbar
itself only (no inline script, nothing fetched from elsewhere). They hold no data: with
an ``ops.token`` the page shows its login form until the token is given.

The data is one JSON document (:func:`snapshot`): the hosts, the routes, the recent
requests and tokens/s per host over the last 15 minutes. It carries no URL, secret,
body or query string; the page inserts every text as text. Its ``view`` says whose
requests it holds (``instance``, ``workers``, or ``fleet`` with ``cluster.redis``) and,
in ``note``, why it is narrower than it should be (Redis away).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from crossbar.ops.hostview import host_view, leaving, leaving_view
from crossbar.ops.recent import RecentRequests
from crossbar.state.runtime import Runtime
from crossbar.state.token_window import BUCKET, chart_starts
from crossbar.state.worker_counts import AFFINITY_OUTCOMES

__all__ = ["CSP", "MAX_MODEL_COLUMNS", "STATIC", "load_static", "models_view", "snapshot"]

MAX_MODEL_COLUMNS = 60
"""Models shown at most in the hosts x models view (those held somewhere first)."""

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own files only, no inline script or style."""

STATIC = {
    "": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "style.css": ("style.css", "text/css; charset=utf-8"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}
"""Path under ``/_crossbar/`` -> (file in the package, content type)."""


def load_static() -> dict[str, tuple[bytes, str]]:
    """The page's files from the package: path -> (bytes, content type).

    :raises OSError: a file is missing (a broken install)."""
    folder = resources.files("crossbar.ops").joinpath("dashboard")
    return {path: (folder.joinpath(name).read_bytes(), kind) for path, (name, kind) in STATIC.items()}


def _move(move: Any) -> dict[str, Any] | None:
    return None if move is None else {"model": move.model, "reason": move.reason, "at": move.at}


def models_view(runtime: Runtime) -> dict[str, Any]:
    """Where models live (docs/design.md §Where models live): the hosts x models view.

    ``models``: the model ids the hosts list (those loaded or loading somewhere first,
    then by name; at most :data:`MAX_MODEL_COLUMNS`); per host (``hosts``, in table
    order): ``router``, ``models_max`` (router-mode hosts), ``cells`` (model -> ``state``
    ``loaded``/``loading``/``available`` as crossbar counts it, the loads it caused
    included, and ``inflight``: its requests in flight there), ``last_load`` and
    ``last_unload`` (``model``, ``reason``, ``at``: clock seconds) or None."""
    placement = runtime.placement
    statuses = placement.overlay(runtime.table.all())
    held: set[str] = set()
    listed: set[str] = set()
    for s in statuses.values():
        held.update(s.loaded, s.loading)
        listed.update(s.loaded, s.loading, s.available)
    models = sorted(listed, key=lambda m: (m not in held, m))[:MAX_MODEL_COLUMNS]
    shown = set(models)
    hosts = []
    for name, s in statuses.items():
        host = runtime.config.hosts.get(name)
        cells: dict[str, dict[str, Any]] = {}
        for state, ids in (("loaded", s.loaded), ("loading", s.loading), ("available", s.available)):
            for m in ids:
                if m in shown:
                    cells[m] = {"state": state, "inflight": runtime.inflight.host_model(name, m)}
        hosts.append({
            "name": name, "router": s.router,
            "models_max": host.models_max if host is not None and s.router else None,
            "cells": cells,
            "last_load": _move(placement.last_load.get(name)),
            "last_unload": _move(placement.last_unload.get(name)),
        })
    return {"models": models, "hosts": hosts}


def snapshot(runtime: Runtime, recent: RecentRequests, limit: int = 200) -> dict[str, Any]:
    """Everything the page shows, as one JSON-able document (see the module doc).

    :param limit: recent requests to include, newest first."""
    now = runtime.now()
    config = runtime.config
    entries = recent.view()
    last_minute = runtime.tokens.window()  # what status reads too (§What the answers say)
    hosts = []
    for name, s in runtime.table.all().items():
        hosts.append({
            "name": name, **host_view(runtime, name, s), "polled": s.polled, "last_ok": s.last_ok,
            "tps": last_minute.generated_per_second(name),
        })
    for name, n in sorted(leaving(runtime).items()):
        hosts.append({
            "name": name, **leaving_view(n), "polled": True, "last_ok": None,
            "tps": last_minute.generated_per_second(name),
        })
    routes = []
    for name, route in config.routes.items():
        oldest = runtime.oldest_wait(name)
        routes.append({
            "name": name,
            "hosts": list(route.hosts),
            "queued": runtime.queued(name),
            "oldest_wait_s": None if oldest is None else round(oldest, 3),
            "affinity": {"key": route.affinity.key,
                         **{outcome: runtime.affinity(name, outcome) for outcome in AFFINITY_OUTCOMES}},
            "cached_share": last_minute.cached_share("r", name),
        })
    return {
        "now": now,
        "actions": config.ops.token is not None,
        "hosts": hosts,
        "routes": routes,
        "models": models_view(runtime),
        "recent": entries[:limit],
        "view": recent.scope(),
        "chart": {"start": chart_starts(now)[0], "step": BUCKET,
                  "hosts": runtime.tokens.chart([str(h["name"]) for h in hosts])},
    }
