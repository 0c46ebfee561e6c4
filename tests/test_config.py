"""Every validation rule of docs/design.md §Configuration, each pinned by its exact message.

A message is one line ``FILE: KEY.PATH: problem``; the tests compare the whole line so
a change of key path or wording is a visible decision, not an accident.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import FrozenInstanceError
from typing import Any, Callable, Mapping

import yaml
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import (
    AffinitySettings,
    ClientKey,
    Config,
    ConfigError,
    DrainSettings,
    HealthSettings,
    Host,
    HostTLSSettings,
    OpsSettings,
    QueueSettings,
    Route,
    Timeouts,
    load_config,
    parse_config,
    usable_cpus,
)

MINIMAL = """\
listen: "tcp:7777:interface=127.0.0.1"
hosts:
  a: http://127.0.0.1:8080
routes:
  r:
    hosts: [a]
"""

DESIGN_EXAMPLE = """\
listen: "tcp:7777:interface=127.0.0.1"  # a Twisted server endpoint string
health:
  interval: 5            # s between poll rounds
  timeout: 5             # s for one poll of one host (both requests)
  recovery_polls: 2      # good polls in a row a host needs after a failure
  failure_threshold: 1   # failed polls in a row before a trusted host is marked down
timeouts:
  connect: 5             # s to open a connection to a host
  first_byte: 300        # s from request sent to response headers (long prompts)
  idle: 120              # s without a body byte from the host (not while the client is slow)
drain:
  delay: 5               # s readiness says 503 before crossbar stops accepting
  grace: 25              # s in-flight requests get to finish after that
ops:
  token: ${CROSSBAR_OPS_TOKEN}  # optional bearer token for /_crossbar/status and /metrics
hosts:
  gpu-a: http://10.0.0.5:8080             # name -> base URL
  gpu-b:
    url: http://10.0.0.6:8080
routes:
  opencode-a:
    hosts: [gpu-a, gpu-b]                 # order is preference order
    default_model: qwen2.5-coder-7b       # used when a request names no model
"""


def doc(**changes: Any) -> str:
    """MINIMAL as YAML with top-level keys replaced (a value of ``None`` removes one)."""
    base: dict[str, Any] = {
        "listen": "tcp:7777:interface=127.0.0.1",
        "hosts": {"a": "http://127.0.0.1:8080"},
        "routes": {"r": {"hosts": ["a"]}},
    }
    for key, value in changes.items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    return yaml.safe_dump(base, sort_keys=False)


def parse(text: str, environ: Mapping[str, str] | None = None) -> Config:
    return parse_config(text, "x.yaml", environ={} if environ is None else environ)


class _Case(SynchronousTestCase):
    def assertRejected(self, text: str, message: str, environ: Mapping[str, str] | None = None) -> ConfigError:
        """``text`` fails with exactly ``message`` (one line, the file named first)."""
        e = self.assertRaises(ConfigError, parse, text, environ)
        self.assertEqual(str(e), message)
        self.assertNotIn("\n", str(e))
        self.assertEqual(e.path, "x.yaml")
        return e


class DefaultsTests(_Case):
    def test_minimal_config_gets_design_defaults(self) -> None:
        c = parse(MINIMAL)
        self.assertEqual(c.listen, "tcp:7777:interface=127.0.0.1")
        self.assertEqual(c.health, HealthSettings(interval=5.0, timeout=5.0, recovery_polls=2, failure_threshold=1))
        self.assertEqual(c.timeouts, Timeouts(connect=5.0, first_byte=300.0, idle=120.0, client_stall=60.0))
        self.assertEqual(c.drain, DrainSettings(delay=5.0, grace=25.0))
        self.assertEqual(c.ops, OpsSettings(token=None))
        self.assertEqual(dict(c.hosts), {"a": Host("a", "http://127.0.0.1:8080")})
        self.assertEqual(dict(c.routes), {"r": Route("r", ("a",), None)})
        self.assertEqual(c.source, "x.yaml")

    def test_dataclass_defaults_match_design(self) -> None:
        """The records' own defaults are the design's too (other modules build them directly)."""
        self.assertEqual(
            (HealthSettings(), Timeouts(), DrainSettings(), OpsSettings()),
            (HealthSettings(5, 5, 2, 1), Timeouts(5, 300, 120), DrainSettings(5, 25), OpsSettings(None)),
        )

    def test_design_example_parses(self) -> None:
        c = parse(DESIGN_EXAMPLE, {"CROSSBAR_OPS_TOKEN": "s3cret"})
        self.assertEqual(c.ops.token, "s3cret")
        self.assertEqual(c.hosts["gpu-a"].url.url, "http://10.0.0.5:8080")
        self.assertEqual(c.hosts["gpu-b"].url.url, "http://10.0.0.6:8080")
        self.assertEqual(c.routes["opencode-a"], Route("opencode-a", ("gpu-a", "gpu-b"), "qwen2.5-coder-7b"))
        self.assertEqual(c.health, HealthSettings())
        self.assertEqual(c.timeouts, Timeouts())
        self.assertEqual(c.drain, DrainSettings())

    def test_null_section_means_defaults(self) -> None:
        c = parse(MINIMAL + "health:\ntimeouts:\ndrain:\nops:\n")
        self.assertEqual((c.health, c.timeouts, c.drain, c.ops), (HealthSettings(), Timeouts(), DrainSettings(), OpsSettings()))

    def test_partial_section_keeps_other_defaults(self) -> None:
        c = parse(doc(health={"interval": 0.5}, timeouts={"idle": 7}))
        self.assertEqual(c.health, HealthSettings(interval=0.5))
        self.assertEqual(c.timeouts, Timeouts(idle=7.0))
        self.assertIsInstance(c.timeouts.idle, float)

    def test_settings_are_given_values(self) -> None:
        c = parse(doc(
            health={"interval": 1, "timeout": 2.5, "recovery_polls": 3, "failure_threshold": 4},
            timeouts={"connect": 0.25, "first_byte": 10, "idle": 11},
            drain={"delay": 0.1, "grace": 0.2},
        ))
        self.assertEqual(c.health, HealthSettings(1.0, 2.5, 3, 4))
        self.assertEqual(c.timeouts, Timeouts(0.25, 10.0, 11.0))
        self.assertEqual(c.drain, DrainSettings(0.1, 0.2))


class OrderAndImmutabilityTests(_Case):
    def test_hosts_and_routes_keep_file_order(self) -> None:
        c = parse("""\
listen: tcp:1
hosts:
  zeta: http://z
  alpha: http://a
  mid: {url: http://m}
routes:
  z2: {hosts: [mid, zeta, alpha]}
  a1: {hosts: [alpha]}
  m3: {hosts: [zeta]}
""")
        self.assertEqual(list(c.hosts), ["zeta", "alpha", "mid"])
        self.assertEqual(list(c.routes), ["z2", "a1", "m3"])
        self.assertEqual(c.routes["z2"].hosts, ("mid", "zeta", "alpha"))

    def test_config_is_frozen(self) -> None:
        c = parse(MINIMAL)
        with self.assertRaises(FrozenInstanceError):
            c.listen = "tcp:1"  # type: ignore[misc]
        with self.assertRaises(FrozenInstanceError):
            c.health.interval = 1.0  # type: ignore[misc]
        with self.assertRaises(FrozenInstanceError):
            c.hosts["a"].url = "http://evil"  # type: ignore[misc]
        with self.assertRaises(FrozenInstanceError):
            c.routes["r"].hosts = ()  # type: ignore[misc]
        with self.assertRaises(TypeError):
            c.hosts["b"] = Host("b", "http://b")  # type: ignore[index]
        with self.assertRaises(TypeError):
            c.routes["s"] = Route("s", ("a",))  # type: ignore[index]
        self.assertIsInstance(c.routes["r"].hosts, tuple)


class StructureTests(_Case):
    def test_unknown_top_level_key(self) -> None:
        self.assertRejected(
            MINIMAL + "lissen: tcp:1\n",
            "x.yaml: lissen: unknown key (expected one of: listen, health, timeouts, drain, ops, workers, cluster, hosts, routes)",
        )

    def test_unknown_key_in_health(self) -> None:
        self.assertRejected(
            doc(health={"intervall": 5}),
            "x.yaml: health.intervall: unknown key (expected one of: interval, timeout, recovery_polls, failure_threshold)",
        )

    def test_unknown_key_in_timeouts(self) -> None:
        self.assertRejected(
            doc(timeouts={"read": 5}),
            "x.yaml: timeouts.read: unknown key (expected one of: connect, first_byte, idle, client_stall)",
        )

    def test_unknown_key_in_drain(self) -> None:
        self.assertRejected(doc(drain={"wait": 5}), "x.yaml: drain.wait: unknown key (expected one of: delay, grace)")

    def test_unknown_key_in_ops(self) -> None:
        self.assertRejected(doc(ops={"password": "x"}), "x.yaml: ops.password: unknown key (expected one of: token)")

    def test_unknown_key_in_host(self) -> None:
        self.assertRejected(
            doc(hosts={"a": {"url": "http://h", "wieght": 2}}),
            "x.yaml: hosts.a.wieght: unknown key (expected one of: url, weight, max_inflight, api_key, tls)",
        )

    def test_unknown_key_in_route(self) -> None:
        self.assertRejected(
            doc(routes={"r": {"hosts": ["a"], "model": "m"}}),
            "x.yaml: routes.r.model: unknown key "
            "(expected one of: hosts, default_model, primary, queue, affinity, keys, aliases, paths)",
        )

    def test_missing_listen(self) -> None:
        self.assertRejected(doc(listen=None), "x.yaml: listen: is required")

    def test_missing_hosts(self) -> None:
        self.assertRejected(doc(hosts=None), "x.yaml: hosts: is required")

    def test_missing_routes(self) -> None:
        self.assertRejected(doc(routes=None), "x.yaml: routes: is required")

    def test_empty_hosts(self) -> None:
        self.assertRejected(doc(hosts={}), "x.yaml: hosts: must name at least one host")

    def test_empty_routes(self) -> None:
        self.assertRejected(doc(routes={}), "x.yaml: routes: must name at least one route")

    def test_listen_not_a_string(self) -> None:
        self.assertRejected(doc(listen=7777), "x.yaml: listen: must be a string, not a number")

    def test_listen_empty(self) -> None:
        self.assertRejected(doc(listen=" "), "x.yaml: listen: must not be empty")

    def test_top_level_not_a_mapping(self) -> None:
        self.assertRejected("- listen\n- hosts\n", "x.yaml: must be a mapping, not a list")

    def test_section_not_a_mapping(self) -> None:
        self.assertRejected(doc(health=[]), "x.yaml: health: must be a mapping, not a list")

    def test_section_scalar_not_a_mapping(self) -> None:
        self.assertRejected(doc(drain=5), "x.yaml: drain: must be a mapping, not a number")

    def test_non_string_key(self) -> None:
        self.assertRejected(MINIMAL + "7: x\n", "x.yaml: keys must be strings, not a number 7")


class HostURLTests(_Case):
    def rejected_url(self, url: str, problem: str) -> None:
        self.assertRejected(doc(hosts={"a": url}), f"x.yaml: hosts.a: {problem}")

    def test_ftp_scheme(self) -> None:
        self.rejected_url(
            "ftp://h:21", "must be an absolute http:// or https:// URL without query, fragment or spaces, not 'ftp://h:21'"
        )

    def test_relative_url(self) -> None:
        self.rejected_url(
            "127.0.0.1:8080", "must be an absolute http:// or https:// URL without query, fragment or spaces, not '127.0.0.1:8080'"
        )

    def test_path_only(self) -> None:
        self.rejected_url("/v1", "must be an absolute http:// or https:// URL without query, fragment or spaces, not '/v1'")

    def test_no_host(self) -> None:
        self.rejected_url("http://", "must be an absolute http:// or https:// URL without query, fragment or spaces, not 'http://'")

    def test_non_ascii_path(self) -> None:
        """Twisted's client sends only printable ASCII request targets: a URL it would
        refuse for every proxied request is refused at start-up instead."""
        self.rejected_url(
            "http://h:8080/\u00e9",
            "must be printable ASCII (percent-encode the path, IDNA-encode the host name), "
            "not 'http://h:8080/\u00e9'",
        )

    def test_non_ascii_host(self) -> None:
        self.rejected_url(
            "http://gp\u00fc:8080",
            "must be printable ASCII (percent-encode the path, IDNA-encode the host name), "
            "not 'http://gp\u00fc:8080'",
        )

    def test_port_without_host(self) -> None:
        self.rejected_url("http://:8080", "missing host name in 'http://:8080'")

    def test_port_out_of_range(self) -> None:
        self.rejected_url("http://h:65536", "bad port in 'http://h:65536'")

    def test_port_zero(self) -> None:
        self.rejected_url("http://h:0", "bad port in 'http://h:0'")

    def test_port_not_numeric(self) -> None:
        self.rejected_url("http://h:http", "bad port in 'http://h:http'")

    def test_port_empty(self) -> None:
        self.rejected_url("http://h:/", "bad port in 'http://h:/'")

    def test_with_query(self) -> None:
        self.rejected_url(
            "http://h:8080/?key=1", "must be an absolute http:// or https:// URL without query, fragment or spaces, not 'http://h:8080/?key=1'"
        )

    def test_with_fragment(self) -> None:
        self.rejected_url(
            "http://h:8080/#x", "must be an absolute http:// or https:// URL without query, fragment or spaces, not 'http://h:8080/#x'"
        )

    def test_with_credentials(self) -> None:
        self.rejected_url("http://user:pw@h:8080", "must not carry credentials (user@host)")

    def test_space_in_host(self) -> None:
        self.rejected_url(
            "http://h h:8080", "must be an absolute http:// or https:// URL without query, fragment or spaces, not 'http://h h:8080'"
        )

    def test_not_a_string(self) -> None:
        self.rejected_url(8080, "must be a string, not a number")  # type: ignore[arg-type]

    def test_null(self) -> None:
        self.assertRejected("listen: tcp:1\nhosts:\n  a:\nroutes: {r: {hosts: [a]}}\n", "x.yaml: hosts.a: must be a string, not null")

    def test_url_in_mapping_form_is_checked_under_url_key(self) -> None:
        self.assertRejected(
            doc(hosts={"a": {"url": "ftp://h"}}),
            "x.yaml: hosts.a.url: must be an absolute http:// or https:// URL without query, fragment or spaces, not 'ftp://h'",
        )

    def test_mapping_form_without_url(self) -> None:
        self.assertRejected(doc(hosts={"a": {}}), "x.yaml: hosts.a.url: is required")

    def test_host_as_string_and_as_mapping(self) -> None:
        c = parse(doc(hosts={"a": "http://h1:1", "b": {"url": "https://h2:2"}}))
        self.assertEqual(c.hosts["a"], Host("a", "http://h1:1"))
        self.assertEqual(c.hosts["b"], Host("b", "https://h2:2"))

    def test_trailing_slash_trimmed(self) -> None:
        c = parse(doc(hosts={"a": "http://h:8080/", "b": {"url": "https://h/llama/"}, "c": "http://h//"}))
        self.assertEqual([h.url.url for h in c.hosts.values()], ["http://h:8080", "https://h/llama", "http://h"])

    def test_ipv6_literal(self) -> None:
        self.assertEqual(parse(doc(hosts={"a": "http://[::1]:8080/"})).hosts["a"].url.url, "http://[::1]:8080")

    def test_host_url_is_the_record_polls_and_requests_use(self) -> None:
        """Issue 30 item 3: the config parses a host URL with the one parser polls and
        requests use (an IPv6 zone and the host's case included), and keeps the record."""
        from crossbar.hosturl import HostURL

        url = parse(doc(hosts={"a": "http://[FE80::1%25eth0]:8080/llama/"})).hosts["a"].url
        self.assertIsInstance(url, HostURL)
        self.assertEqual(url, HostURL.parse("http://[FE80::1%25eth0]:8080/llama/"))
        self.assertEqual(url.target(b"/health"), b"http://[FE80::1%25eth0]:8080/llama/health")
        for bad in ("http://[fe80::zz]:8080", "http://h:0", "http://u@h:1", "http://[::1", "http://:80"):
            try:
                HostURL.parse(bad)
            except ValueError as e:
                self.assertRejected(doc(hosts={"a": bad}), f"x.yaml: hosts.a: {e}")
            else:
                self.fail(f"{bad!r} parsed")

    def test_bad_host_name(self) -> None:
        self.assertRejected(
            doc(hosts={"a/b": "http://h"}, routes={"r": {"hosts": ["a/b"]}}),
            "x.yaml: hosts.a/b: a host name must be non-empty, without '/', spaces or control characters",
        )


class RouteTests(_Case):
    def test_route_names_unknown_host(self) -> None:
        self.assertRejected(doc(routes={"r": {"hosts": ["a", "gpu-z"]}}), "x.yaml: routes.r.hosts[1]: unknown host 'gpu-z'")

    def test_route_with_no_hosts(self) -> None:
        self.assertRejected(doc(routes={"r": {"hosts": []}}), "x.yaml: routes.r.hosts: must name at least one host")

    def test_route_without_hosts_key(self) -> None:
        self.assertRejected(doc(routes={"r": {"default_model": "m"}}), "x.yaml: routes.r.hosts: is required")

    def test_route_hosts_not_a_list(self) -> None:
        self.assertRejected(doc(routes={"r": {"hosts": "a"}}), "x.yaml: routes.r.hosts: must be a list of host names, not a string")

    def test_route_lists_host_twice(self) -> None:
        self.assertRejected(doc(routes={"r": {"hosts": ["a", "a"]}}), "x.yaml: routes.r.hosts[1]: host 'a' is listed twice")

    def test_route_name_empty(self) -> None:
        self.assertRejected(doc(routes={"": {"hosts": ["a"]}}), "x.yaml: routes: a route name must not be empty")

    def test_route_name_with_slash(self) -> None:
        self.assertRejected(doc(routes={"a/b": {"hosts": ["a"]}}), "x.yaml: routes.a/b: a route name must not contain '/'")

    def test_route_name_reserved_crossbar(self) -> None:
        self.assertRejected(
            doc(routes={"_crossbar": {"hosts": ["a"]}}),
            "x.yaml: routes._crossbar: a route name must not start with '_' (reserved for /_crossbar)",
        )

    def test_route_name_starting_with_underscore(self) -> None:
        self.assertRejected(
            doc(routes={"_x": {"hosts": ["a"]}}),
            "x.yaml: routes._x: a route name must not start with '_' (reserved for /_crossbar)",
        )

    _PLAIN = "a route name must be a plain URL path segment (letters, digits and -._~!$&'()*+,;=:@ only; not '.' or '..')"

    def test_route_name_dot_segment(self) -> None:
        self.assertRejected(doc(routes={"..": {"hosts": ["a"]}}), f"x.yaml: routes...: {self._PLAIN}")

    def test_route_name_single_dot(self) -> None:
        self.assertRejected(doc(routes={".": {"hosts": ["a"]}}), f"x.yaml: routes..: {self._PLAIN}")

    def test_route_name_with_space(self) -> None:
        self.assertRejected(doc(routes={"my route": {"hosts": ["a"]}}), f"x.yaml: routes.my route: {self._PLAIN}")

    def test_route_name_with_percent(self) -> None:
        self.assertRejected(doc(routes={"a%2Fb": {"hosts": ["a"]}}), f"x.yaml: routes.a%2Fb: {self._PLAIN}")

    def test_route_name_with_query_character(self) -> None:
        self.assertRejected(doc(routes={"a?b": {"hosts": ["a"]}}), f"x.yaml: routes.a?b: {self._PLAIN}")

    def test_route_name_non_ascii(self) -> None:
        """Clients send ``caf%C3%A9``; the route segment is matched as sent: unreachable."""
        self.assertRejected(doc(routes={"café": {"hosts": ["a"]}}), f"x.yaml: routes.café: {self._PLAIN}")

    def test_route_name_with_path_safe_punctuation(self) -> None:
        names = ["opencode-a", "a.b", "v1~x", "a:b@c", "x+y=z", "A_1"]
        c = parse(doc(routes={n: {"hosts": ["a"]} for n in names}))
        self.assertEqual(list(c.routes), names)

    def test_route_not_a_mapping(self) -> None:
        self.assertRejected(doc(routes={"r": ["a"]}), "x.yaml: routes.r: must be a mapping, not a list")

    def test_default_model(self) -> None:
        c = parse(doc(routes={"r": {"hosts": ["a"], "default_model": "qwen"}, "s": {"hosts": ["a"]}}))
        self.assertEqual((c.routes["r"].default_model, c.routes["s"].default_model), ("qwen", None))

    def test_default_model_not_a_string(self) -> None:
        self.assertRejected(
            doc(routes={"r": {"hosts": ["a"], "default_model": ["m"]}}),
            "x.yaml: routes.r.default_model: must be a string, not a list",
        )

    def test_underscore_inside_name_is_fine(self) -> None:
        self.assertEqual(list(parse(doc(routes={"a_b": {"hosts": ["a"]}})).routes), ["a_b"])


_SECONDS = [
    ("health", "interval"), ("health", "timeout"),
    ("timeouts", "connect"), ("timeouts", "first_byte"), ("timeouts", "idle"),
    ("drain", "delay"), ("drain", "grace"),
]
_BAD_SECONDS: list[tuple[str, object, str]] = [
    ("zero", 0, "must be a positive number of seconds, not 0"),
    ("negative", -1, "must be a positive number of seconds, not -1"),
    ("negative_float", -0.5, "must be a positive number of seconds, not -0.5"),
    ("text", "soon", "must be a number of seconds, not 'soon'"),
    ("with_unit", "5s", "must be a number of seconds, not '5s'"),
    ("boolean", True, "must be a number of seconds, not a boolean"),
    ("null", None, "must be a number of seconds, not null"),
    ("list", [5], "must be a number of seconds, not a list"),
    ("infinite", float("inf"), "must be a positive number of seconds, not inf"),
    ("nan", float("nan"), "must be a positive number of seconds, not nan"),
]
_COUNTS = [("health", "recovery_polls"), ("health", "failure_threshold")]
_BAD_COUNTS: list[tuple[str, object, str]] = [
    ("zero", 0, "must be at least 1, not 0"),
    ("negative", -3, "must be at least 1, not -3"),
    ("float", 2.5, "must be a whole number, not 2.5"),
    ("whole_float", 2.0, "must be a whole number, not 2.0"),
    ("boolean", True, "must be a whole number, not a boolean"),
    ("text", "two", "must be a whole number, not 'two'"),
    ("null", None, "must be a whole number, not null"),
]


def _make_rejection(section: str, key: str, value: object, problem: str) -> Callable[[_Case], None]:
    def test(self: _Case) -> None:
        self.assertRejected(doc(**{section: {key: value}}), f"x.yaml: {section}.{key}: {problem}")

    test.__doc__ = f"{section}.{key}: {value!r} is refused"
    return test


class NumberTests(_Case):
    """Non-positive or non-numeric intervals and timeouts; thresholds below 1."""

    locals().update({
        f"test_{section}_{key}_{label}": _make_rejection(section, key, value, problem)
        for section, key in _SECONDS for label, value, problem in _BAD_SECONDS
    })
    locals().update({
        f"test_{section}_{key}_{label}": _make_rejection(section, key, value, problem)
        for section, key in _COUNTS for label, value, problem in _BAD_COUNTS
    })

    def test_seconds_may_be_fractions(self) -> None:
        c = parse(doc(health={"interval": 0.001}, drain={"delay": 1e-3}))
        self.assertEqual((c.health.interval, c.drain.delay), (0.001, 0.001))

    def test_thresholds_of_one_are_fine(self) -> None:
        c = parse(doc(health={"recovery_polls": 1, "failure_threshold": 1}))
        self.assertEqual((c.health.recovery_polls, c.health.failure_threshold), (1, 1))

    def test_numbers_from_environment(self) -> None:
        c = parse(MINIMAL + "health:\n  interval: ${EVERY}\n  recovery_polls: ${POLLS}\n", {"EVERY": "0.5", "POLLS": "3"})
        self.assertEqual((c.health.interval, c.health.recovery_polls), (0.5, 3))

    def test_bad_number_from_environment(self) -> None:
        """A value from the environment is quoted as written, never expanded: it may be
        a secret put in the wrong place."""
        self.assertRejected(
            MINIMAL + "timeouts:\n  idle: ${IDLE}\n", "x.yaml: timeouts.idle: must be a number of seconds, not '${IDLE}'",
            {"IDLE": "forever"},
        )


class AttackFoundTests(_Case):
    """Configs an operator's attack pass found loading badly (each once a traceback or a
    setting that could never work)."""

    def test_huge_integers_are_one_line(self) -> None:
        huge = "1" + "0" * 400
        self.assertRejected(MINIMAL + f"health:\n  interval: {huge}\n",
                            "x.yaml: health.interval: must be a number of seconds, not a number that large")
        self.assertRejected(MINIMAL.replace("  a: http://127.0.0.1:8080", f"  a: {{url: http://127.0.0.1:8080, weight: {huge}}}"),
                            "x.yaml: hosts.a.weight: must be a number, not a number that large")

    def test_bracketed_host_must_be_an_ipv6_address(self) -> None:
        for url in ("http://[zz]:80", "http://[]:80", "https://[1.2.3.4]:443"):
            self.assertRejected(doc(hosts={"a": url}), f"x.yaml: hosts.a: bad IPv6 address in {url!r}")
        c = parse(doc(hosts={"a": "http://[fe80::1%25eth0]:80", "b": "http://[::1]:8080"}, routes={"r": {"hosts": ["a", "b"]}}))
        self.assertEqual(list(c.hosts), ["a", "b"])

    def test_ops_token_must_be_presentable(self) -> None:
        """A secret file's trailing newline made a token no client could send."""
        for value in ("tok123\n", " tok", "a b", "h\u00e9llo"):
            self.assertRejected(MINIMAL + "ops:\n  token: ${T}\n",
                                "x.yaml: ops.token: must be printable ASCII without spaces (it travels in an HTTP header)",
                                {"T": value})


class YAMLTests(_Case):
    def test_duplicate_top_level_key(self) -> None:
        self.assertRejected(
            MINIMAL + 'listen: "tcp:8888"\n', "x.yaml: listen: duplicate key at line 7, column 1 (first at line 1)"
        )

    def test_duplicate_nested_key(self) -> None:
        self.assertRejected(
            MINIMAL + "health:\n  interval: 1\n  timeout: 2\n  interval: 3\n",
            "x.yaml: health.interval: duplicate key at line 10, column 3 (first at line 8)",
        )

    def test_duplicate_host_name(self) -> None:
        self.assertRejected(
            "listen: tcp:1\nhosts:\n  a: http://h1\n  a: http://h2\nroutes: {r: {hosts: [a]}}\n",
            "x.yaml: hosts.a: duplicate key at line 4, column 3 (first at line 3)",
        )

    def test_duplicate_route_name(self) -> None:
        self.assertRejected(
            MINIMAL + "  r:\n    hosts: [a]\n",
            "x.yaml: routes.r: duplicate key at line 7, column 3 (first at line 5)",
        )

    def test_duplicate_key_in_flow_mapping(self) -> None:
        self.assertRejected(
            MINIMAL + "drain: {delay: 1, delay: 2}\n", "x.yaml: drain.delay: duplicate key at line 7, column 19 (first at line 7)"
        )

    def test_duplicate_key_deep_in_route(self) -> None:
        self.assertRejected(
            "listen: tcp:1\nhosts: {a: http://h}\nroutes:\n  r:\n    hosts: [a]\n    default_model: m\n    hosts: [a]\n",
            "x.yaml: routes.r.hosts: duplicate key at line 7, column 5 (first at line 5)",
        )

    def test_same_key_in_different_mappings_is_fine(self) -> None:
        c = parse(doc(health={"timeout": 1}, timeouts={"connect": 1}, hosts={"a": {"url": "http://a"}, "b": {"url": "http://b"}}))
        self.assertEqual(list(c.hosts), ["a", "b"])

    def test_merge_key_may_be_overridden(self) -> None:
        """YAML merge keys (``<<``) are not duplicates of the keys that override them."""
        c = parse(MINIMAL + "health: &h {interval: 1, timeout: 2}\ndrain:\n  <<: {delay: 1, grace: 1}\n  grace: 3\n")
        self.assertEqual(c.drain, DrainSettings(1.0, 3.0))

    def test_invalid_syntax_names_line_and_column(self) -> None:
        self.assertRejected(
            "listen: tcp:1\nhosts: [a\nroutes: {}\n",
            "x.yaml: invalid YAML at line 3, column 7: expected ',' or ']', but got ':'",
        )

    def test_unterminated_quote(self) -> None:
        self.assertRejected(
            'listen: "tcp:1\n', "x.yaml: invalid YAML at line 2, column 1: found unexpected end of stream"
        )

    def test_tab_indentation(self) -> None:
        self.assertRejected(
            "hosts:\n\ta: http://h\n",
            "x.yaml: invalid YAML at line 2, column 1: found character '\\t' that cannot start any token",
        )

    def test_unsafe_tag_refused(self) -> None:
        self.assertRejected(
            "listen: !!python/object/apply:os.system [true]\n",
            "x.yaml: invalid YAML at line 1, column 9: "
            "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'",
        )

    def test_control_characters_are_one_line(self) -> None:
        self.assertRejected("listen: \x00\x01\n", "x.yaml: invalid YAML: unacceptable character #x0000: "
                            "special characters are not allowed")

    def test_deep_nesting_is_one_line(self) -> None:
        self.assertRejected("a: " + "[" * 5000, "x.yaml: invalid YAML: nested too deeply")

    def test_empty_file(self) -> None:
        self.assertRejected("", "x.yaml: the file is empty")

    def test_comment_only_file(self) -> None:
        self.assertRejected("# nothing here\n\n", "x.yaml: the file is empty")

    def test_control_characters_in_keys_stay_on_one_line(self) -> None:
        self.assertRejected(
            MINIMAL + '"a\\nb": 1\n',
            "x.yaml: a\\nb: unknown key (expected one of: listen, health, timeouts, drain, ops, workers, cluster, hosts, routes)",
        )


class EnvironmentTests(_Case):
    def test_token_from_environment(self) -> None:
        c = parse(MINIMAL + "ops:\n  token: ${CROSSBAR_OPS_TOKEN}\n", {"CROSSBAR_OPS_TOKEN": "t0k"})
        self.assertEqual(c.ops.token, "t0k")

    def test_unset_variable_is_an_error_naming_it(self) -> None:
        self.assertRejected(
            MINIMAL + "ops:\n  token: ${CROSSBAR_OPS_TOKEN}\n",
            "x.yaml: ops.token: environment variable CROSSBAR_OPS_TOKEN is not set",
            {"OTHER": "x"},
        )

    def test_empty_variable_gives_empty_token_which_is_refused(self) -> None:
        self.assertRejected(
            MINIMAL + "ops:\n  token: ${T}\n", "x.yaml: ops.token: must not be empty", {"T": ""}
        )

    def test_variable_in_url(self) -> None:
        c = parse(doc(hosts={"a": "http://${GPU_A}:8080/"}), {"GPU_A": "10.0.0.5"})
        self.assertEqual(c.hosts["a"].url.url, "http://10.0.0.5:8080")

    def test_variable_in_route_host_list(self) -> None:
        """``${NAME}`` works in every string value, route host lists included."""
        c = parse(doc(routes={"r": {"hosts": ["${PRIMARY}"]}}), {"PRIMARY": "a"})
        self.assertEqual(c.routes["r"].hosts, ("a",))

    def test_unset_variable_in_url(self) -> None:
        self.assertRejected(
            doc(hosts={"a": {"url": "http://${GPU_A}:8080"}}), "x.yaml: hosts.a.url: environment variable GPU_A is not set"
        )

    def test_expanded_url_is_validated(self) -> None:
        self.assertRejected(
            doc(hosts={"a": "${URL}"}),
            "x.yaml: hosts.a: must be an absolute http:// or https:// URL without query, fragment or spaces, not '${URL}'",
            {"URL": "ftp://h"},
        )

    def test_several_references_in_one_value(self) -> None:
        c = parse(doc(listen="tcp:${PORT}:interface=${IFACE}"), {"PORT": "7000", "IFACE": "127.0.0.1"})
        self.assertEqual(c.listen, "tcp:7000:interface=127.0.0.1")

    def test_expansion_is_not_recursive(self) -> None:
        c = parse(MINIMAL + "ops:\n  token: ${A}\n", {"A": "${B}", "B": "nope"})
        self.assertEqual(c.ops.token, "${B}")

    def test_bad_reference(self) -> None:
        self.assertRejected(MINIMAL + "ops:\n  token: ${1X}\n", "x.yaml: ops.token: bad environment reference ${1X}")

    def test_default_environment_is_os_environ(self) -> None:
        self.patch(os, "environ", {"CROSSBAR_TEST_TOKEN": "from-os"})
        c = parse_config(MINIMAL + "ops:\n  token: ${CROSSBAR_TEST_TOKEN}\n", "x.yaml")
        self.assertEqual(c.ops.token, "from-os")


class LoadConfigTests(_Case):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="crossbar-config-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def mktemp(self) -> str:
        """A fresh path in a private temporary directory (not under the working directory)."""
        return tempfile.mktemp(dir=self.dir)

    def write(self, data: bytes) -> str:
        path = self.mktemp() + ".yaml"
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_loads_file(self) -> None:
        path = self.write(MINIMAL.encode())
        c = load_config(path, environ={})
        self.assertEqual((c.source, list(c.hosts)), (path, ["a"]))

    def test_errors_name_the_file(self) -> None:
        path = self.write(b"listen: tcp:1\n")
        e = self.assertRaises(ConfigError, load_config, path, {})
        self.assertEqual(str(e), f"{path}: hosts: is required")

    def test_missing_file(self) -> None:
        path = self.mktemp()
        e = self.assertRaises(ConfigError, load_config, path)
        self.assertEqual(str(e), f"{path}: cannot read: No such file or directory")

    def test_directory(self) -> None:
        path = self.mktemp()
        os.mkdir(path)
        e = self.assertRaises(ConfigError, load_config, path)
        self.assertEqual(str(e), f"{path}: cannot read: Is a directory")

    def test_unreadable(self) -> None:
        if os.geteuid() == 0:
            raise self.skipTest("running as root: a mode-000 file is still readable")
        path = self.write(MINIMAL.encode())
        os.chmod(path, 0)
        self.addCleanup(os.chmod, path, stat.S_IRUSR | stat.S_IWUSR)
        e = self.assertRaises(ConfigError, load_config, path)
        self.assertEqual(str(e), f"{path}: cannot read: Permission denied")

    def test_not_utf8(self) -> None:
        path = self.write(MINIMAL.encode() + b"# caf\xe9\n")
        e = self.assertRaises(ConfigError, load_config, path)
        self.assertEqual(str(e), f"{path}: cannot read: not UTF-8 (byte 0xe9 at offset {len(MINIMAL) + 5})")

    def test_utf8_with_bom(self) -> None:
        path = self.write(b"\xef\xbb\xbf" + MINIMAL.encode())
        self.assertEqual(load_config(path, environ={}).listen, "tcp:7777:interface=127.0.0.1")

    def test_non_ascii_text(self) -> None:
        path = self.write((MINIMAL + "    default_model: modèle-ß\n").encode())
        self.assertEqual(load_config(path, environ={}).routes["r"].default_model, "modèle-ß")


class _FilesCase(_Case):
    """Cases that need PEM files: a private CA and a client certificate from trustme."""

    def setUp(self) -> None:
        import trustme

        self.dir = tempfile.mkdtemp(prefix="crossbar-config-tls-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.ca = trustme.CA()
        client = self.ca.issue_cert("crossbar-client")
        self.ca_path = self.file("ca.pem", self.ca.cert_pem.bytes())
        self.cert_path = self.file("client.pem", client.cert_chain_pems[0].bytes())
        self.key_path = self.file("client.key", client.private_key_pem.bytes())
        self.key_pem = client.private_key_pem.bytes()

    def file(self, name: str, data: bytes) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def https(self, **tls: object) -> Config:
        return parse(doc(hosts={"a": {"url": "https://gpu-b:8443", "tls": tls}}))

    def rejected_tls(self, tls: dict[str, object], key: str, problem: str) -> None:
        self.assertRejected(doc(hosts={"a": {"url": "https://gpu-b:8443", "tls": tls}}), f"x.yaml: hosts.a.tls{key}: {problem}")


FULL_EXAMPLE = """\
listen: "tcp:7777:interface=127.0.0.1"
workers: 1
hosts:
  gpu-a: http://10.0.0.5:8080
  gpu-b:
    url: https://10.0.0.6:8443
    weight: 2
    max_inflight: 4
    api_key: ${GPU_B_KEY}
    tls:
      ca: CA
      verify: true
      client_cert: CERT
      client_key: KEY
routes:
  opencode-a:
    hosts: [gpu-a, gpu-b]
    default_model: qwen2.5-coder-7b
    primary: gpu-a
    queue:
      max: 100
      timeout: 30
    affinity:
      key: prefix
      balance: 1.25
    keys:
      alice: ${ALICE_KEY}
      ci:
        secret: ${CI_KEY}
        max_inflight: 8
"""
SECRETS = {"GPU_B_KEY": "gpu-b-s3cret-Q9", "ALICE_KEY": "alice-s3cret-Z7", "CI_KEY": "ci-s3cret-W4"}


class NewKeyDefaultsTests(_FilesCase):
    """docs/design.md §Configuration: the keys of balancing, affinity, access and workers."""

    def test_defaults(self) -> None:
        c = parse(MINIMAL)
        self.assertEqual(c.hosts["a"], Host("a", "http://127.0.0.1:8080", weight=1.0, max_inflight=None, api_key=None, tls=None))
        r = c.routes["r"]
        self.assertEqual((r.primary, r.queue, r.affinity, dict(r.keys)), (None, QueueSettings(100, 30.0), AffinitySettings("prefix", 1.25), {}))
        self.assertEqual(c.workers, 1)
        self.assertEqual(c.warnings, ())

    def test_record_defaults_match_design(self) -> None:
        self.assertEqual(
            (QueueSettings(), AffinitySettings(), HostTLSSettings(), Host("h", "http://h")),
            (QueueSettings(100, 30.0), AffinitySettings("prefix", 1.25), HostTLSSettings(None, True, None, None),
             Host("h", "http://h", 1.0, None, None, None)),
        )

    def test_full_design_example(self) -> None:
        text = FULL_EXAMPLE.replace("CA", self.ca_path).replace("CERT", self.cert_path).replace("KEY\n", self.key_path + "\n")
        c = parse(text, SECRETS)
        b = c.hosts["gpu-b"]
        self.assertEqual((b.weight, b.max_inflight, b.api_key), (2.0, 4, "gpu-b-s3cret-Q9"))
        assert b.tls is not None
        self.assertEqual((b.tls.ca, b.tls.verify, b.tls.client_cert, b.tls.client_key), (self.ca_path, True, self.cert_path, self.key_path))
        self.assertEqual(b.tls.ca_pem, self.ca.cert_pem.bytes())
        self.assertTrue(b.tls.client_pem.endswith(self.key_pem))
        r = c.routes["opencode-a"]
        self.assertEqual((r.primary, r.queue, r.affinity), ("gpu-a", QueueSettings(100, 30.0), AffinitySettings("prefix", 1.25)))
        self.assertEqual(
            dict(r.keys),
            {"alice": ClientKey("alice", "alice-s3cret-Z7"), "ci": ClientKey("ci", "ci-s3cret-W4", max_inflight=8)},
        )
        self.assertEqual(r.keys["ci"].digest, hashlib.sha256(b"ci-s3cret-W4").digest())
        self.assertEqual(c.warnings, ())

    def test_reprs_show_no_secret(self) -> None:
        text = FULL_EXAMPLE.replace("CA", self.ca_path).replace("CERT", self.cert_path).replace("KEY\n", self.key_path + "\n")
        c = parse(text + "ops:\n  token: ${OPS}\n", {**SECRETS, "OPS": "ops-s3cret-X1"})
        shown = repr(c) + str(c) + repr(dict(c.routes["opencode-a"].keys)) + repr(c.hosts["gpu-b"])
        for secret in [*SECRETS.values(), "ops-s3cret-X1"]:
            self.assertNotIn(secret, shown)
        key_body = self.key_pem.decode().splitlines()[1]
        self.assertNotIn(key_body, shown)
        self.assertNotIn(key_body[:20], shown)
        self.assertIn("alice", shown)  # names are not secret


class HostBalancingKeyTests(_Case):
    def host(self, **body: object) -> Host:
        return parse(doc(hosts={"a": {"url": "http://h", **body}})).hosts["a"]

    def rejected(self, key: str, value: object, problem: str) -> None:
        self.assertRejected(doc(hosts={"a": {"url": "http://h", key: value}}), f"x.yaml: hosts.a.{key}: {problem}")

    def test_weight(self) -> None:
        self.assertEqual([self.host(weight=w).weight for w in (2, 1.5, 0.25)], [2.0, 1.5, 0.25])

    def test_weight_refused(self) -> None:
        self.rejected("weight", 0, "must be a positive number, not 0")
        self.rejected("weight", -2, "must be a positive number, not -2")
        self.rejected("weight", "heavy", "must be a number, not 'heavy'")
        self.rejected("weight", True, "must be a number, not a boolean")
        self.rejected("weight", float("inf"), "must be a positive number, not inf")
        self.rejected("weight", [1], "must be a number, not a list")
        # Shares stay finite: a denormal weight made the affinity bound overflow.
        self.rejected("weight", 1e-320, "must be between 0.001 and 1,000,000, not 1e-320")
        self.rejected("weight", 1e7, "must be between 0.001 and 1,000,000, not 10000000.0")
        self.rejected("weight", 1000001, "must be between 0.001 and 1,000,000, not 1000001.0")  # was "1e+06, not 1e+06"

    def test_max_inflight(self) -> None:
        self.assertEqual((self.host(max_inflight=4).max_inflight, self.host().max_inflight), (4, None))

    def test_max_inflight_refused(self) -> None:
        self.rejected("max_inflight", 0, "must be at least 1, not 0")
        self.rejected("max_inflight", 2.5, "must be a whole number, not 2.5")
        self.rejected("max_inflight", "many", 'must be a whole number or "slots", not \'many\'')

    def test_max_inflight_slots(self) -> None:
        """Issue 22: ``max_inflight: slots`` takes the host's own slot count; no number
        until the poller reads it (docs/design.md §Choosing a host, rule 2)."""
        host = self.host(max_inflight="slots")
        self.assertEqual((host.max_inflight, host.max_inflight_slots), (None, True))
        self.assertFalse(self.host(max_inflight=4).max_inflight_slots)
        self.assertFalse(self.host().max_inflight_slots)

    def test_api_key(self) -> None:
        c = parse(doc(hosts={"a": {"url": "http://h", "api_key": "${K}"}}), {"K": "sk-1"})
        self.assertEqual(c.hosts["a"].api_key, "sk-1")

    def test_api_key_refused(self) -> None:
        self.rejected("api_key", 12345, "must be a string, not a number")
        self.assertRejected(doc(hosts={"a": {"url": "http://h", "api_key": "${K}"}}), "x.yaml: hosts.a.api_key: must not be empty", {"K": ""})
        self.assertRejected(
            doc(hosts={"a": {"url": "http://h", "api_key": "${K}"}}),
            "x.yaml: hosts.a.api_key: must be printable ASCII without spaces (it travels in an HTTP header)",
            {"K": "two words\r\nX-Injected: 1"},
        )

    def test_tls_on_http_host(self) -> None:
        self.rejected("tls", {"verify": True}, "is only for https:// hosts")

    def test_url_ending_in_v1_warns_naming_the_host(self) -> None:
        c = parse(doc(hosts={"ok": "http://h:1/llama", "gpu-a": "http://h:8080/v1/", "b": {"url": "https://h:2/x/V1"}},
                      routes={"r": {"hosts": ["ok"]}}))
        self.assertEqual(c.hosts["gpu-a"].url.url, "http://h:8080/v1")  # it still loads
        self.assertEqual(
            c.warnings,
            (
                "x.yaml: hosts.gpu-a: host 'gpu-a': the URL ends in /v1, but crossbar adds /v1 itself (requests and "
                "polls would go to .../v1/v1/...): give the host's base URL without /v1",
                "x.yaml: hosts.b.url: host 'b': the URL ends in /v1, but crossbar adds /v1 itself (requests and "
                "polls would go to .../v1/v1/...): give the host's base URL without /v1",
            ),
        )

    def test_load_config_logs_each_warning_once(self) -> None:
        from twisted.logger import formatEvent

        from tests.logs import LogCapture

        events = LogCapture(self).events  # type: ignore[arg-type]  # needs only addCleanup
        d = tempfile.mkdtemp(prefix="crossbar-config-")
        self.addCleanup(shutil.rmtree, d, True)
        path = os.path.join(d, "c.yaml")
        with open(path, "w") as f:
            f.write(doc(hosts={"gpu-a": "http://h:8080/v1"}, routes={"r": {"hosts": ["gpu-a"]}}))
        load_config(path, environ={})
        lines = [formatEvent(e) for e in events if "/v1" in formatEvent(e)]
        self.assertEqual(len(lines), 1)
        self.assertIn("host 'gpu-a'", lines[0])
        self.assertNotIn("\n", lines[0])
        self.assertEqual(events[-1]["log_level"].name, "warn")


class HostTLSTests(_FilesCase):
    def test_ca_and_mutual_tls(self) -> None:
        tls = self.https(ca=self.ca_path, client_cert=self.cert_path, client_key=self.key_path).hosts["a"].tls
        self.assertEqual(tls, HostTLSSettings(self.ca_path, True, self.cert_path, self.key_path,
                                              ca_pem=self.ca.cert_pem.bytes(), client_pem=tls.client_pem if tls else b""))

    def test_empty_tls_means_defaults(self) -> None:
        self.assertEqual(self.https().hosts["a"].tls, HostTLSSettings())

    def test_unreadable_ca(self) -> None:
        missing = os.path.join(self.dir, "nope.pem")
        self.rejected_tls({"ca": missing}, ".ca", f"cannot read {missing!r}: No such file or directory")

    def test_ca_directory(self) -> None:
        self.rejected_tls({"ca": self.dir}, ".ca", f"{self.dir!r} is not a regular file")

    def test_ca_fifo_refused_without_blocking(self) -> None:
        """A FIFO would block the reactor on open/read (at start or on SIGHUP)."""
        fifo = os.path.join(self.dir, "fifo")
        os.mkfifo(fifo)
        self.rejected_tls({"ca": fifo}, ".ca", f"{fifo!r} is not a regular file")

    def test_ca_not_pem(self) -> None:
        self.rejected_tls({"ca": self.file("junk.pem", b"hello\n")}, ".ca", "holds no PEM certificate")

    def test_ca_is_a_key(self) -> None:
        self.rejected_tls({"ca": self.key_path}, ".ca", "holds no PEM certificate")

    def test_cert_without_key(self) -> None:
        self.rejected_tls({"client_cert": self.cert_path}, ".client_key", "is required with client_cert (mutual TLS needs both)")

    def test_key_without_cert(self) -> None:
        self.rejected_tls({"client_key": self.key_path}, ".client_cert", "is required with client_key (mutual TLS needs both)")

    def test_unreadable_key(self) -> None:
        missing = os.path.join(self.dir, "no.key")
        self.rejected_tls({"client_cert": self.cert_path, "client_key": missing}, ".client_key",
                          f"cannot read {missing!r}: No such file or directory")

    def test_key_not_a_key(self) -> None:
        self.rejected_tls({"client_cert": self.cert_path, "client_key": self.cert_path}, ".client_key",
                          "holds no PEM private key crossbar can use")

    def test_key_of_another_certificate(self) -> None:
        other = self.ca.issue_cert("other").private_key_pem.bytes()
        self.rejected_tls({"client_cert": self.cert_path, "client_key": self.file("other.key", other)}, ".client_key",
                          "does not match client_cert")

    def test_encrypted_key(self) -> None:
        from cryptography.hazmat.primitives import serialization

        key = serialization.load_pem_private_key(self.key_pem, None)
        encrypted = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"pw"))
        self.rejected_tls({"client_cert": self.cert_path, "client_key": self.file("enc.key", encrypted)}, ".client_key",
                          "is encrypted (crossbar needs an unencrypted key file)")

    def test_key_file_content_never_in_an_error(self) -> None:
        e = self.assertRaises(ConfigError, parse, doc(hosts={"a": {"url": "https://h", "tls": {"client_cert": self.key_path, "client_key": self.key_path}}}))
        for line in self.key_pem.decode().splitlines()[1:-1]:
            self.assertNotIn(line[:16], str(e))

    def test_verify(self) -> None:
        self.assertFalse(self.https(verify=False).hosts["a"].tls.verify)  # type: ignore[union-attr]
        self.rejected_tls({"verify": "yes"}, ".verify", "must be true or false, not 'yes'")
        self.rejected_tls({"verify": 0}, ".verify", "must be true or false, not a number")

    def test_verify_false_warns_naming_the_host(self) -> None:
        c = self.https(verify=False)
        self.assertEqual(c.warnings, (
            "x.yaml: hosts.a.tls.verify: host 'a': false: its certificate is not checked at all "
            "(anyone on the path can impersonate it)",
        ))

    def test_unknown_tls_key(self) -> None:
        self.rejected_tls({"cafile": "x"}, ".cafile", "unknown key (expected one of: ca, verify, client_cert, client_key)")

    def test_relative_paths_are_relative_to_the_config_file(self) -> None:
        path = self.file("c.yaml", doc(hosts={"a": {"url": "https://h", "tls": {"ca": "ca.pem"}}}).encode())
        tls = load_config(path, environ={}).hosts["a"].tls
        assert tls is not None
        self.assertEqual(tls.ca, os.path.join(self.dir, "ca.pem"))

    def test_same_address_needs_the_same_tls(self) -> None:
        self.assertRejected(
            doc(hosts={"a": {"url": "https://gpu:8443/x", "tls": {"ca": self.ca_path}}, "b": "https://GPU:8443/y"},
                routes={"r": {"hosts": ["a", "b"]}}),
            "x.yaml: hosts.b.tls: differs from host 'a' at the same address (one TLS setting per host and port)",
        )

    def test_same_address_same_tls_is_fine(self) -> None:
        c = parse(doc(hosts={"a": {"url": "https://gpu/x", "tls": {"ca": self.ca_path}},
                             "b": {"url": "https://gpu:443/y", "tls": {"ca": self.ca_path}}},
                      routes={"r": {"hosts": ["a", "b"]}}))
        self.assertEqual(c.hosts["a"].tls, c.hosts["b"].tls)


class _RouteCase(_Case):
    def route(self, **body: object) -> Route:
        return parse(doc(hosts={"a": "http://a", "b": "http://b"}, routes={"r": {"hosts": ["a", "b"], **body}})).routes["r"]

    def rejected(self, body: dict[str, object], key: str, problem: str) -> None:
        self.assertRejected(
            doc(hosts={"a": "http://a", "b": "http://b"}, routes={"r": {"hosts": ["a", "b"], **body}}), f"x.yaml: routes.r.{key}: {problem}"
        )


class RouteBalancingKeyTests(_RouteCase):
    def test_primary(self) -> None:
        self.assertEqual(self.route(primary="b").primary, "b")

    def test_primary_not_in_route(self) -> None:
        self.assertRejected(
            doc(hosts={"a": "http://a", "b": "http://b"}, routes={"r": {"hosts": ["a"], "primary": "b"}}),
            "x.yaml: routes.r.primary: 'b' is not one of the route's hosts (a)",
        )
        self.rejected({"primary": ["a"]}, "primary", "must be a string, not a list")

    def test_queue(self) -> None:
        self.assertEqual(self.route(queue={"max": 0, "timeout": 2.5}).queue, QueueSettings(0, 2.5))
        self.assertEqual(self.route(queue={"timeout": 1}).queue, QueueSettings(100, 1.0))

    def test_queue_refused(self) -> None:
        self.rejected({"queue": {"max": -1}}, "queue.max", "must be at least 0, not -1")
        self.rejected({"queue": {"max": 1.5}}, "queue.max", "must be a whole number, not 1.5")
        self.rejected({"queue": {"timeout": 0}}, "queue.timeout", "must be a positive number of seconds, not 0")
        self.rejected({"queue": {"size": 3}}, "queue.size", "unknown key (expected one of: max, timeout)")
        self.rejected({"queue": 5}, "queue", "must be a mapping, not a number")

    def test_affinity(self) -> None:
        self.assertEqual(self.route(affinity={"key": "none"}).affinity, AffinitySettings("none", 1.25))
        self.assertEqual(self.route(affinity={"balance": 1}).affinity, AffinitySettings("prefix", 1.0))
        self.assertEqual(self.route(affinity={"balance": 2.5}).affinity.balance, 2.5)

    def test_affinity_refused(self) -> None:
        self.rejected({"affinity": {"key": "lru"}}, "affinity.key", "must be prefix or none, not 'lru'")
        self.rejected({"affinity": {"key": False}}, "affinity.key", "must be a string, not a boolean")
        self.rejected({"affinity": {"balance": 0.99}}, "affinity.balance", "must be a number of at least 1, not 0.99")
        self.rejected({"affinity": {"balance": "x"}}, "affinity.balance", "must be a number, not 'x'")
        self.rejected({"affinity": {"on": True}}, "affinity.on", "unknown key (expected one of: key, balance)")


class ModelNameKeyTests(_RouteCase):
    """``aliases`` and ``paths`` (docs/design.md §Model names, §The proxy rule 3)."""

    def test_aliases_resolve_exact_before_globs_then_file_order(self) -> None:
        route = self.route(aliases={"claude-*": "m1", "gpt-4o": "m2", "*": "m3", "claude-x": "m4"})
        self.assertEqual(route.resolve("gpt-4o"), "m2")
        self.assertEqual(route.resolve("claude-x"), "m4")  # exact wins over an earlier glob
        self.assertEqual(route.resolve("claude-sonnet-4-5"), "m1")  # the first glob in file order
        self.assertEqual(route.resolve("qwen"), "m3")
        self.assertEqual(self.route().resolve("gpt-4o"), "gpt-4o")
        self.assertEqual(self.route(aliases={"a.b*": "m"}).resolve("aXb"), "aXb")  # '.' is literal

    def test_aliases_refused(self) -> None:
        self.rejected({"aliases": ["a"]}, "aliases", "must be a mapping, not a list")
        self.rejected({"aliases": {"a": 3}}, "aliases.a", "must be a string, not a number")
        self.rejected({"aliases": {"a": "m*"}}, "aliases.a", "the target must be one model id (no '*')")
        self.rejected({"aliases": {"a": "a"}}, "aliases.a", "an alias of itself")

    def test_paths(self) -> None:
        self.assertEqual(self.route(paths=["/score", "/extra/"]).paths, ("/score", "/extra/"))
        self.assertEqual(self.route().paths, ())

    def test_paths_refused(self) -> None:
        self.rejected({"paths": "/score"}, "paths", "must be a list of paths, not a string")
        self.rejected({"paths": ["score"]}, "paths[0]", "'score' is not a path (printable ASCII starting with '/', no query)")
        self.rejected({"paths": ["/a?b"]}, "paths[0]", "'/a?b' is not a path (printable ASCII starting with '/', no query)")
        self.rejected({"paths": ["/a/../slots"]}, "paths[0]", "'/a/../slots' has a dot-segment")
        for forbidden in ("/slots", "/v1/slots/", "/metrics", "/models/load", "/props", "/%73lots"):
            self.rejected({"paths": [forbidden]}, "paths[0]",
                          f"{forbidden!r} is a forbidden path (it changes a host or shows other clients' data)")


class ClientKeyTests(_Case):
    def keys(self, keys: object, environ: Mapping[str, str] | None = None) -> Mapping[str, ClientKey]:
        return parse(doc(routes={"r": {"hosts": ["a"], "keys": keys}}), environ).routes["r"].keys

    def rejected(self, keys: object, key: str, problem: str, environ: Mapping[str, str] | None = None) -> ConfigError:
        return self.assertRejected(doc(routes={"r": {"hosts": ["a"], "keys": keys}}), f"x.yaml: routes.r.keys{key}: {problem}", environ)

    def test_both_forms(self) -> None:
        keys = self.keys({"alice": "${A}", "ci": {"secret": "ci-1", "max_inflight": 8}}, {"A": "alice-1"})
        self.assertEqual(list(keys), ["alice", "ci"])
        self.assertEqual((keys["alice"].secret, keys["alice"].max_inflight), ("alice-1", None))
        self.assertEqual((keys["ci"].secret, keys["ci"].max_inflight), ("ci-1", 8))

    def test_priority_and_share(self) -> None:
        """docs/design.md §Access, "Fair shares": an integer priority (default 0), a
        positive share (default 1, may be 1.5)."""
        keys = self.keys({"alice": "a-1", "ci": {"secret": "ci-1", "priority": -1, "share": 2},
                          "eval": {"secret": "e-1", "priority": "${P}", "share": 1.5}}, {"P": "3"})
        self.assertEqual((keys["alice"].priority, keys["alice"].share), (0, 1.0))
        self.assertEqual((keys["ci"].priority, keys["ci"].share), (-1, 2.0))
        self.assertEqual((keys["eval"].priority, keys["eval"].share), (3, 1.5))

    def test_priority_and_share_refused(self) -> None:
        self.rejected({"ci": {"secret": "s", "priority": 1.5}}, ".ci.priority", "must be a whole number, not 1.5")
        self.rejected({"ci": {"secret": "s", "priority": "high"}}, ".ci.priority", "must be a whole number, not 'high'")
        self.rejected({"ci": {"secret": "s", "priority": True}}, ".ci.priority", "must be a whole number, not a boolean")
        self.rejected({"ci": {"secret": "s", "share": 0}}, ".ci.share", "must be a positive number, not 0")
        self.rejected({"ci": {"secret": "s", "share": -2}}, ".ci.share", "must be a positive number, not -2")
        self.rejected({"ci": {"secret": "s", "share": "lots"}}, ".ci.share", "must be a number, not 'lots'")
        self.rejected({"ci": {"secret": "s", "share": [1]}}, ".ci.share", "must be a number, not a list")
        self.rejected({"ci": {"secret": "s", "share": 0.0000001}}, ".ci.share",
                      "must be between 0.001 and 1,000,000, not 1e-07")
        self.rejected({"ci": {"secret": "s", "priority": 10**20}}, ".ci.priority",
                      "must be between -1,000,000 and 1,000,000, not 100000000000000000000")

    def test_empty_keys_refused(self) -> None:
        self.rejected({}, "", "must name at least one key (leave keys out for a route open to every client)")

    def test_null_keys_refused(self) -> None:
        """``keys:`` with every key line commented out must not open the route."""
        self.rejected(None, "", "must name at least one key (leave keys out for a route open to every client)")

    def test_empty_secret(self) -> None:
        self.rejected({"alice": "${A}"}, ".alice", "must not be empty", {"A": ""})
        self.rejected({"alice": {"secret": " "}}, ".alice.secret", "must not be empty")

    def test_missing_secret(self) -> None:
        self.rejected({"alice": {"max_inflight": 2}}, ".alice.secret", "is required")

    def test_key_name_refused(self) -> None:
        self.rejected({"": "s-1"}, ".", "a key name must be non-empty, without spaces or control characters")
        self.rejected({"al ice": "s-1"}, ".al ice", "a key name must be non-empty, without spaces or control characters")

    def test_type_errors(self) -> None:
        self.rejected({"alice": 1234}, ".alice", "must be a secret (a string) or a mapping with secret, max_inflight and limits, not a number")
        self.rejected({"alice": {"secret": 1234}}, ".alice.secret", "must be a string, not a number")
        self.rejected({"alice": {"secret": "s", "max_inflight": 0}}, ".alice.max_inflight", "must be at least 1, not 0")
        self.rejected({"alice": {"secret": "s", "limit": 1}}, ".alice.limit", "unknown key (expected one of: secret, max_inflight, limits, priority, share)")
        self.rejected(["alice"], "", "must be a mapping, not a list")

    def test_same_secret_under_two_names(self) -> None:
        e = self.rejected({"alice": "${A}", "bob": "${B}"}, ".bob",
                          "has the same secret as routes.r.keys.alice (a secret names one key in the whole config)",
                          {"A": "shared-s3cret", "B": "shared-s3cret"})
        self.assertNotIn("shared-s3cret", str(e))

    def test_same_secret_under_two_names_on_two_routes(self) -> None:
        self.assertRejected(
            doc(routes={"r": {"hosts": ["a"], "keys": {"alice": "k-1"}}, "s": {"hosts": ["a"], "keys": {"bob": "k-1"}}}),
            "x.yaml: routes.s.keys.bob: has the same secret as routes.r.keys.alice (a secret names one key in the whole config)",
        )

    def test_one_key_on_two_routes_is_fine(self) -> None:
        c = parse(doc(routes={"r": {"hosts": ["a"], "keys": {"alice": "k-1"}}, "s": {"hosts": ["a"], "keys": {"alice": "k-1"}}}))
        self.assertEqual(c.routes["r"].keys["alice"], c.routes["s"].keys["alice"])


class WorkersTests(_Case):
    def test_default_and_number(self) -> None:
        self.assertEqual((parse(MINIMAL).workers, parse(doc(workers=3)).workers), (1, 3))

    def test_auto_is_the_usable_cpus(self) -> None:
        self.patch(os, "sched_getaffinity", lambda pid: {0, 2, 5})
        self.assertEqual(parse(doc(workers="auto")).workers, 3)
        self.assertEqual(parse(MINIMAL + "workers: ${W}\n", {"W": "auto"}).workers, 3)

    def test_usable_cpus_without_sched_getaffinity(self) -> None:
        self.patch(os, "sched_getaffinity", None)
        self.patch(os, "cpu_count", lambda: 6)
        self.assertEqual(usable_cpus(), 6)

    def test_refused(self) -> None:
        self.assertRejected(doc(workers=0), "x.yaml: workers: must be at least 1, not 0")
        self.assertRejected(doc(workers="many"), "x.yaml: workers: must be a whole number or auto, not 'many'")
        self.assertRejected(doc(workers=1.5), "x.yaml: workers: must be a whole number, not 1.5")
        self.assertRejected(doc(workers=True), "x.yaml: workers: must be a whole number or auto, not a boolean")


class FlowMappingReferenceTests(_Case):
    """``${NAME}`` inside a YAML flow mapping or sequence is accepted: references are
    expanded after parsing, so an environment value never changes the structure."""

    def test_in_flow_mapping_and_sequence(self) -> None:
        c = parse("listen: tcp:1\nhosts: {a: {url: ${X}, api_key: ${K}}, b: ${Y}}\nroutes: {r: {hosts: [${A}, b], default_model: ${M}}}\n",
                  {"X": "http://x:1", "Y": "http://y:2/", "K": "k-1", "A": "a", "M": "m"})
        self.assertEqual((c.hosts["a"].url.url, c.hosts["a"].api_key, c.hosts["b"].url.url), ("http://x:1", "k-1", "http://y:2"))
        self.assertEqual((c.routes["r"].hosts, c.routes["r"].default_model), (("a", "b"), "m"))

    def test_value_with_yaml_syntax_stays_verbatim(self) -> None:
        value = "x, y: {z} # not a comment ]"
        for text in (MINIMAL.replace("hosts: [a]", "{hosts: [a], default_model: ${M}}").replace("r:\n    {", "r: {"),
                     MINIMAL + "    default_model: ${M}\n", MINIMAL + '    default_model: "${M}"\n'):
            self.assertEqual(parse(text, {"M": value}).routes["r"].default_model, value)

    def test_unset_variable_in_flow_mapping_names_the_key(self) -> None:
        self.assertRejected("listen: tcp:1\nhosts: {a: {url: ${X}}}\nroutes: {r: {hosts: [a]}}\n",
                            "x.yaml: hosts.a.url: environment variable X is not set")

    def test_yaml_error_after_a_reference_keeps_its_column_and_text(self) -> None:
        self.assertRejected("listen: tcp:1\nhosts: {a: ${X} ]\n",
                            "x.yaml: invalid YAML at line 2, column 17: expected ',' or '}', but got ']'")

    def test_private_use_characters_in_the_file_are_kept(self) -> None:
        c = parse(MINIMAL + "    default_model: \"m\ue000\ue001\"\n")
        self.assertEqual(c.routes["r"].default_model, "m\ue000\ue001")


_SECRET = "s3cret-value-Zq81"


class SecretsNeverInErrorsTests(_FilesCase):
    """A secret from ``${NAME}`` put anywhere, right or wrong, never shows in an error."""

    cases: list[tuple[str, str]] = [
        ("weight", 'hosts: {a: {url: "http://h", weight: "${S}"}}'),
        ("max_inflight", 'hosts: {a: {url: "http://h", max_inflight: "${S}"}}'),
        ("url", 'hosts: {a: "${S}"}'),
        ("url_in_mapping", 'hosts: {a: {url: "http://${S}:x"}}'),
        ("verify", 'hosts: {a: {url: "https://h", tls: {verify: "${S}"}}}'),
        ("ca", 'hosts: {a: {url: "https://h", tls: {ca: "/nonexistent/${S}"}}}'),
        ("health", 'health: {interval: "${S}"}\nhosts: {a: "http://h"}'),
        ("workers", 'workers: "${S}"\nhosts: {a: "http://h"}'),
    ]
    route_cases: list[tuple[str, str]] = [
        ("route_host", 'hosts: ["${S}"]'),
        ("primary", 'hosts: [a], primary: "${S}"'),
        ("affinity_key", 'hosts: [a], affinity: {key: "${S}"}'),
        ("balance", 'hosts: [a], affinity: {balance: "${S}"}'),
        ("queue_max", 'hosts: [a], queue: {max: "${S}"}'),
        ("key_max_inflight", 'hosts: [a], keys: {alice: {secret: x-1, max_inflight: "${S}"}}'),
        ("duplicate_secret", 'hosts: [a], keys: {alice: "${S}", bob: "${S}"}'),
        ("secret_with_space", 'hosts: [a], keys: {alice: "${S} x"}'),
    ]

    def test_no_error_shows_the_secret(self) -> None:
        texts = [f"listen: tcp:1\n{body}\nroutes: {{r: {{hosts: [a]}}}}\n" for _, body in self.cases]
        texts += [f'listen: tcp:1\nhosts: {{a: "http://h"}}\nroutes: {{r: {{{body}}}}}\n' for _, body in self.route_cases]
        texts += ["listen: tcp:1\nhosts: {a: {url: http://h, api_key: ${S}}}\nroutes: {r: {hosts: [a], keys: {a: ${S}, b: ${S}}}}\n"]
        for text in texts:
            e = self.assertRaises(ConfigError, parse, text, {"S": _SECRET})
            self.assertNotIn(_SECRET, str(e), text)
            self.assertNotIn(_SECRET, repr(e.args), text)
            self.assertNotIn(_SECRET[:8], str(e), text)
