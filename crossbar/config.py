"""Load and validate ``crossbar.yaml`` into frozen records (docs/design.md §Configuration).

Every problem is reported as one :class:`ConfigError` naming the file, the key path and
the problem, e.g. ``crossbar.yaml: routes.a.hosts[1]: unknown host 'gpu-z'``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import stat
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping
from urllib.parse import unquote

import yaml

from crossbar.hosturl import HostURL, HostURLError
from crossbar.paths import is_forbidden

__all__ = [
    "AffinitySettings",
    "ClientKey",
    "ClusterSettings",
    "KeyLimits",
    "Config",
    "ConfigError",
    "DrainSettings",
    "HealthSettings",
    "Host",
    "HostTLSSettings",
    "OpsSettings",
    "PlacementSettings",
    "QueueSettings",
    "RedisURL",
    "Route",
    "Timeouts",
    "MAX_WORKERS",
    "load_config",
    "one_line",
    "parse_config",
    "read_config_text",
    "usable_cpus",
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
        super().__init__(one_line(where + problem))


def one_line(text: str) -> str:
    """``text`` with every non-printable character escaped (control characters, lone
    surrogates), so it stays one line, is safe on a terminal and encodes as UTF-8."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


@dataclass(frozen=True)
class HealthSettings:
    """``health:`` — poll cadence and hysteresis (docs/design.md §The health table).

    ``interval`` and ``timeout`` are seconds; the thresholds count polls.
    """

    interval: float = 5.0
    timeout: float = 5.0
    recovery_polls: int = 2
    failure_threshold: int = 1


@dataclass(frozen=True)
class Timeouts:
    """``timeouts:`` for the proxy path, in seconds (docs/design.md §The proxy, rule 7)."""

    connect: float = 5.0
    first_byte: float = 300.0
    idle: float = 120.0
    client_stall: float = 60.0
    """Seconds a client may take no byte of an answer crossbar holds for it before it is
    cut (nginx's ``send_timeout``; rule 7)."""


@dataclass(frozen=True)
class DrainSettings:
    """``drain:`` for SIGTERM, in seconds (docs/design.md §Operations)."""

    delay: float = 5.0
    grace: float = 25.0


@dataclass(frozen=True)
class OpsSettings:
    """``ops:`` — ``token`` guards ``/_crossbar/status`` and ``metrics`` when not None.

    The token is a secret: it is left out of ``repr()``.
    """

    token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class HostTLSSettings:
    """``hosts.<h>.tls:`` for an ``https://`` host (docs/design.md §Access, §Configuration).

    The files are read (and checked to hold PEM certificates / an unencrypted private
    key) when the config is loaded, so a reload picks up rotated files and a host whose
    files changed counts as changed (it starts over, docs/design.md §Operations).

    :ivar ca: path of the PEM CA bundle to trust, or None for the system trust store.
    :ivar verify: False turns off every check of the host's certificate (an explicit
        escape hatch, logged as a warning at load).
    :ivar client_cert: path of the PEM client certificate for mutual TLS, or None.
    :ivar client_key: path of its PEM private key (given exactly when ``client_cert`` is).
    :ivar ca_pem: the bytes read from ``ca`` (empty without ``ca``).
    :ivar client_pem: the client certificate's bytes followed by its key's (empty
        without mutual TLS); secret, so left out of ``repr()``.
    """

    ca: str | None = None
    verify: bool = True
    client_cert: str | None = None
    client_key: str | None = None
    ca_pem: bytes = field(default=b"", repr=False)
    client_pem: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class Host:
    """One upstream host (docs/design.md §Configuration, §Choosing a host, §Access).

    :ivar name: its configured name.
    :ivar url: its base URL, parsed once (:class:`crossbar.hosturl.HostURL`; a ``str``
        given here is parsed, :class:`~crossbar.hosturl.HostURLError` if it cannot be).
    :ivar weight: its share among equally fit hosts (> 0, default 1).
    :ivar max_inflight: requests in flight to it at once, or None for no limit (or for
        ``max_inflight: slots`` until the host's slot count is known).
    :ivar api_key: sent upstream as ``Authorization: Bearer`` on every request and poll
        instead of the client's, or None; secret, so left out of ``repr()``.
    :ivar tls: TLS settings (``https://`` hosts only), or None for the defaults
        (verified against the system trust store).
    :ivar max_inflight_slots: ``max_inflight: slots``: the limit is the number of slots
        the host reports (``GET /props`` → ``total_slots``, docs/design.md §Choosing a host,
        rule 2), read by the poller.
    :ivar models_max: for a router-mode host, the models it holds at once (its
        ``--models-max``; default 4, llama-server's own; 0: no limit), read by a route's
        ``placement`` (docs/design.md §Where models live, rule 2).
    """

    name: str
    url: HostURL
    weight: float = 1.0
    max_inflight: int | None = None
    api_key: str | None = field(default=None, repr=False)
    tls: HostTLSSettings | None = None
    max_inflight_slots: bool = False
    models_max: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.url, str):
            object.__setattr__(self, "url", HostURL.parse(self.url))

    def connection_settings(self) -> tuple[object, ...]:
        """What a connection to the host depends on: URL, ``tls`` and ``api_key``.

        A reload that changes any of them makes the host start over (docs/design.md
        §Operations).
        """
        return (self.url, self.tls, self.api_key)


@dataclass(frozen=True)
class QueueSettings:
    """``routes.<r>.queue:`` (docs/design.md §Choosing a host, rule 4).

    :ivar max: requests that may wait for a free host (0: never wait).
    :ivar timeout: seconds one request may wait.
    """

    max: int = 100
    timeout: float = 30.0


@dataclass(frozen=True)
class AffinitySettings:
    """``routes.<r>.affinity:`` (docs/design.md §Cache affinity).

    :ivar key: ``"prefix"`` (keep a conversation on one host) or ``"none"`` (off).
    :ivar balance: a host takes its share up to this factor (>= 1) of the tier's mean load.
    """

    key: Literal["prefix", "none"] = "prefix"
    balance: float = 1.25


@dataclass(frozen=True)
class PlacementSettings:
    """``routes.<r>.placement:`` (docs/design.md §Where models live): crossbar decides where
    the route's router-mode hosts load and unload models.

    :ivar spread_after: seconds a request waits for a host holding its model before
        another host loads a copy (rule 3), or None for never.
    :ivar idle_unload: seconds unused before crossbar unloads a model (rule 4), or None
        for never.
    :ivar keep_loaded: model ids kept loaded on some healthy host of the route (rule 5).
    """

    spread_after: float | None = 5.0
    idle_unload: float | None = None
    keep_loaded: tuple[str, ...] = ()


@dataclass(frozen=True)
class KeyLimits:
    """``routes.<r>.keys.<k>.limits:`` (docs/design.md §Access); each None when absent (off).

    :ivar requests_per_minute: requests admitted in any sliding 60 s.
    :ivar tokens_per_minute: tokens (prompt + generated, as the hosts report them)
        spent in any sliding 60 s, beyond which no new request is admitted.
    :ivar tokens_per_day: tokens spent in one UTC day, likewise.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.tokens_per_day))


@dataclass(frozen=True)
class RedisURL:
    """Where the Redis of ``cluster.redis`` is (docs/design.md §Several crossbars).

    :ivar tls: ``rediss://`` (verified against the system trust store).
    :ivar host: its host name or address; :ivar port: its TCP port (default 6379).
    :ivar db: the database number (the URL's path, default 0).
    :ivar username: for Redis 6 ACLs, or None; :ivar password: or None; left out of
        ``repr()``.
    """

    tls: bool
    host: str
    port: int = 6379
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    def display(self) -> str:
        """The URL without its credentials (for logs and status)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.tls else 'redis'}://{host}:{self.port}/{self.db}"


@dataclass(frozen=True)
class ClusterSettings:
    """``cluster:`` (docs/design.md §Several crossbars): several crossbars share counts.

    :ivar redis: the Redis they share them through.
    :ivar tls: ``cluster.tls`` for a ``rediss://`` Redis (the keys of a host's ``tls``:
        ``ca``, ``verify``, ``client_cert`` + ``client_key``), or None for the system
        trust store.
    """

    redis: RedisURL
    tls: HostTLSSettings | None = None


@dataclass(frozen=True)
class ClientKey:
    """One client key of a route (docs/design.md §Access).

    :ivar name: the key's name (goes into log lines and the ``key`` metric label).
    :ivar secret: what clients send as ``Authorization: Bearer <secret>``; left out of
        ``repr()``.
    :ivar max_inflight: this key's requests in flight or waiting at once, or None.
    :ivar limits: requests and tokens per minute, tokens per day (all off by default).
    :ivar priority: an integer; when requests wait, a key's go before those of keys of
        lower priority (default 0; §Access, "Fair shares").
    :ivar share: a positive number: the key's weight among keys of one priority
        (default 1).
    :ivar digest: SHA-256 of the UTF-8 secret (what :func:`crossbar.proxy.access.authorize`
        compares, so the comparison's time does not depend on the secret's length).
    """

    name: str
    secret: str = field(repr=False)
    max_inflight: int | None = None
    limits: KeyLimits = field(default_factory=KeyLimits)
    priority: int = 0
    share: float = 1.0
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", hashlib.sha256(self.secret.encode("utf-8")).digest())


_NO_KEYS: Mapping[str, ClientKey] = MappingProxyType({})


@dataclass(frozen=True)
class Route:
    """One route: the first path segment clients use, its hosts in preference order.

    :ivar primary: the host that takes every request it has room for, or None.
    :ivar keys: key name -> :class:`ClientKey`; empty when the route is open.
    :ivar aliases: client-facing model name or glob (``*`` matches any run of
        characters) -> a model id of the fleet, in file order (docs/design.md §Model
        names); see :meth:`resolve`.
    :ivar paths: more upstream paths the route forwards: exact, or prefixes ending in
        ``/`` (§The proxy, rule 3).
    :ivar placement: where models live on its router-mode hosts (§Where models live),
        or None: crossbar follows the fleet and shapes nothing.
    """

    name: str
    hosts: tuple[str, ...]
    default_model: str | None = None
    primary: str | None = None
    queue: QueueSettings = field(default_factory=QueueSettings)
    affinity: AffinitySettings = field(default_factory=AffinitySettings)
    keys: Mapping[str, ClientKey] = field(default_factory=lambda: _NO_KEYS)
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    paths: tuple[str, ...] = ()
    placement: PlacementSettings | None = None
    _globs: tuple[tuple[re.Pattern[str], str], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        globs = tuple(
            (re.compile(".*".join(re.escape(part) for part in name.split("*")), re.DOTALL), target)
            for name, target in self.aliases.items() if "*" in name
        )
        object.__setattr__(self, "_globs", globs)

    def resolve(self, model: str) -> str:
        """The model id a request naming ``model`` is chosen for: an exact alias's
        target, else the first matching glob's (file order), else ``model`` itself
        (§Model names)."""
        target = self.aliases.get(model)
        if target is not None and "*" not in model:
            return target
        for pattern, glob_target in self._globs:
            if pattern.fullmatch(model):
                return glob_target
        return model


@dataclass(frozen=True)
class Config:
    """A whole validated configuration. ``hosts`` and ``routes`` keep file order.

    :ivar workers: processes sharing the listener (``auto`` already resolved to the
        usable CPUs, docs/design.md §Workers).
    :ivar cluster: where several crossbars share their counts, or None (one box).
    :ivar warnings: one line each for settings that load but are probably mistakes (a
        host URL ending in ``/v1``, ``tls.verify: false``); :func:`load_config` logs them.
    :ivar text: the YAML text this config was parsed from (with ``workers``, the
        supervisor hands exactly this text to every worker: what it validated, whatever
        the file says by the time a worker starts).
    """

    listen: str
    hosts: Mapping[str, Host]
    routes: Mapping[str, Route]
    health: HealthSettings = field(default_factory=HealthSettings)
    timeouts: Timeouts = field(default_factory=Timeouts)
    drain: DrainSettings = field(default_factory=DrainSettings)
    ops: OpsSettings = field(default_factory=OpsSettings)
    source: str = "<config>"
    workers: int = 1
    cluster: ClusterSettings | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)
    text: str = field(default="", compare=False, repr=False)


MAX_WORKERS = 256
"""The most ``workers`` a config may ask for (each is a whole crossbar process, ~60 MB)."""


def usable_cpus() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity`` where the platform
    has it, else ``os.cpu_count()``), at least 1: what ``workers: auto`` means."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            return max(1, len(getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _load_yaml(c: _Checker, text: str) -> Any:
    """Parse ``text`` with the safe loader, refusing duplicate mapping keys.

    PyYAML keeps the last of duplicate keys silently; here the node tree is walked
    before construction so a duplicate is reported with its key path and line.

    :raises ConfigError: for a syntax error (with line and column) or a duplicate key.
    """
    masked = _mask_references(text)
    try:
        loader = yaml.SafeLoader(masked)  # the reader refuses control characters here
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise c.fail("", f"invalid YAML: {problem}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if masked is not text:
            _unmask_nodes(node, set())
        _refuse_duplicates(c, loader, node, "", set())
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if masked is not text:
            problem = _unmask(problem)
        raise c.fail("", f"invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise c.fail("", "invalid YAML: nested too deeply") from None
    finally:
        loader.dispose()


# ``${NAME}`` is expanded after parsing, in the validated values (so an environment
# value can never change the YAML structure, and YAML errors never show one). Its braces
# would end a YAML flow mapping (``{url: ${X}}``): before parsing they are swapped for
# two private-use characters (one character each, so error columns stay right) and
# swapped back in every scalar of the node tree. A file that itself holds those
# characters is parsed as written.
_MASKABLE_REF = re.compile(r"\$\{[^{}\s\ue000\ue001]*\}")
_OPEN, _CLOSE = "\ue000", "\ue001"
_UNMASK = str.maketrans({_OPEN: "{", _CLOSE: "}"})


def _mask_references(text: str) -> str:
    if _OPEN in text or _CLOSE in text or "${" not in text:
        return text
    return _MASKABLE_REF.sub(lambda m: "$" + _OPEN + m.group(0)[2:-1] + _CLOSE, text)


def _unmask(text: str) -> str:
    return text.translate(_UNMASK)


def _unmask_nodes(node: yaml.Node, seen: set[int]) -> None:
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        if isinstance(node.value, str):
            node.value = _unmask(node.value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _unmask_nodes(item, seen)
    elif isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            _unmask_nodes(key_node, seen)
            _unmask_nodes(value_node, seen)


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
    """Validation helpers that know the file name, so every error names it.

    A value that came (wholly or partly) from ``${NAME}`` is never quoted back in an
    error: the message shows it as written in the file, references unexpanded, so a
    secret put in the wrong place cannot end up in a log (docs/design.md §Access).
    """

    def __init__(self, path: str, environ: Mapping[str, str]) -> None:
        self.path = path
        self.environ = environ
        self.warnings: list[str] = []

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.path, key, problem)

    def warn(self, key: str, problem: str) -> None:
        self.warnings.append(str(ConfigError(self.path, key, problem)))

    def expand(self, key: str, value: str) -> str:
        def sub(match: re.Match[str]) -> str:
            name = match.group(1)
            if not _ENV_NAME.match(name):
                raise self.fail(key, f"bad environment reference ${{{name}}}")
            if name not in self.environ:
                raise self.fail(key, f"environment variable {name} is not set")
            return self.environ[name]

        return _ENV_REF.sub(sub, value)

    @staticmethod
    def show(raw: str, expanded: object) -> str:
        """How an error quotes a value: as written when it holds ``${...}``."""
        return repr(raw) if _ENV_REF.search(raw) else repr(expanded)

    def mapping(self, key: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a mapping, not {_kind(value)}")
        for k in value:
            if not isinstance(k, str):
                raise self.fail(key, f"keys must be strings, not {_kind(k)} {k!r}")
        return value

    def section(self, key: str, top: dict[str, Any], within: str = "") -> dict[str, Any]:
        """The optional mapping ``key`` of ``top`` (itself at key path ``within``);
        absent or null means all defaults."""
        value = top.get(key)
        return {} if value is None else self.mapping(_join(within, key), value)

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

    def _parsed(self, key: str, raw: str, parse: Callable[[str], Any], what: str,
                quote: Callable[[Any], str]) -> tuple[Any, str]:
        """A string value (after ``${...}``) read by ``parse`` (``int``, ``float``), and how to
        quote it in an error: as written where it names a variable, else by ``quote``."""
        text = self.expand(key, raw)
        shown = self.show(raw, text)
        try:
            value = parse(text)
        except ValueError:
            raise self.fail(key, f"must be {what}, not {shown}") from None
        return value, (shown if _ENV_REF.search(raw) else quote(value))

    def number(self, key: str, value: Any, what: str) -> tuple[float, str]:
        """A finite int or float (or a string of one, after ``${...}``) and how to quote it."""
        shown = repr(value)
        if isinstance(value, str):
            value, shown = self._parsed(key, value, float, what, repr)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"must be {what}, not {_kind(value)}")
        try:
            return float(value), shown
        except OverflowError:  # an int of hundreds of digits
            raise self.fail(key, f"must be {what}, not a number that large") from None

    def positive(self, key: str, value: Any) -> float:
        """A finite positive number of seconds."""
        number, shown = self.number(key, value, "a number of seconds")
        if not 0 < number < float("inf"):
            raise self.fail(key, f"must be a positive number of seconds, not {shown}")
        return number

    def at_least(self, key: str, value: Any, minimum: float) -> float:
        """A finite number (not necessarily whole) of at least ``minimum``; ``> 0`` when
        ``minimum`` is 0."""
        number, shown = self.number(key, value, "a number")
        if minimum == 0 and not 0 < number < float("inf"):
            raise self.fail(key, f"must be a positive number, not {shown}")
        if not minimum <= number < float("inf"):
            raise self.fail(key, f"must be a number of at least {minimum:g}, not {shown}")
        return number

    def integer(self, key: str, value: Any) -> int:
        """A whole number, negative ones included (a key's ``priority``)."""
        if isinstance(value, str):
            value, shown = self._parsed(key, value, int, "a whole number", str)
        else:
            shown = repr(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be a whole number, not {shown if isinstance(value, float) else _kind(value)}")
        return value

    def count(self, key: str, value: Any, minimum: int = 1) -> int:
        """A whole number of at least ``minimum``."""
        if isinstance(value, str):
            value, shown = self._parsed(key, value, int, "a whole number", str)
        else:
            shown = str(value) if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        if isinstance(value, float):
            raise self.fail(key, f"must be a whole number, not {shown}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be a whole number, not {_kind(value)}")
        if value < minimum:
            raise self.fail(key, f"must be at least {minimum}, not {shown}")
        return value

    def boolean(self, key: str, value: Any) -> bool:
        """``true``/``false`` (or a ``${...}`` string that expands to one of them)."""
        if isinstance(value, str):
            raw = value
            text = self.expand(key, value).strip().lower()
            if text in ("true", "false"):
                return text == "true"
            raise self.fail(key, f"must be true or false, not {self.show(raw, text)}")
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, not {_kind(value)}")
        return value

    def header_secret(self, key: str, value: Any) -> str:
        """A non-empty secret that can travel in an HTTP header. Never quoted back."""
        secret = self.string(key, value)
        if not _PRINTABLE_ASCII.match(secret):
            raise self.fail(key, "must be printable ASCII without spaces (it travels in an HTTP header)")
        return secret

    def pem_file(self, key: str, value: Any) -> tuple[str, bytes]:
        """A readable file named by a path (relative to the config file's directory)."""
        raw = value
        path = self.string(key, value)
        if not os.path.isabs(path):
            path = os.path.join(os.path.dirname(self.path), path)
        shown = self.show(raw, path) if isinstance(raw, str) else repr(path)
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the reactor
                raise self.fail(key, f"{shown} is not a regular file")
            with open(path, "rb") as f:
                return path, f.read(_MAX_PEM)
        except OSError as e:
            raise self.fail(key, f"cannot read {shown}: {e.strerror or type(e).__name__}") from None


_MIN_WEIGHT = 0.001
_MAX_WEIGHT = 1_000_000.0
_MAX_PRIORITY = 1_000_000  # a key's priority: any order an operator means fits

_MAX_PEM = 1024 * 1024
"""The most bytes read from one CA, certificate or key file."""


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _join(key: str, sub: str) -> str:
    return f"{key}.{sub}" if key else sub


_ROUTE_CHARS = "letters, digits and -._~!$&'()*+,;=:@ only"
_ROUTE_NAME = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@]+\Z")  # RFC 3986 pchar, no %-escapes
_TOP_KEYS = ("listen", "health", "timeouts", "drain", "ops", "workers", "cluster", "hosts", "routes")
_HOST_KEYS = ("url", "weight", "max_inflight", "api_key", "tls", "models_max")
_TLS_KEYS = ("ca", "verify", "client_cert", "client_key")
_ROUTE_KEYS = ("hosts", "default_model", "primary", "queue", "affinity", "keys", "aliases", "paths", "placement")
_PRINTABLE_ASCII = re.compile(r"[\x21-\x7e]+\Z")  # what an HTTP request target may hold

def load_config(path: str, environ: Mapping[str, str] | None = None, text: str | None = None) -> Config:
    """Read, parse and validate the YAML file at ``path``; log its warnings.

    ``environ`` (default ``os.environ``) supplies ``${NAME}`` references. Each line of
    :attr:`Config.warnings` is logged once as a warning (namespace ``crossbar``).
    ``text``, when given, is parsed instead of reading the file (a worker is handed the
    text its supervisor validated); ``path`` still names the file in messages and
    anchors relative ``tls`` paths.

    :raises ConfigError: for an unreadable file, bad YAML, or any rule of docs/design.md
        §Configuration broken; its message is one line naming file, key and problem.
    """
    if text is None:
        text = read_config_text(path)
    config = parse_config(text, path, environ)
    if config.warnings:
        from twisted.logger import Logger  # here: config itself stays light to import

        log = Logger(namespace="crossbar")
        for line in config.warnings:
            log.warn("{warning}", warning=line)
    return config


def read_config_text(path: str) -> str:
    """The text of the config file at ``path``.

    :raises ConfigError: the file cannot be read, or is not UTF-8 (one line).
    """
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(path, "", f"cannot read: not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(path, "", f"cannot read: {e.strerror or e}") from None


def parse_config(text: str, path: str = "<config>", environ: Mapping[str, str] | None = None) -> Config:
    """Parse and validate configuration ``text``; ``path`` is used in messages and to
    resolve relative ``tls`` file paths (against its directory).

    Warnings (settings that load but are probably mistakes) are returned in
    :attr:`Config.warnings`, not logged.

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
    c.known_keys("timeouts", t_raw, ("connect", "first_byte", "idle", "client_stall"))
    dt = Timeouts()
    timeouts = Timeouts(
        connect=c.positive("timeouts.connect", t_raw.get("connect", dt.connect)),
        first_byte=c.positive("timeouts.first_byte", t_raw.get("first_byte", dt.first_byte)),
        idle=c.positive("timeouts.idle", t_raw.get("idle", dt.idle)),
        client_stall=c.positive("timeouts.client_stall", t_raw.get("client_stall", dt.client_stall)),
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
    ops = OpsSettings(token=None if token_raw is None else c.header_secret("ops.token", token_raw))

    workers = _workers(c, top.get("workers", 1))
    cluster = _cluster(c, top)
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
        workers=workers,
        cluster=cluster,
        warnings=tuple(c.warnings),
        text=text,
    )


def _workers(c: _Checker, raw: Any) -> int:
    """``workers: N | auto`` (docs/design.md §Workers); ``auto`` -> :func:`usable_cpus`."""
    if isinstance(raw, str) and c.expand("workers", raw).strip().lower() == "auto":
        return min(usable_cpus(), MAX_WORKERS)
    if raw is None or isinstance(raw, (bool, list, dict)):
        raise c.fail("workers", f"must be a whole number or auto, not {_kind(raw)}")
    if isinstance(raw, str):
        text = c.expand("workers", raw)
        try:
            int(text)
        except ValueError:
            raise c.fail("workers", f"must be a whole number or auto, not {c.show(raw, text)}") from None
    workers = c.count("workers", raw)
    if workers > MAX_WORKERS:
        raise c.fail("workers", f"must be at most {MAX_WORKERS}, not {workers}")
    return workers


def _cluster(c: _Checker, top: dict[str, Any]) -> ClusterSettings | None:
    """``cluster: {redis: URL, tls: {...}}`` (docs/design.md §Several crossbars); None when
    absent. ``tls`` (the keys of a host's ``tls``) only with a ``rediss://`` URL."""
    if top.get("cluster") is None:
        return None
    body = c.mapping("cluster", top["cluster"])
    c.known_keys("cluster", body, ("redis", "tls"))
    if body.get("redis") is None:
        raise c.fail("cluster.redis", "is required (a redis:// or rediss:// URL)")
    redis = _redis_url(c, "cluster.redis", body["redis"])
    tls: HostTLSSettings | None = None
    if body.get("tls") is not None:
        if not redis.tls:
            raise c.fail("cluster.tls", "applies only to a rediss:// cluster.redis")
        tls = _tls(c, "cluster.tls", body["tls"])
    return ClusterSettings(redis=redis, tls=tls)


_REDIS_URL = re.compile(
    r"(?P<scheme>rediss?)://(?:(?P<userinfo>[^@/?#\s]*)@)?(?P<host>\[[^\]/]*\]|[^:/?#@\s\[\]]+)"
    r"(?::(?P<port>[^/?#]*))?(?:/(?P<db>[^?#]*))?\Z"
)


def _redis_url(c: _Checker, key: str, raw: Any) -> RedisURL:
    """``redis://[[user]:password@]host[:port][/db]`` or ``rediss://...``. The URL (its
    password in particular) is never quoted back: it may hold a secret from ``${VAR}``."""
    text = c.string(key, raw).strip()
    m = _REDIS_URL.match(text)
    if m is None:
        raise c.fail(key, "must be redis://[:password@]host[:port][/db] or rediss://... "
                          "(the URL is not quoted here: it may hold a password)")
    host = m.group("host")
    if host.startswith("["):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise c.fail(key, "the host in brackets is not an IPv6 address") from None
    port = 6379
    if m.group("port"):
        if not m.group("port").isdigit() or not 0 < int(m.group("port")) < 65536:
            raise c.fail(key, "the port must be a number from 1 to 65535")
        port = int(m.group("port"))
    db = 0
    if m.group("db"):
        if not m.group("db").isdigit() or int(m.group("db")) > 10000:
            raise c.fail(key, "the database (the URL's path) must be a whole number such as /0")
        db = int(m.group("db"))
    username: str | None = None
    password: str | None = None
    userinfo = m.group("userinfo")
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        if colon:
            password = unquote(secret) or None
            username = unquote(user) or None
        else:  # redis://secret@host: the common shorthand for a password alone
            password = unquote(user) or None
    return RedisURL(tls=m.group("scheme") == "rediss", host=host, port=port, db=db, username=username,
                    password=password)


def _limits(c: _Checker, key: str, raw: Any) -> KeyLimits:
    """``keys.<k>.limits`` (docs/design.md §Access): each a whole number of at least 1."""
    if raw is None:
        return KeyLimits()
    body = c.mapping(key, raw)
    names = ("requests_per_minute", "tokens_per_minute", "tokens_per_day")
    c.known_keys(key, body, names)
    values = {n: None if body.get(n) is None else c.count(f"{key}.{n}", body[n]) for n in names}
    return KeyLimits(**values)


def _hosts(c: _Checker, raw: Any) -> dict[str, Host]:
    hosts_raw = c.mapping("hosts", raw)
    if not hosts_raw:
        raise c.fail("hosts", "must name at least one host")
    hosts: dict[str, Host] = {}
    tls_by_address: dict[tuple[str, int], tuple[str, HostTLSSettings | None]] = {}
    for name, value in hosts_raw.items():
        key = f"hosts.{name}"
        if not name or "/" in name or not all(ch.isprintable() and not ch.isspace() for ch in name):
            raise c.fail(key, "a host name must be non-empty, without '/', spaces or control characters")
        body: dict[str, Any] = {}
        if isinstance(value, dict):
            body = c.mapping(key, value)
            c.known_keys(key, body, _HOST_KEYS)
            if "url" not in body:
                raise c.fail(f"{key}.url", "is required")
            url_key, url_raw = f"{key}.url", body["url"]
        else:
            url_key, url_raw = key, value
        url = _url(c, url_key, url_raw)
        scheme, address, path = url.scheme, (url.host.lower(), url.port), url.path
        if path.lower().endswith("/v1"):
            c.warn(
                url_key,
                f"host {name!r}: the URL ends in /v1, but crossbar adds /v1 itself (requests and polls would "
                "go to .../v1/v1/...): give the host's base URL without /v1",
            )
        weight = 1.0 if body.get("weight") is None else c.at_least(f"{key}.weight", body["weight"], 0)
        if not _MIN_WEIGHT <= weight <= _MAX_WEIGHT:  # the shares' arithmetic stays finite
            raise c.fail(f"{key}.weight", f"must be between {_MIN_WEIGHT:g} and {_MAX_WEIGHT:,.0f}, not {weight!r}")
        max_raw = body.get("max_inflight")
        max_key = f"{key}.max_inflight"
        max_text = c.expand(max_key, max_raw).strip() if isinstance(max_raw, str) else None
        slots = max_text == "slots"
        if isinstance(max_raw, str) and max_text is not None and not slots and not max_text.lstrip("+-").isdigit():
            raise c.fail(max_key, f'must be a whole number or "slots", not {c.show(max_raw, max_text)}')
        max_inflight = None if max_raw is None or slots else c.count(max_key, max_raw)
        key_raw = body.get("api_key")
        api_key = None if key_raw is None else c.header_secret(f"{key}.api_key", key_raw)
        tls = None
        if body.get("tls") is not None:
            if scheme != "https":
                raise c.fail(f"{key}.tls", "is only for https:// hosts")
            tls = _tls(c, f"{key}.tls", body["tls"])
            if not tls.verify:
                c.warn(
                    f"{key}.tls.verify",
                    f"host {name!r}: false: its certificate is not checked at all (anyone on the path can "
                    "impersonate it)",
                )
        if scheme == "https":
            earlier = tls_by_address.setdefault(address, (name, tls))
            if earlier[1] != tls:
                raise c.fail(
                    f"{key}.tls",
                    f"differs from host {earlier[0]!r} at the same address (one TLS setting per host and port)",
                )
        models_max = 4 if body.get("models_max") is None else c.count(f"{key}.models_max", body["models_max"], 0)
        hosts[name] = Host(
            name=name, url=url, weight=weight, max_inflight=max_inflight, api_key=api_key, tls=tls,
            max_inflight_slots=slots, models_max=models_max,
        )
    return hosts


def _tls(c: _Checker, key: str, raw: Any) -> HostTLSSettings:
    body = c.mapping(key, raw)
    c.known_keys(key, body, _TLS_KEYS)
    verify = True if body.get("verify") is None else c.boolean(f"{key}.verify", body["verify"])
    ca: str | None = None
    ca_pem = b""
    if body.get("ca") is not None:
        ca, ca_pem = c.pem_file(f"{key}.ca", body["ca"])
        _check_certificates(c, f"{key}.ca", ca_pem)
    has_cert, has_key = body.get("client_cert") is not None, body.get("client_key") is not None
    if has_cert != has_key:
        missing, given = ("client_key", "client_cert") if has_cert else ("client_cert", "client_key")
        raise c.fail(f"{key}.{missing}", f"is required with {given} (mutual TLS needs both)")
    cert: str | None = None
    private: str | None = None
    client_pem = b""
    if has_cert:
        cert, cert_pem = c.pem_file(f"{key}.client_cert", body["client_cert"])
        private, key_pem = c.pem_file(f"{key}.client_key", body["client_key"])
        _check_client_pair(c, key, cert_pem, key_pem)
        client_pem = cert_pem.rstrip(b"\n") + b"\n" + key_pem
    return HostTLSSettings(
        ca=ca, verify=verify, client_cert=cert, client_key=private, ca_pem=ca_pem, client_pem=client_pem
    )


def _check_certificates(c: _Checker, key: str, pem: bytes) -> list[Any]:
    """The PEM certificates in ``pem`` (at least one). cryptography is imported only
    when a config has ``tls`` files (it is heavy: every worker's RSS counts, docs/operations.md "Workers")."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise c.fail(key, "holds no PEM certificate") from None


def _check_client_pair(c: _Checker, key: str, cert_pem: bytes, key_pem: bytes) -> None:
    from cryptography.hazmat.primitives import serialization

    cert = _check_certificates(c, f"{key}.client_cert", cert_pem)[0]
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise c.fail(f"{key}.client_key", "is encrypted (crossbar needs an unencrypted key file)") from None
    except Exception:  # ValueError, UnsupportedAlgorithm: never quote the file's bytes
        raise c.fail(f"{key}.client_key", "holds no PEM private key crossbar can use") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.PEM
    if cert.public_key().public_bytes(encoding, public) != private.public_key().public_bytes(encoding, public):
        raise c.fail(f"{key}.client_key", "does not match client_cert")


def _url(c: _Checker, key: str, raw: Any) -> HostURL:
    """The host URL at ``key``, parsed as polls and requests use it
    (:meth:`crossbar.hosturl.HostURL.parse`, the one parser); its error, quoting the value
    as written when it holds ``${...}``, is the config error."""
    text = c.string(key, raw).strip()
    try:
        return HostURL.parse(text)
    except HostURLError as e:
        raise c.fail(key, str(e).replace(repr(text), c.show(raw, text))) from None


def _routes(c: _Checker, raw: Any, hosts: Mapping[str, Host]) -> dict[str, Route]:
    routes_raw = c.mapping("routes", raw)
    if not routes_raw:
        raise c.fail("routes", "must name at least one route")
    routes: dict[str, Route] = {}
    secrets: dict[bytes, tuple[str, str]] = {}  # secret's digest -> (key path, key name)
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
        c.known_keys(key, body, _ROUTE_KEYS)
        if "hosts" not in body:
            raise c.fail(f"{key}.hosts", "is required")
        names = body["hosts"]
        if not isinstance(names, list):
            raise c.fail(f"{key}.hosts", f"must be a list of host names, not {_kind(names)}")
        if not names:
            raise c.fail(f"{key}.hosts", "must name at least one host")
        seen: list[str] = []
        for i, h_raw in enumerate(names):
            hkey = f"{key}.hosts[{i}]"
            if not isinstance(h_raw, str):
                raise c.fail(hkey, f"must be a host name, not {_kind(h_raw)}")
            h = c.expand(hkey, h_raw)
            if h not in hosts:
                raise c.fail(hkey, f"unknown host {c.show(h_raw, h)}")
            if h in seen:
                raise c.fail(hkey, f"host {c.show(h_raw, h)} is listed twice")
            seen.append(h)
        model_raw = body.get("default_model")
        model = None if model_raw is None else c.string(f"{key}.default_model", model_raw)
        primary: str | None = None
        if body.get("primary") is not None:
            primary_raw = body["primary"]
            primary = c.string(f"{key}.primary", primary_raw)
            if primary not in seen:
                raise c.fail(
                    f"{key}.primary",
                    f"{c.show(primary_raw, primary)} is not one of the route's hosts ({', '.join(seen)})",
                )
        q_raw = c.section("queue", body, key)
        c.known_keys(f"{key}.queue", q_raw, ("max", "timeout"))
        dq = QueueSettings()
        queue = QueueSettings(
            max=c.count(f"{key}.queue.max", q_raw.get("max", dq.max), minimum=0),
            timeout=c.positive(f"{key}.queue.timeout", q_raw.get("timeout", dq.timeout)),
        )
        affinity = _affinity(c, f"{key}.affinity", c.section("affinity", body, key))
        if "keys" in body and body["keys"] is None:  # every key line commented out
            raise c.fail(f"{key}.keys", "must name at least one key (leave keys out for a route open to every client)")
        keys = _keys(c, f"{key}.keys", body.get("keys"), secrets)
        routes[name] = Route(
            name=name, hosts=tuple(seen), default_model=model, primary=primary, queue=queue, affinity=affinity,
            keys=keys, aliases=_aliases(c, f"{key}.aliases", body.get("aliases")),
            paths=_paths(c, f"{key}.paths", body.get("paths")),
            placement=_placement(c, f"{key}.placement", body),
        )
        _warn_kept_fill(c, key, routes[name], hosts)
    return routes


def _warn_kept_fill(c: _Checker, key: str, route: Route, hosts: Mapping[str, Host]) -> None:
    """A warning when ``route``'s ``keep_loaded`` models are as many as the places its
    hosts have in all (each host's ``models_max``; 0 is no limit): a kept model is never
    evicted (docs/design.md §Where models live, rules 2 and 5), so once they are loaded a
    request for any other model of the route waits for a place that never frees, and is
    answered 503 after ``queue.timeout``."""
    if route.placement is None or not route.placement.keep_loaded:
        return
    places = [hosts[h].models_max for h in route.hosts]
    kept = len(route.placement.keep_loaded)
    if 0 not in places and kept >= sum(places):
        c.warn(f"{key}.placement.keep_loaded",
               f"its {kept} model(s) fill every place of the route's hosts (models_max in all: {sum(places)}): "
               "requests for any other model will wait for a place that never frees (503 after queue.timeout)")


def _placement(c: _Checker, key: str, route: dict[str, Any]) -> PlacementSettings | None:
    """``placement`` (docs/design.md §Where models live): absent is off; ``{}`` or null
    values take the defaults (``spread_after: null`` is never)."""
    if "placement" not in route:
        return None
    body = c.section("placement", route, key.rsplit(".", 1)[0])
    c.known_keys(key, body, ("spread_after", "idle_unload", "keep_loaded"))
    d = PlacementSettings()
    spread: float | None = d.spread_after
    if "spread_after" in body:
        spread = None if body["spread_after"] is None else c.positive(f"{key}.spread_after", body["spread_after"])
    idle = None if body.get("idle_unload") is None else c.positive(f"{key}.idle_unload", body["idle_unload"])
    kept: list[str] = []
    raw = body.get("keep_loaded")
    if raw is not None:
        if not isinstance(raw, list):
            raise c.fail(f"{key}.keep_loaded", f"must be a list of model ids, not {_kind(raw)}")
        for i, value in enumerate(raw):
            model = c.string(f"{key}.keep_loaded[{i}]", value)
            if model in kept:
                raise c.fail(f"{key}.keep_loaded[{i}]", f"model {c.show(value, model)} is listed twice")
            kept.append(model)
    return PlacementSettings(spread_after=spread, idle_unload=idle, keep_loaded=tuple(kept))


def _aliases(c: _Checker, key: str, raw: Any) -> Mapping[str, str]:
    """``aliases``: client-facing name or glob -> model id (docs/design.md §Model names)."""
    if raw is None:
        return MappingProxyType({})
    body = c.mapping(key, raw)
    aliases: dict[str, str] = {}
    for name, target_raw in body.items():
        akey = f"{key}.{name}"
        if not isinstance(name, str) or not name:
            raise c.fail(key, "an alias must be a non-empty model name")
        target = c.string(akey, target_raw)
        if not target or "*" in target:
            raise c.fail(akey, "the target must be one model id (no '*')")
        if name == target:
            raise c.fail(akey, "an alias of itself")
        aliases[name] = target
    return MappingProxyType(aliases)


def _paths(c: _Checker, key: str, raw: Any) -> tuple[str, ...]:
    """``paths``: more forwarded paths, exact or prefixes ending in ``/`` (rule 3); a path
    the forbidden list covers, or one with a dot-segment, query or fragment, is refused."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise c.fail(key, f"must be a list of paths, not {_kind(raw)}")
    paths: list[str] = []
    for i, value in enumerate(raw):
        pkey = f"{key}[{i}]"
        path = c.string(pkey, value)
        if not path.startswith("/") or not _PRINTABLE_ASCII.match(path) or "?" in path or "#" in path:
            raise c.fail(pkey, f"{path!r} is not a path (printable ASCII starting with '/', no query)")
        if any(seg in (".", "..") for seg in path.split("/")):
            raise c.fail(pkey, f"{path!r} has a dot-segment")
        if is_forbidden(path.encode("ascii"), read=False):
            raise c.fail(pkey, f"{path!r} is a forbidden path (it changes a host or shows other clients' data)")
        paths.append(path)
    return tuple(paths)


def _affinity(c: _Checker, key: str, body: dict[str, Any]) -> AffinitySettings:
    c.known_keys(key, body, ("key", "balance"))
    da = AffinitySettings()
    mode: Literal["prefix", "none"] = da.key
    if body.get("key") is not None:
        mode_raw = body["key"]
        text = c.string(f"{key}.key", mode_raw).strip()
        if text == "prefix":
            mode = "prefix"
        elif text == "none":
            mode = "none"
        else:
            raise c.fail(f"{key}.key", f"must be prefix or none, not {c.show(mode_raw, text)}")
    balance = da.balance if body.get("balance") is None else c.at_least(f"{key}.balance", body["balance"], 1)
    return AffinitySettings(key=mode, balance=balance)


def _keys(
    c: _Checker, key: str, raw: Any, secrets: dict[bytes, tuple[str, str]]
) -> Mapping[str, ClientKey]:
    """``routes.<r>.keys`` (docs/design.md §Access). ``secrets`` collects every secret seen
    so far in the config (by digest), so the same secret under two names is refused."""
    if raw is None:
        return _NO_KEYS
    body = c.mapping(key, raw)
    if not body:
        raise c.fail(key, "must name at least one key (leave keys out for a route open to every client)")
    keys: dict[str, ClientKey] = {}
    for name, value in body.items():
        kkey = _join(key, name)
        if not name or not all(ch.isprintable() and not ch.isspace() for ch in name):
            raise c.fail(kkey, "a key name must be non-empty, without spaces or control characters")
        max_inflight: int | None = None
        limits = KeyLimits()
        priority, share = 0, 1.0
        if isinstance(value, dict):
            entry = c.mapping(kkey, value)
            c.known_keys(kkey, entry, ("secret", "max_inflight", "limits", "priority", "share"))
            if entry.get("secret") is None:
                raise c.fail(f"{kkey}.secret", "is required")
            secret = c.header_secret(f"{kkey}.secret", entry["secret"])
            if entry.get("max_inflight") is not None:
                max_inflight = c.count(f"{kkey}.max_inflight", entry["max_inflight"])
            limits = _limits(c, f"{kkey}.limits", entry.get("limits"))
            if entry.get("priority") is not None:
                priority = c.integer(f"{kkey}.priority", entry["priority"])
                if not -_MAX_PRIORITY <= priority <= _MAX_PRIORITY:
                    raise c.fail(f"{kkey}.priority", f"must be between {-_MAX_PRIORITY:,} and {_MAX_PRIORITY:,}, "
                                                     f"not {priority!r}")
            if entry.get("share") is not None:
                share = c.at_least(f"{kkey}.share", entry["share"], 0)
                if not _MIN_WEIGHT <= share <= _MAX_WEIGHT:  # like a host's weight: the shares stay finite
                    raise c.fail(f"{kkey}.share", f"must be between {_MIN_WEIGHT:g} and {_MAX_WEIGHT:,.0f}, "
                                                  f"not {share!r}")
        elif isinstance(value, str):
            secret = c.header_secret(kkey, value)
        else:
            raise c.fail(kkey, f"must be a secret (a string) or a mapping with secret, max_inflight and limits, "
                               f"not {_kind(value)}")
        client_key = ClientKey(name=name, secret=secret, max_inflight=max_inflight, limits=limits,
                               priority=priority, share=share)
        earlier = secrets.setdefault(client_key.digest, (kkey, name))
        if earlier[1] != name:
            raise c.fail(kkey, f"has the same secret as {earlier[0]} (a secret names one key in the whole config)")
        keys[name] = client_key
    return MappingProxyType(keys)
