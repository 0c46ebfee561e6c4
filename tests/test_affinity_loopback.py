"""Cache affinity end to end on loopback (docs/design.md §"Cache affinity"; issue 12).

A real crossbar in-process (tests/harness.py) in front of two :class:`FakeLlama` hosts:
every turn of a conversation (growing ``messages``) goes to the host its key ranks
first while load allows; a burst beyond the bound spills (log line, status, metrics);
``prompt_cache_key`` and ``user`` override the prefix; ``affinity: {key: none}`` spreads
evenly; a reload that changes ``affinity`` applies. (Bad ``affinity.key`` / ``balance``
values are refused with the one-line error in tests/test_config.py,
``RouteBalancingKeyTests.test_affinity_refused``.)
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from typing import Any

import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.hosts import affinity
from crossbar.config import load_config
from crossbar.proxy.peek import peek
from crossbar.process.service import CrossbarService, make_service
from tests.harness import FakeLlama, http_client, listen, start_crossbar, upstream_requests, wait_for
from tests.logs import LogCapture

SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 8


def conversation(i: int, turns: int) -> list[dict[str, str]]:
    """The ``messages`` of conversation ``i`` at turn ``turns`` (1-based): one shared
    system prompt, a first user message of its own, then growing turns."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Conversation {i}: refactor module {i} of the proxy."}]
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"Done step {t} of conversation {i}."},
                     {"role": "user", "content": f"Now step {t + 1}, with this tool output: {'x' * 40 * t}"}]
    return messages


def body(messages: list[dict[str, str]], **extra: str) -> dict[str, Any]:
    return {"model": "tiny-a", "messages": messages, "max_tokens": 4, **extra}


def home_of(doc: dict[str, Any], hosts: tuple[str, ...] = ("a", "b")) -> str:
    """The host the request body ``doc`` ranks first (equal weights), by crossbar's own
    key and ranking: what the loopback run must agree with."""
    key = peek(json.dumps(doc).encode()).affinity_key
    assert key is not None, doc
    return affinity.rank(key, [(h, 1.0) for h in hosts])[0]


class Hold:
    """A chat-completions handler that keeps every request open until :meth:`release`.

    :ivar held: the requests waiting for an answer, in arrival order.
    """

    def __init__(self) -> None:
        self.held: list[Request] = []

    def __call__(self, request: Request, body: bytes) -> Any:
        self.held.append(request)
        return NOT_DONE_YET

    def release(self) -> None:
        held, self.held = self.held, []
        for request in held:
            if not request.finished and not request._disconnected:
                request.setHeader(b"content-type", b"application/json")
                request.write(b'{"object": "chat.completion", "choices": []}')
                request.finish()


def config(urls: dict[str, str], affinity_yaml: str = "") -> str:
    text = "health: {interval: 60, timeout: 5}\nhosts:\n"
    text += "".join(f"  {name}: {url}\n" for name, url in urls.items())
    text += "routes:\n  r:\n    hosts: [a, b]\n"
    if affinity_yaml:
        text += f"    affinity: {affinity_yaml}\n"
    return text


class AffinityLoopbackTests(TestCase):
    timeout = 60

    async def start(self, affinity_yaml: str = "") -> tuple[CrossbarService, str]:
        self.hosts = {"a": FakeLlama(["tiny-a"]), "b": FakeLlama(["tiny-a"])}
        self.urls = {name: await listen(self, host) for name, host in self.hosts.items()}
        self.log = LogCapture(self)
        self.http = http_client(self)
        service, base = await start_crossbar(self, config(self.urls, affinity_yaml))
        await service.poller.when_first_round_done()
        return service, base

    async def post(self, base: str, doc: dict[str, Any]) -> str:
        """POST a chat completion through route ``r``; the X-Crossbar-Host it names."""
        response = await self.http.post(base + "/r/v1/chat/completions", json=doc)
        await treq.content(response)
        self.assertEqual(response.code, 200)
        return (response.headers.getRawHeaders(b"x-crossbar-host") or [b""])[0].decode()

    async def status(self, base: str) -> dict[str, Any]:
        return await treq.json_content(await self.http.get(base + "/_crossbar/status"))

    def outcomes(self) -> list[str]:
        """The ``affinity=`` word of every proxied log line, in order."""
        return [word.split("=", 1)[1] for e in self.log.proxied() for word in e["why"].split() if word.startswith("affinity=")]

    def test_conversations_stay_home(self) -> Deferred[None]:
        """8 conversations interleaved, 6 growing turns each: every turn of one
        conversation goes to the host its key ranks first, both hosts get some, and
        every line says ``affinity=home``."""

        async def go() -> None:
            _, base = await self.start()
            order = random.Random(7)
            seen: dict[int, list[str]] = {i: [] for i in range(8)}
            for turn in range(1, 7):
                for i in order.sample(range(8), 8):
                    seen[i].append(await self.post(base, body(conversation(i, turn))))
            homes = {i: home_of(body(conversation(i, 1))) for i in range(8)}
            self.assertEqual(seen, {i: [homes[i]] * 6 for i in range(8)})
            self.assertEqual(set(homes.values()), {"a", "b"}, "8 keys all ranked one host first")
            self.assertEqual(self.outcomes(), ["home"] * 48)
            self.assertEqual(
                [len(upstream_requests(self.hosts[h])) for h in ("a", "b")],
                [6 * list(homes.values()).count(h) for h in ("a", "b")],
            )
            aff = (await self.status(base))["routes"]["r"]["affinity"]
            self.assertEqual(aff, {"key": "prefix", "balance": 1.25, "home": 48, "spill": 0, "none": 0})

        return ensureDeferred(go())

    def test_burst_beyond_the_bound_spills(self) -> Deferred[None]:
        """Four requests of one conversation held in flight at once (balance 1.25, two
        equal hosts): the bound ceil(1.25 x (n + 1) / 2) lets the home host take the 1st,
        2nd and 4th; the 3rd spills to the other host. Log, status and metrics say so."""

        async def go() -> None:
            _, base = await self.start()
            holds = {name: Hold() for name in self.hosts}
            for name, host in self.hosts.items():
                host.handlers[b"/v1/chat/completions"] = holds[name]
            doc = body(conversation(3, 2))
            home = home_of(doc)
            away = "b" if home == "a" else "a"
            answers = []
            for n in range(1, 5):
                answers.append(ensureDeferred(self.post(base, doc)))
                await wait_for(lambda: sum(len(h.held) for h in holds.values()) == n, 5, f"request {n} held")
            self.assertEqual((len(holds[home].held), len(holds[away].held)), (3, 1))
            status = await self.status(base)
            self.assertEqual({h: status["hosts"][h]["inflight"] for h in ("a", "b")}, {home: 3, away: 1})
            for hold in holds.values():
                hold.release()
            hosts = [await answer for answer in answers]
            self.assertEqual(hosts, [home, home, away, home])
            self.assertEqual(self.outcomes().count("spill"), 1)
            self.assertEqual(self.outcomes().count("home"), 3)
            spill = [e for e in self.log.proxied() if "affinity=spill" in e["why"]]
            self.assertEqual([e["host"] for e in spill], [away])
            aff = (await self.status(base))["routes"]["r"]["affinity"]
            self.assertEqual((aff["home"], aff["spill"], aff["none"]), (3, 1, 0))
            metrics = (await treq.content(await self.http.get(base + "/_crossbar/metrics"))).decode()
            counted = {
                sample.labels["outcome"]: sample.value
                for family in text_string_to_metric_families(metrics) if family.name == "crossbar_affinity"
                for sample in family.samples if sample.name == "crossbar_affinity_total" and sample.labels["route"] == "r"
            }
            self.assertEqual(counted, {"home": 3.0, "spill": 1.0, "none": 0.0})  # every outcome, from 0

        return ensureDeferred(go())

    def test_prompt_cache_key_and_user_override_the_prefix(self) -> Deferred[None]:
        """Two conversations whose prefixes rank different hosts first land on one host
        when they carry the same ``prompt_cache_key`` (or the same ``user``);
        ``prompt_cache_key`` wins over ``user``."""

        async def go() -> None:
            _, base = await self.start()
            first = body(conversation(0, 1))
            other = next(body(conversation(i, 1)) for i in range(1, 50) if home_of(body(conversation(i, 1))) != home_of(first))
            self.assertNotEqual(await self.post(base, first), await self.post(base, other))
            for field in ("prompt_cache_key", "user"):
                # a value whose home differs from one of the two prefixes' homes
                value = next(f"{field}-{n}" for n in range(50)
                             if home_of({**first, field: f"{field}-{n}"}) != home_of(first))
                hosts = {await self.post(base, {**doc, field: value}) for doc in (first, other)}
                self.assertEqual(hosts, {home_of({**first, field: value})}, field)
            # both present: prompt_cache_key decides
            pck = next(f"k{n}" for n in range(50)
                       if home_of({**first, "prompt_cache_key": f"k{n}"}) != home_of({**first, "user": "u"}))
            host = await self.post(base, {**first, "prompt_cache_key": pck, "user": "u"})
            self.assertEqual(host, home_of({**first, "prompt_cache_key": pck}))
            self.assertNotEqual(host, home_of({**first, "user": "u"}))
            self.assertEqual(self.outcomes(), ["home"] * len(self.outcomes()))

        return ensureDeferred(go())

    def test_affinity_off_spreads_evenly(self) -> Deferred[None]:
        """``affinity: {key: none}``: one conversation's 20 turns alternate between the
        two idle hosts (least-busy, ties in turn) and every line says
        ``affinity=none``."""

        async def go() -> None:
            _, base = await self.start("{key: none}")
            hosts = Counter([await self.post(base, body(conversation(5, turn % 6 + 1))) for turn in range(20)])
            self.assertEqual(hosts, Counter({"a": 10, "b": 10}))
            self.assertEqual(self.outcomes(), ["none"] * 20)
            aff = (await self.status(base))["routes"]["r"]["affinity"]
            self.assertEqual(aff, {"key": "none", "balance": 1.25, "home": 0, "spill": 0, "none": 20})

        return ensureDeferred(go())

    def test_reload_changing_affinity_applies(self) -> Deferred[None]:
        """A reload from ``affinity: {key: none}`` to the default turns affinity on for
        the next requests; status shows the new setting."""

        async def go() -> None:
            self.hosts = {"a": FakeLlama(["tiny-a"]), "b": FakeLlama(["tiny-a"])}
            urls = {name: await listen(self, host) for name, host in self.hosts.items()}
            self.log = LogCapture(self)
            self.http = http_client(self)
            directory = os.path.abspath(self.mktemp())
            os.makedirs(directory)
            path = os.path.join(directory, "crossbar.yaml")
            listen_line = 'listen: "tcp:0:interface=127.0.0.1"\ndrain: {delay: 0.001, grace: 0.001}\n'
            with open(path, "w", encoding="utf-8") as f:
                f.write(listen_line + config(urls, "{key: none}"))
            service = make_service(load_config(path))
            service.startService()
            self.addCleanup(service.stopService)
            port = await service.web.when_listening()
            base = f"http://127.0.0.1:{port.getHost().port}"  # type: ignore[attr-defined]
            await service.poller.when_first_round_done()

            doc = body(conversation(2, 3))
            before = [await self.post(base, doc) for _ in range(4)]
            self.assertEqual(sorted(before), ["a", "a", "b", "b"])
            with open(path, "w", encoding="utf-8") as f:
                f.write(listen_line + config(urls, "{key: prefix, balance: 2}"))
            self.assertTrue(service.reload())
            after = [await self.post(base, doc) for _ in range(4)]
            self.assertEqual(after, [home_of(doc)] * 4)
            self.assertEqual(self.outcomes(), ["none"] * 4 + ["home"] * 4)
            aff = (await self.status(base))["routes"]["r"]["affinity"]
            self.assertEqual((aff["key"], aff["balance"], aff["home"]), ("prefix", 2.0, 4))

        return ensureDeferred(go())
