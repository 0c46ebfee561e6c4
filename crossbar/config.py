"""Load and validate ``crossbar.yaml`` into frozen records (DESIGN.md §Configuration).

Every problem is reported as one :class:`ConfigError` naming the file, the key path and
the problem, e.g. ``crossbar.yaml: routes.a.hosts[1]: unknown host 'gpu-z'``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import yaml

__all__ = [
    "Config",
    "ConfigError",
    "DrainSettings",
    "HealthSettings",
    "Host",
    "OpsSettings",
    "Route",
    "Timeouts",
    "load_config",
    "parse_config",
]


class ConfigError(Exception):
    """A configuration file that cannot be used.

    ``str(error)`` is the one line to show an operator: ``FILE: KEY.PATH: problem``.
    """

    def __init__(self, path: str, key: str, problem: str) -> None:
        self.path = path
        self.key = key
        self.problem = problem
        where = f"{path}: {key}: " if key else f"{path}: "
        super().__init__(_one_line(where + problem))


def _one_line(text: str) -> str:
    """``text`` with every non-printable character escaped, so it stays one line."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


@dataclass(frozen=True)
class HealthSettings:
    """``health:`` — poll cadence and hysteresis (DESIGN.md §The health table).

    ``interval`` and ``timeout`` are seconds; the thresholds count polls.
    """

    interval: float = 5.0
    timeout: float = 5.0
    recovery_polls: int = 2
    failure_threshold: int = 1


@dataclass(frozen=True)
class Timeouts:
    """``timeouts:`` for the proxy path, in seconds (DESIGN.md §The proxy, rule 7)."""

    connect: float = 5.0
    first_byte: float = 300.0
    idle: float = 120.0


@dataclass(frozen=True)
class DrainSettings:
    """``drain:`` for SIGTERM, in seconds (DESIGN.md §Operations)."""

    delay: float = 5.0
    grace: float = 25.0


@dataclass(frozen=True)
class OpsSettings:
    """``ops:`` — ``token`` guards ``/_crossbar/status`` and ``metrics`` when not None."""

    token: str | None = None


@dataclass(frozen=True)
class Host:
    """One upstream host: its configured name and base URL (no trailing slash)."""

    name: str
    url: str


@dataclass(frozen=True)
class Route:
    """One route: the first path segment clients use, its hosts in preference order."""

    name: str
    hosts: tuple[str, ...]
    default_model: str | None = None


@dataclass(frozen=True)
class Config:
    """A whole validated configuration. ``hosts`` and ``routes`` keep file order."""

    listen: str
    hosts: Mapping[str, Host]
    routes: Mapping[str, Route]
    health: HealthSettings = field(default_factory=HealthSettings)
    timeouts: Timeouts = field(default_factory=Timeouts)
    drain: DrainSettings = field(default_factory=DrainSettings)
    ops: OpsSettings = field(default_factory=OpsSettings)
    source: str = "<config>"


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _load_yaml(c: _Checker, text: str) -> Any:
    """Parse ``text`` with the safe loader, refusing duplicate mapping keys.

    PyYAML keeps the last of duplicate keys silently; here the node tree is walked
    before construction so a duplicate is reported with its key path and line.

    :raises ConfigError: for a syntax error (with line and column) or a duplicate key.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(c, loader, node, "", set())
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise c.fail("", f"invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise c.fail("", "invalid YAML: nested too deeply") from None
    finally:
        loader.dispose()


def _refuse_duplicates(c: _Checker, loader: yaml.SafeLoader, node: yaml.Node, key: str, seen_nodes: set[int]) -> None:
    if id(node) in seen_nodes:  # an alias already walked (also stops recursive aliases)
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(c, loader, item, f"{key}[{i}]", seen_nodes)
    elif isinstance(node, yaml.MappingNode):
        first: dict[Any, yaml.Node] = {}
        for key_node, value_node in node.value:
            label = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
            sub = _join(key, str(label))
            if key_node.tag != _MERGE_TAG:
                value = loader.construct_object(key_node, deep=True)
                try:
                    earlier = first.get(value)
                except TypeError:
                    earlier = None  # an unhashable key: construction reports it
                else:
                    if earlier is None:
                        first[value] = key_node
                if earlier is not None:
                    here, there = key_node.start_mark, earlier.start_mark
                    raise c.fail(
                        sub,
                        f"duplicate key at line {here.line + 1}, column {here.column + 1} "
                        f"(first at line {there.line + 1})",
                    )
            _refuse_duplicates(c, loader, value_node, sub, seen_nodes)


_ENV_REF = re.compile(r"\$\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class _Checker:
    """Validation helpers that know the file name, so every error names it."""

    def __init__(self, path: str, environ: Mapping[str, str]) -> None:
        self.path = path
        self.environ = environ

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.path, key, problem)

    def expand(self, key: str, value: str) -> str:
        def sub(match: re.Match[str]) -> str:
            name = match.group(1)
            if not _ENV_NAME.match(name):
                raise self.fail(key, f"bad environment reference ${{{name}}}")
            if name not in self.environ:
                raise self.fail(key, f"environment variable {name} is not set")
            return self.environ[name]

        return _ENV_REF.sub(sub, value)

    def mapping(self, key: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a mapping, not {_kind(value)}")
        for k in value:
            if not isinstance(k, str):
                raise self.fail(key, f"keys must be strings, not {_kind(k)} {k!r}")
        return value

    def section(self, key: str, top: dict[str, Any]) -> dict[str, Any]:
        """The optional top-level mapping ``key``; absent or null means all defaults."""
        value = top.get(key)
        return {} if value is None else self.mapping(key, value)

    def known_keys(self, key: str, value: dict[str, Any], allowed: tuple[str, ...]) -> None:
        for k in value:
            if k not in allowed:
                raise self.fail(_join(key, k), f"unknown key (expected one of: {', '.join(allowed)})")

    def string(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, not {_kind(value)}")
        text = self.expand(key, value)
        if not text.strip():
            raise self.fail(key, "must not be empty")
        return text

    def positive(self, key: str, value: Any) -> float:
        if isinstance(value, str):
            value = self.expand(key, value)
            try:
                value = float(value)
            except ValueError:
                raise self.fail(key, f"must be a number of seconds, not {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be a number of seconds, not {_kind(value)}")
        if not value > 0 or value != value or value == float("inf"):
            raise self.fail(key, f"must be a positive number of seconds, not {value!r}")
        return float(value)

    def count(self, key: str, value: Any) -> int:
        if isinstance(value, str):
            value = self.expand(key, value)
            try:
                value = int(value)
            except ValueError:
                raise self.fail(key, f"must be a whole number, not {value!r}") from None
        if isinstance(value, float):
            raise self.fail(key, f"must be a whole number, not {value!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be a whole number, not {_kind(value)}")
        if value < 1:
            raise self.fail(key, f"must be at least 1, not {value}")
        return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _join(key: str, sub: str) -> str:
    return f"{key}.{sub}" if key else sub


_ROUTE_CHARS = "letters, digits and -._~!$&'()*+,;=:@ only"
_ROUTE_NAME = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@]+\Z")  # RFC 3986 pchar, no %-escapes
_TOP_KEYS = ("listen", "health", "timeouts", "drain", "ops", "hosts", "routes")
_PRINTABLE_ASCII = re.compile(r"[\x21-\x7e]+\Z")  # what an HTTP request target may hold
_URL = re.compile(r"(?P<scheme>https?)://(?P<authority>[^/?#\s]+)(?P<path>/[^?#\s]*)?\Z")


def load_config(path: str, environ: Mapping[str, str] | None = None) -> Config:
    """Read, parse and validate the YAML file at ``path``.

    ``environ`` (default ``os.environ``) supplies ``${NAME}`` references.

    :raises ConfigError: for an unreadable file, bad YAML, or any rule of DESIGN.md
        §Configuration broken; its message is one line naming file, key and problem.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(path, "", f"cannot read: not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(path, "", f"cannot read: {e.strerror or e}") from None
    return parse_config(text, path, environ)


def parse_config(text: str, path: str = "<config>", environ: Mapping[str, str] | None = None) -> Config:
    """Parse and validate configuration ``text``; ``path`` is used in messages only.

    :raises ConfigError: see :func:`load_config`.
    """
    c = _Checker(path, os.environ if environ is None else environ)
    raw = _load_yaml(c, text)
    if raw is None:
        raise c.fail("", "the file is empty")
    top = c.mapping("", raw)
    c.known_keys("", top, _TOP_KEYS)
    for required in ("listen", "hosts", "routes"):
        if required not in top:
            raise c.fail(required, "is required")

    listen = c.string("listen", top["listen"])

    health_raw = c.section("health", top)
    c.known_keys("health", health_raw, ("interval", "timeout", "recovery_polls", "failure_threshold"))
    d = HealthSettings()
    health = HealthSettings(
        interval=c.positive("health.interval", health_raw.get("interval", d.interval)),
        timeout=c.positive("health.timeout", health_raw.get("timeout", d.timeout)),
        recovery_polls=c.count("health.recovery_polls", health_raw.get("recovery_polls", d.recovery_polls)),
        failure_threshold=c.count(
            "health.failure_threshold", health_raw.get("failure_threshold", d.failure_threshold)
        ),
    )

    t_raw = c.section("timeouts", top)
    c.known_keys("timeouts", t_raw, ("connect", "first_byte", "idle"))
    dt = Timeouts()
    timeouts = Timeouts(
        connect=c.positive("timeouts.connect", t_raw.get("connect", dt.connect)),
        first_byte=c.positive("timeouts.first_byte", t_raw.get("first_byte", dt.first_byte)),
        idle=c.positive("timeouts.idle", t_raw.get("idle", dt.idle)),
    )

    dr_raw = c.section("drain", top)
    c.known_keys("drain", dr_raw, ("delay", "grace"))
    dd = DrainSettings()
    drain = DrainSettings(
        delay=c.positive("drain.delay", dr_raw.get("delay", dd.delay)),
        grace=c.positive("drain.grace", dr_raw.get("grace", dd.grace)),
    )

    ops_raw = c.section("ops", top)
    c.known_keys("ops", ops_raw, ("token",))
    token_raw = ops_raw.get("token")
    ops = OpsSettings(token=None if token_raw is None else c.string("ops.token", token_raw))

    hosts = _hosts(c, top["hosts"])
    routes = _routes(c, top["routes"], hosts)
    return Config(
        listen=listen,
        hosts=MappingProxyType(hosts),
        routes=MappingProxyType(routes),
        health=health,
        timeouts=timeouts,
        drain=drain,
        ops=ops,
        source=path,
    )


def _hosts(c: _Checker, raw: Any) -> dict[str, Host]:
    hosts_raw = c.mapping("hosts", raw)
    if not hosts_raw:
        raise c.fail("hosts", "must name at least one host")
    hosts: dict[str, Host] = {}
    for name, value in hosts_raw.items():
        key = f"hosts.{name}"
        if not name or "/" in name or not all(ch.isprintable() and not ch.isspace() for ch in name):
            raise c.fail(key, "a host name must be non-empty, without '/', spaces or control characters")
        if isinstance(value, dict):
            c.known_keys(key, c.mapping(key, value), ("url",))
            if "url" not in value:
                raise c.fail(f"{key}.url", "is required")
            url_key, url_raw = f"{key}.url", value["url"]
        else:
            url_key, url_raw = key, value
        hosts[name] = Host(name=name, url=_url(c, url_key, url_raw))
    return hosts


def _url(c: _Checker, key: str, raw: Any) -> str:
    url = c.string(key, raw).strip()
    m = _URL.match(url)
    if m is None:
        raise c.fail(key, f"must be an absolute http:// or https:// URL without query, not {url!r}")
    if not _PRINTABLE_ASCII.match(url):
        raise c.fail(
            key, f"must be printable ASCII (percent-encode the path, IDNA-encode the host name), not {url!r}"
        )
    authority = m.group("authority")
    if "@" in authority:
        raise c.fail(key, "must not carry credentials (user@host)")
    hostport = authority
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0:
            raise c.fail(key, f"bad IPv6 address in {url!r}")
        port = hostport[end + 1:]
    else:
        port = hostport[hostport.find(":"):] if ":" in hostport else ""
        if not hostport.split(":")[0]:
            raise c.fail(key, f"missing host name in {url!r}")
    if port:
        if not port.startswith(":") or not port[1:].isdigit() or not 0 < int(port[1:]) < 65536:
            raise c.fail(key, f"bad port in {url!r}")
    return url.rstrip("/")


def _routes(c: _Checker, raw: Any, hosts: Mapping[str, Host]) -> dict[str, Route]:
    routes_raw = c.mapping("routes", raw)
    if not routes_raw:
        raise c.fail("routes", "must name at least one route")
    routes: dict[str, Route] = {}
    for name, value in routes_raw.items():
        key = f"routes.{name}"
        if not name:
            raise c.fail("routes", "a route name must not be empty")
        if "/" in name:
            raise c.fail(key, "a route name must not contain '/'")
        if name.startswith("_"):
            raise c.fail(key, "a route name must not start with '_' (reserved for /_crossbar)")
        if name in (".", "..") or not _ROUTE_NAME.match(name):
            # Clients percent-encode anything else, and the route segment is matched as
            # sent: such a route could never be reached.
            raise c.fail(key, f"a route name must be a plain URL path segment ({_ROUTE_CHARS}; not '.' or '..')")
        body = c.mapping(key, value)
        c.known_keys(key, body, ("hosts", "default_model"))
        if "hosts" not in body:
            raise c.fail(f"{key}.hosts", "is required")
        names = body["hosts"]
        if not isinstance(names, list):
            raise c.fail(f"{key}.hosts", f"must be a list of host names, not {_kind(names)}")
        if not names:
            raise c.fail(f"{key}.hosts", "must name at least one host")
        seen: list[str] = []
        for i, h in enumerate(names):
            hkey = f"{key}.hosts[{i}]"
            if not isinstance(h, str):
                raise c.fail(hkey, f"must be a host name, not {_kind(h)}")
            h = c.expand(hkey, h)
            if h not in hosts:
                raise c.fail(hkey, f"unknown host {h!r}")
            if h in seen:
                raise c.fail(hkey, f"host {h!r} is listed twice")
            seen.append(h)
        model_raw = body.get("default_model")
        model = None if model_raw is None else c.string(f"{key}.default_model", model_raw)
        routes[name] = Route(name=name, hosts=tuple(seen), default_model=model)
    return routes
