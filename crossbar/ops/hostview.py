"""Hosts and keys as the operations endpoints show them (docs/design.md §Operations):
the fields ``/_crossbar/status`` and the dashboard share, built once, so the two never
disagree (a ``max_inflight: slots`` host shows its slots in both).
"""

from __future__ import annotations

from typing import Any

from crossbar.config import Host, Route
from crossbar.hosts.balance import limit_in_force
from crossbar.hosts.health import HostStatus
from crossbar.state.runtime import Runtime

__all__ = ["host_view", "key_view", "leaving", "leaving_view", "limit_view"]


def limit_view(host: Host | None, status: HostStatus) -> dict[str, object]:
    """``max_inflight`` in force and ``max_inflight_source`` (``config``, ``slots`` or
    None for no limit), docs/design.md §Choosing a host, rules 2 and 5."""
    limit, source = limit_in_force(host, status) if host is not None else (None, None)
    return {"max_inflight": limit, "max_inflight_source": source}


def host_view(runtime: Runtime, name: str, status: HostStatus) -> dict[str, Any]:
    """The shared fields of configured host ``name`` whose health is ``status``: health,
    models (loaded, loading, available), the last error, requests in flight (fleet-wide),
    the limit in force and its source, whether it is draining. ``last_ok`` is left to
    each endpoint (status writes RFC 3339, the page clock seconds)."""
    host = runtime.config.hosts.get(name)
    return {
        "healthy": status.healthy,
        "loaded": list(status.loaded),
        "loading": list(status.loading),
        "available": list(status.available),
        "last_err": status.last_err,
        "inflight": runtime.inflight.host(name),
        **limit_view(host, status),
        "draining": name in runtime.drained,
        "leaving": False,
    }


def leaving(runtime: Runtime) -> dict[str, int]:
    """Hosts a reload removed that still have requests in flight from this process:
    host -> in flight (shown until each ends)."""
    hosts = runtime.config.hosts
    return {h: n for h, n in runtime.inflight.by_host().items() if h not in hosts}


def leaving_view(inflight: int) -> dict[str, Any]:
    """The shared fields of a host a reload removed that still answers ``inflight``
    requests: shown until its last request ends."""
    return {
        "healthy": False, "loaded": [], "loading": [], "available": [], "last_err": None, "inflight": inflight,
        "max_inflight": None, "max_inflight_source": None, "draining": False, "leaving": True,
    }


def key_view(runtime: Runtime, route: Route) -> dict[str, Any]:
    """Status of ``route``'s keys that have ``limits``: the limits and what each has
    been admitted and spent, by this process or with workers by the box
    (docs/design.md §Access)."""
    spending = runtime.limits.spending()
    out: dict[str, Any] = {}
    for name, key in route.keys.items():
        if not key.limits:
            continue
        s = spending.get((route.name, name))
        out[name] = {
            "limits": {k: v for k, v in vars(key.limits).items() if v is not None},
            "requests_minute": s.requests_minute if s else 0,
            "tokens_minute": s.tokens_minute if s else 0,
            "tokens_day": s.tokens_day if s else 0,
        }
    return out
