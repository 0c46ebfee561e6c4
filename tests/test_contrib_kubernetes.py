"""``contrib/kubernetes/`` checked against the crossbar config it ships (docs/design.md
§Operations: drain timing; §Workers: a Kubernetes Service probing readyz).

The manifests are loaded with PyYAML; the ConfigMap's ``crossbar.yaml`` is parsed by
crossbar's own :func:`crossbar.config.parse_config`, with the environment the Deployment
gives the container (so every ``${NAME}`` in it must be provided there). Then
:func:`problems` applies the timing and wiring rules; the shipped files must have none,
and each rule is shown to catch a broken copy.
"""

from __future__ import annotations

import copy
import glob
import os
import re
from typing import Any

import yaml
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import Config, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRECTORY = os.path.join(ROOT, "contrib", "kubernetes")

# terminationGracePeriodSeconds must exceed drain.delay + drain.grace by this much (s):
# after the grace crossbar aborts what is left and twistd stops the reactor, which
# tests/test_drain.py bounds at 2 s; the rest covers the kubelet's own signalling and a
# loaded node. Less than that and a drain that uses its whole grace ends in SIGKILL.
MARGIN = 5.0
COMMAND = ["twistd", "-n", "--pidfile=", "crossbar", "--config", "/etc/crossbar/crossbar.yaml"]


def load_manifests(directory: str = DIRECTORY) -> dict[str, dict[str, Any]]:
    """Every document of the ``*.yaml`` files in ``directory``: crossbar's own (named
    ``crossbar``) by ``kind``, any other by ``kind/name`` (``Deployment/redis``).

    :raises AssertionError: a key appears twice.
    """
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if doc is None:
                    continue
                name = doc["metadata"]["name"]
                key = doc["kind"] if name == "crossbar" else f"{doc['kind']}/{name}"
                assert key not in out, f"{path}: a second {key}"
                out[key] = doc
    return out


def listen_port(endpoint: str) -> int | None:
    """The port of a Twisted ``tcp:``/``tcp6:``/``ssl:`` server endpoint string
    (``tcp:7777:interface=0.0.0.0``, ``tcp:port=7777``); None for other kinds
    (``systemd:``, ``unix:``)."""
    parts = re.split(r"(?<!\\):", endpoint)
    if parts[0] not in ("tcp", "tcp6", "ssl"):
        return None
    positional = [p for p in parts[1:] if "=" not in p]
    named = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    value = named.get("port", positional[0] if positional else None)
    return int(value) if value is not None and value.isdigit() else None


def container(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The crossbar container of the Deployment."""
    containers = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "crossbar")


def container_environ(c: dict[str, Any]) -> dict[str, str]:
    """The environment the container gets: literal values, and a stand-in for values
    taken from a Secret or ConfigMap (present at run time, unknown here)."""
    return {e["name"]: str(e["value"]) if "value" in e else f"<{e['name']}-from-valueFrom>" for e in c.get("env", [])}


def shipped_config(manifests: dict[str, dict[str, Any]]) -> Config:
    """The ConfigMap's crossbar.yaml, parsed by crossbar with the container's environment.

    :raises crossbar.config.ConfigError: it is not a valid crossbar config there.
    """
    text = manifests["ConfigMap"]["data"]["crossbar.yaml"]
    return parse_config(text, "contrib/kubernetes/configmap.yaml: crossbar.yaml", container_environ(container(manifests)))


def problems(manifests: dict[str, dict[str, Any]]) -> list[str]:
    """Every broken rule of the Kubernetes manifests, as readable lines ([] when fine)."""
    out: list[str] = []
    config = shipped_config(manifests)
    deployment, service, config_map = manifests["Deployment"], manifests["Service"], manifests["ConfigMap"]
    pod = deployment["spec"]["template"]
    c = container(manifests)

    # The process and its config file.
    if c.get("command") != COMMAND:
        out.append(f"command is {c.get('command')}, not {COMMAND}")
    config_path = COMMAND[-1]
    mounts = [m for m in c.get("volumeMounts", []) if config_path.startswith(m["mountPath"].rstrip("/") + "/")]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    if not any(volumes.get(m["name"], {}).get("configMap", {}).get("name") == config_map["metadata"]["name"]
               and os.path.basename(config_path) in config_map["data"] for m in mounts):
        out.append(f"{config_path} is not the ConfigMap's crossbar.yaml")

    # Drain timing.
    drain = config.drain
    grace_period = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if not grace_period > drain.delay + drain.grace + MARGIN:
        out.append(f"terminationGracePeriodSeconds {grace_period} <= drain.delay {drain.delay} + drain.grace "
                   f"{drain.grace} + {MARGIN} s margin")
    ready, live = c.get("readinessProbe", {}), c.get("livenessProbe", {})
    noticed = ready.get("periodSeconds", 10) * ready.get("failureThreshold", 3)
    if noticed > drain.delay:
        out.append(f"readinessProbe period * failureThreshold = {noticed} s > drain.delay {drain.delay} s")
    outlasts = live.get("periodSeconds", 10) * live.get("failureThreshold", 3)
    if not outlasts > drain.grace:
        out.append(f"livenessProbe period * failureThreshold = {outlasts} s <= drain.grace {drain.grace} s: "
                   "a drain (no longer accepting) would trip it")

    # Probes: paths, and the port crossbar listens on.
    port = listen_port(config.listen)
    if port is None:
        out.append(f"listen {config.listen!r} has no TCP port to probe")
    named_ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    for name, probe, path in (("livenessProbe", live, "/_crossbar/livez"), ("readinessProbe", ready, "/_crossbar/readyz")):
        get = probe.get("httpGet", {})
        if get.get("path") != path:
            out.append(f"{name} path is {get.get('path')!r}, not {path}")
        probe_port = named_ports.get(get.get("port"), get.get("port"))
        if probe_port != port:
            out.append(f"{name} port {get.get('port')!r} is {probe_port}, crossbar listens on {port}")
        if get.get("scheme", "HTTP") != ("HTTPS" if config.listen.startswith("ssl:") else "HTTP"):
            out.append(f"{name} scheme {get.get('scheme')} does not match listen {config.listen!r}")

    # The Service reaches these pods on crossbar's port.
    labels = pod["metadata"]["labels"]
    for what, selector in (("Deployment selector", deployment["spec"]["selector"]["matchLabels"]),
                           ("Service selector", service["spec"]["selector"])):
        if any(labels.get(k) != v for k, v in selector.items()):
            out.append(f"{what} {selector} does not match the pod labels {labels}")
    for p in service["spec"]["ports"]:
        target = named_ports.get(p.get("targetPort"), p.get("targetPort", p.get("port")))
        if target != port:
            out.append(f"Service port {p.get('port')} targets {target}, crossbar listens on {port}")

    # Secrets stay out of the manifests: ${NAME} values come from a Secret.
    for e in c.get("env", []):
        if f"${{{e['name']}}}" in config_map["data"]["crossbar.yaml"] and "secretKeyRef" not in e.get("valueFrom", {}):
            out.append(f"{e['name']} (used in crossbar.yaml) is not taken from a Secret")

    out += redis_problems(manifests, config)
    return out


def redis_problems(manifests: dict[str, dict[str, Any]], config: Config) -> list[str]:
    """``cluster.redis`` (docs/design.md §Several crossbars) reaches the shipped Redis: a
    Service named as the URL's host, on its port, selecting the Redis pods, whose
    container listens there and takes its password from the Secret crossbar's
    ``${REDIS_PASSWORD}`` comes from."""
    if config.cluster is None:
        return ["crossbar.yaml has no cluster.redis: the pods would count alone"]
    url = config.cluster.redis
    out: list[str] = []
    service = manifests.get(f"Service/{url.host.split('.')[0]}")
    deployment = manifests.get("Deployment/redis")
    if service is None or deployment is None:
        return [f"cluster.redis host {url.host!r} is not the shipped Redis Service (Service/redis)"]
    pod = deployment["spec"]["template"]
    redis = next(c for c in pod["spec"]["containers"] if c["name"] == "redis")
    named = {p["name"]: p["containerPort"] for p in redis.get("ports", []) if "name" in p}
    ports = [p for p in service["spec"]["ports"] if p.get("port") == url.port]
    if not ports:
        out.append(f"Service/redis has no port {url.port} (cluster.redis)")
    for p in ports:
        target = named.get(p.get("targetPort"), p.get("targetPort", p.get("port")))
        if target not in named.values():
            out.append(f"Service/redis port {url.port} targets {target}, Redis listens on {sorted(named.values())}")
    labels = pod["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in service["spec"]["selector"].items()):
        out.append(f"Service/redis selector {service['spec']['selector']} does not match the Redis pod labels")

    def secret(env: list[dict[str, Any]], name: str) -> Any:
        return next((e.get("valueFrom", {}).get("secretKeyRef") for e in env if e["name"] == name), None)

    if url.password is not None:
        theirs = secret(container(manifests).get("env", []), "REDIS_PASSWORD")
        ours = secret(redis.get("env", []), "REDIS_PASSWORD")
        if theirs is None or theirs != ours:
            out.append(f"Redis's REDIS_PASSWORD ({ours}) is not the Secret crossbar's comes from ({theirs})")
        if "$(REDIS_PASSWORD)" not in redis.get("args", []):
            out.append("redis-server is not started with --requirepass $(REDIS_PASSWORD)")
    return out


class ShippedManifestTests(SynchronousTestCase):
    def test_shipped_manifests_keep_every_rule(self) -> None:
        manifests = load_manifests()
        self.assertEqual(set(manifests), {"ConfigMap", "Deployment", "Service", "Deployment/redis", "Service/redis"})
        self.assertEqual(problems(manifests), [])

    def test_readme_shows_the_shipped_probe_numbers(self) -> None:
        """Issue 20 item 11: the operations guide's Kubernetes snippet had other probe numbers than
        the shipped deployment (a readiness period of 2 s and threshold 1 against 1 s
        and 2). Every number it shows is the manifest's."""
        with open(os.path.join(ROOT, "docs", "operations.md"), encoding="utf-8") as f:
            readme = f.read()
        block = readme.split("\nKubernetes:\n", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
        shown = yaml.safe_load(block)
        manifests = load_manifests()
        pod = manifests["Deployment"]["spec"]["template"]["spec"]
        shipped = container(manifests)
        self.assertEqual(shown["terminationGracePeriodSeconds"], pod["terminationGracePeriodSeconds"])
        for probe in ("livenessProbe", "readinessProbe"):
            numbers = {k: v for k, v in shipped[probe].items() if k != "httpGet"}
            self.assertEqual({k: v for k, v in shown[probe].items() if k != "httpGet"}, numbers, probe)
            self.assertEqual(shown[probe]["httpGet"]["path"], shipped[probe]["httpGet"]["path"])

    def test_config_is_the_one_crossbar_parses(self) -> None:
        """The numbers checked are the ConfigMap's own, as crossbar reads them."""
        config = shipped_config(load_manifests())
        self.assertEqual((config.drain.delay, config.drain.grace), (5.0, 25.0))
        self.assertEqual(listen_port(config.listen), 7777)
        self.assertEqual(config.ops.token, "<CROSSBAR_OPS_TOKEN-from-valueFrom>")
        assert config.cluster is not None
        redis = config.cluster.redis
        self.assertEqual((redis.tls, redis.host, redis.port, redis.db), (False, "redis", 6379, 0))
        self.assertEqual(redis.password, "<REDIS_PASSWORD-from-valueFrom>")
        self.assertEqual({h.max_inflight_slots for h in config.hosts.values()}, {True})


class RuleTests(SynchronousTestCase):
    """Each rule catches a broken copy of the shipped manifests."""

    def broken(self, edit: Any) -> list[str]:
        manifests = copy.deepcopy(load_manifests())
        edit(manifests)
        return problems(manifests)

    def set_config(self, manifests: dict[str, dict[str, Any]], old: str, new: str) -> None:
        text = manifests["ConfigMap"]["data"]["crossbar.yaml"]
        self.assertIn(old, text)
        manifests["ConfigMap"]["data"]["crossbar.yaml"] = text.replace(old, new)

    def test_grace_period_too_short(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            m["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 34

        self.assertEqual(len(self.broken(edit)), 1)
        self.assertIn("terminationGracePeriodSeconds 34", self.broken(edit)[0])

    def test_longer_grace_in_config_needs_longer_period(self) -> None:
        found = self.broken(lambda m: self.set_config(m, "grace: 25", "grace: 60"))
        self.assertTrue(any("terminationGracePeriodSeconds 40" in p for p in found), found)

    def test_readiness_too_slow_for_the_delay(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            container(m)["readinessProbe"]["periodSeconds"] = 3

        self.assertEqual(self.broken(edit), ["readinessProbe period * failureThreshold = 6 s > drain.delay 5.0 s"])

    def test_shorter_delay_in_config(self) -> None:
        found = self.broken(lambda m: self.set_config(m, "delay: 5", "delay: 1"))
        self.assertTrue(any(p.startswith("readinessProbe period") for p in found), found)

    def test_liveness_tripped_by_drain(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            container(m)["livenessProbe"]["failureThreshold"] = 2

        self.assertTrue(self.broken(edit)[0].startswith("livenessProbe period * failureThreshold = 20 s"))

    def test_probe_paths_and_ports(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            container(m)["readinessProbe"]["httpGet"]["path"] = "/_crossbar/livez"
            container(m)["livenessProbe"]["httpGet"]["port"] = 8080

        self.assertEqual(self.broken(edit), [
            "livenessProbe port 8080 is 8080, crossbar listens on 7777",
            "readinessProbe path is '/_crossbar/livez', not /_crossbar/readyz",
        ])

    def test_listen_port_moved(self) -> None:
        found = self.broken(lambda m: self.set_config(m, 'listen: "tcp:7777"', 'listen: "tcp:port=7788"'))
        self.assertEqual(len([p for p in found if "crossbar listens on 7788" in p]), 3, found)

    def test_service_and_selectors(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            m["Service"]["spec"]["selector"] = {"app.kubernetes.io/name": "other"}
            m["Service"]["spec"]["ports"][0]["targetPort"] = 9000

        found = self.broken(edit)
        self.assertEqual(len(found), 2, found)

    def test_config_file_not_mounted(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            container(m)["volumeMounts"][0]["mountPath"] = "/etc/other"

        self.assertEqual(self.broken(edit), ["/etc/crossbar/crossbar.yaml is not the ConfigMap's crossbar.yaml"])

    def test_secret_must_come_from_a_secret(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            container(m)["env"][0] = {"name": "CROSSBAR_OPS_TOKEN", "value": "hunter2"}

        self.assertEqual(self.broken(edit), ["CROSSBAR_OPS_TOKEN (used in crossbar.yaml) is not taken from a Secret"])

    def test_config_variable_missing_from_env(self) -> None:
        """crossbar's own parser refuses a ${NAME} the Deployment does not provide."""
        from crossbar.config import ConfigError

        def edit(m: dict[str, dict[str, Any]]) -> None:
            container(m)["env"] = [e for e in container(m)["env"] if e["name"] != "CROSSBAR_OPS_TOKEN"]

        with self.assertRaises(ConfigError) as caught:
            self.broken(edit)
        self.assertIn("CROSSBAR_OPS_TOKEN", str(caught.exception))


    def test_redis_service_port(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            m["Service/redis"]["spec"]["ports"][0]["port"] = 6380

        self.assertEqual(self.broken(edit), ["Service/redis has no port 6379 (cluster.redis)"])

    def test_redis_elsewhere(self) -> None:
        found = self.broken(lambda m: self.set_config(m, "@redis:6379", "@cache:6379"))
        self.assertEqual(found, ["cluster.redis host 'cache' is not the shipped Redis Service (Service/redis)"])

    def test_redis_password_from_another_secret(self) -> None:
        def edit(m: dict[str, dict[str, Any]]) -> None:
            env = m["Deployment/redis"]["spec"]["template"]["spec"]["containers"][0]["env"]
            env[0]["valueFrom"]["secretKeyRef"]["name"] = "other"

        found = self.broken(edit)
        self.assertEqual(len(found), 1, found)
        self.assertIn("is not the Secret crossbar's comes from", found[0])

    def test_no_cluster(self) -> None:
        found = self.broken(lambda m: self.set_config(m, "cluster:\n  redis: redis://:${REDIS_PASSWORD}@redis:6379/0\n", ""))
        self.assertEqual(found, ["crossbar.yaml has no cluster.redis: the pods would count alone"])


class ListenPortTests(SynchronousTestCase):
    def test_endpoint_strings(self) -> None:
        self.assertEqual(listen_port("tcp:7777"), 7777)
        self.assertEqual(listen_port("tcp:7777:interface=0.0.0.0"), 7777)
        self.assertEqual(listen_port("tcp:port=8080:interface=\\:\\:"), 8080)
        self.assertEqual(listen_port("tcp6:9000:interface=\\:\\:1"), 9000)
        self.assertIsNone(listen_port("systemd:domain=INET:index=0"))
        self.assertIsNone(listen_port("unix:/run/crossbar.sock"))
