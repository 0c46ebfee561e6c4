"""A loopback stand-in for llama-server in router mode (``--models-dir``, ``--models-max N``):
the shapes crossbar reads and sends, with a model's loading time, the ``--models-max``
bound and eviction modelled as llama-server 0.7.0 does them (measured against the real
server, see bench/README.md §Where models live):

- ``GET /health`` → 200; ``GET /v1/models`` (and ``/models``) lists every model with
  ``"status": {"value": "loaded" | "loading" | "unloaded"}`` (a model waiting at the host
  for a place is still ``unloaded``);
- ``POST /v1/chat/completions`` naming M: a loaded M answers at once (streamed when asked:
  ``n`` events ``delay`` s apart); else the request joins the host's queue (one entry per
  model, first come first loaded, one load at a time). Only the front entry loads, and
  only with a place free (loaded + loading < ``models_max``); places are freed by evicting
  *idle* models (no request in flight, none queued for them), least recently used first
  (last request served), as many as the queue needs. A model with a request in flight is
  never evicted: the queue waits until one falls idle. 400 when M is not listed;
- ``POST /models/load {"model": M}`` → ``{"success": true}`` and M loads in the background
  (``load_time`` seconds), evicting the least recently used idle model when full; 500
  ``model limit reached, try again later`` when full and every model is in use; 400
  ``model is already running`` when M is loaded or loading, 404 for a model it does not
  list;
- ``POST /models/unload {"model": M}`` → ``{"success": true}``: M unloads, and answers in
  flight on it are cut (the connection aborted, as the real server's stopped child ends
  them); 400 ``model is not found`` for a model it does not list. With ``unload_time``
  the host takes that many seconds to stop M: M stays listed (and served) as loaded
  until then, and the answer comes when it is gone.

:ivar loads: every load the host started, in order (model ids); :ivar evictions: likewise.
:ivar load_wait: seconds requests spent at the host waiting for their model (a place and
    its load; summed).
:ivar cut: answers cut by an unload.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from tests.harness import sse_event

__all__ = ["FakeRouter", "placement_yaml"]


class FakeRouter(Resource):
    """One router-mode host listing ``models``; ``models_max`` (0: no limit),
    ``load_time`` seconds per load and ``unload_time`` per unload."""

    isLeaf = True

    def __init__(self, models: list[str], models_max: int = 2, load_time: float = 0.3, clock: Any = None,
                 unload_time: float = 0.0) -> None:
        super().__init__()
        self.models = list(models)
        self.models_max = models_max
        self.load_time = load_time
        self.unload_time = unload_time
        self.clock = clock if clock is not None else reactor
        self.state: dict[str, str] = {m: "unloaded" for m in models}
        self.used: dict[str, float] = {}
        self.busy: dict[str, int] = {}
        self.queue: list[str] = []
        self.waiting: dict[str, list[Deferred[None]]] = {}
        self.answering: dict[str, list[Request]] = {}
        self.loads: list[str] = []
        self.evictions: list[str] = []
        self.commands: list[tuple[str, str]] = []
        self.completions: list[str] = []
        self.inflight = 0
        self.cut = 0
        self.calls: list[Any] = []
        self.load_wait = 0.0
        self.up = True

    # -- the router's own behaviour ----------------------------------------------------------

    def held(self) -> list[str]:
        """The models loaded or loading (they take a place)."""
        return [m for m, s in self.state.items() if s in ("loaded", "loading")]

    def victim(self) -> str | None:
        """The model a load evicts: the least recently used loaded one with no request in
        flight and none queued for it; None when every loaded model is in use."""
        idle = [m for m, s in self.state.items()
                if s == "loaded" and not self.busy.get(m) and m not in self.queue]
        return min(idle, key=lambda m: (self.used.get(m, 0.0), m)) if idle else None

    def full(self) -> bool:
        return bool(self.models_max) and len(self.held()) >= self.models_max

    def load(self, model: str) -> None:
        """Start loading ``model`` now (a place must be free)."""
        self.state[model] = "loading"
        self.loads.append(model)
        self.calls = [c for c in self.calls if c.active()] + [self.clock.callLater(self.load_time, self._loaded, model)]

    def evict(self, model: str) -> None:
        self.state[model] = "unloaded"
        self.evictions.append(model)

    def schedule(self) -> None:
        """The host's queue: evict idle models while the queue needs places, and load its
        front entry when a place is free (one load at a time)."""
        needed = [m for m in self.queue if self.state[m] == "unloaded"]
        if self.models_max:
            free = self.models_max - len(self.held())
            while free < len(needed):
                victim = self.victim()
                if victim is None:
                    break
                self.evict(victim)
                free += 1
        if self.queue and self.state[self.queue[0]] == "unloaded" and not self.full() \
                and not any(self.state[m] == "loading" for m in self.queue):
            self.load(self.queue[0])

    def _loaded(self, model: str) -> None:
        if self.state.get(model) != "loading":
            return
        self.state[model] = "loaded"
        self.used[model] = self.clock.seconds()
        if model in self.queue:
            self.queue.remove(model)
        for d in self.waiting.pop(model, []):
            d.callback(None)
        self.schedule()

    def stop(self) -> None:
        """Cancel the loads under way (the end of a test)."""
        for call in self.calls:
            if call.active():
                call.cancel()
        self.calls = []

    def restart(self) -> None:
        """The host restarted: nothing is loaded."""
        self.state = {m: "unloaded" for m in self.models}

    def loaded(self) -> list[str]:
        return sorted(m for m, s in self.state.items() if s == "loaded")

    # -- HTTP --------------------------------------------------------------------------------

    def render(self, request: Request) -> Any:
        body = request.content.read() if request.content is not None else b""
        path = request.path
        request.setHeader(b"content-type", b"application/json")
        if not self.up:
            request.setResponseCode(503)
            return b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
        if path == b"/health":
            return b'{"status":"ok"}'
        if path in (b"/v1/models", b"/models"):
            return json.dumps({"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "llamacpp", "aliases": [], "status": {"value": self.state[m]}}
                for m in self.models
            ]}).encode()
        try:
            doc = json.loads(body or b"{}")
        except ValueError:
            doc = {}
        model = doc.get("model") if isinstance(doc, dict) else None
        if path in (b"/models/load", b"/models/unload"):
            return self._command(request, path.decode().rsplit("/", 1)[1], model)
        if path == b"/v1/chat/completions":
            if model not in self.state:
                request.setResponseCode(400)
                return b'{"error":{"code":400,"message":"model not found","type":"invalid_request_error"}}'
            self.completions.append(model)
            self.inflight += 1
            if self.state[model] == "loaded":
                self._answer(request, model, doc)
                return NOT_DONE_YET
            d: Deferred[None] = Deferred()
            self.waiting.setdefault(model, []).append(d)
            if model not in self.queue:
                self.queue.append(model)
            arrived = self.clock.seconds()

            def ready(_: object) -> None:
                self.load_wait += self.clock.seconds() - arrived
                if request._disconnected:  # the client left while it waited
                    self.inflight -= 1
                    return
                self._answer(request, model, doc)

            d.addCallback(ready)
            self.schedule()
            return NOT_DONE_YET
        request.setResponseCode(404)
        return b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'

    def _command(self, request: Request, action: str, model: Any) -> Any:
        self.commands.append((action, str(model)))
        if model not in self.state:
            if action == "load":
                request.setResponseCode(404)
                return b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
            request.setResponseCode(400)
            return b'{"error":{"code":400,"message":"model is not found","type":"invalid_request_error"}}'
        if action == "unload":
            if self.unload_time > 0:
                self.calls = [c for c in self.calls if c.active()] + [
                    self.clock.callLater(self.unload_time, self._unloaded, request, model)]
                return NOT_DONE_YET
            self.unload(model)
            return b'{"success":true}'
        if self.state[model] != "unloaded":
            request.setResponseCode(400)
            return b'{"error":{"code":400,"message":"model is already running","type":"invalid_request_error"}}'
        if self.full():
            victim = self.victim()
            if victim is None:
                request.setResponseCode(500)
                return b'{"error":{"code":500,"message":"model limit reached, try again later","type":"server_error"}}'
            self.evict(victim)
        self.load(model)
        return b'{"success":true}'

    def unload(self, model: str) -> None:
        """Stop ``model`` now: the answers in flight on it are cut."""
        self.state[model] = "unloaded"
        for cut in self.answering.pop(model, []):
            self.cut += 1
            cut.channel.transport.abortConnection()  # type: ignore[union-attr]
        self.schedule()

    def _unloaded(self, request: Request, model: str) -> None:
        """A slow unload (``unload_time``) is done: answered."""
        self.unload(model)
        if not request._disconnected:
            request.write(b'{"success":true}')
            request.finish()

    def _answer(self, request: Request, model: str, doc: dict[str, Any]) -> None:
        self.used[model] = self.clock.seconds()
        self.busy[model] = self.busy.get(model, 0) + 1
        self.answering.setdefault(model, []).append(request)
        if not doc.get("stream"):
            request.write(json.dumps({"object": "chat.completion", "model": model, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode())
            self._end(request, model)
            return
        request.setHeader(b"content-type", b"text/event-stream")
        events, delay = int(doc.get("n", 3)), float(doc.get("delay", 0.0))
        state = {"i": 0, "gone": False}
        request.notifyFinish().addBoth(lambda _: state.__setitem__("gone", True))

        def tick() -> None:
            if state["gone"]:
                self._end(request, model, finish=False)
                return
            if state["i"] < events:
                request.write(sse_event(state["i"]))
                state["i"] += 1
                self.clock.callLater(delay, tick)
            else:
                request.write(b"data: [DONE]\n\n")
                self._end(request, model)

        tick()

    def _end(self, request: Request, model: str, finish: bool = True) -> None:
        """An answer ended (``finish``: completely): its model may fall idle."""
        self.inflight -= 1
        self.busy[model] -= 1
        answering = self.answering.get(model, [])
        if request in answering:
            answering.remove(request)
        if finish:
            request.finish()
        if not self.busy[model]:
            self.schedule()


def placement_yaml(hosts: dict[str, tuple[str, int | None]], placement: str, head: str, queue_timeout: float,
                   host_extra: str = "") -> str:
    """A config with one route ``r`` over ``hosts`` (name -> (URL, its ``models_max`` or
    None for a host without one)) with ``placement``; ``head`` comes first (``health:``,
    ``timeouts:``), ``host_extra`` is added to each host's mapping (``, max_inflight: 1``)."""
    text = head + "hosts:\n"
    for name, (url, models_max) in hosts.items():
        extra = "" if models_max is None else f", models_max: {models_max}"
        text += f"  {name}: {{url: \"{url}\"{extra}{host_extra}}}\n"
    text += f"routes:\n  r:\n    hosts: [{', '.join(hosts)}]\n    queue: {{timeout: {queue_timeout:g}}}\n"
    return text + f"    placement: {placement}\n"
