"""A loopback stand-in for llama-server in router mode (``--models-dir``, ``--models-max N``):
the shapes crossbar reads and sends, with a model's loading time, the ``--models-max``
bound and LRU eviction modelled.

- ``GET /health`` → 200; ``GET /v1/models`` (and ``/models``) lists every model with
  ``"status": {"value": "loaded" | "loading" | "unloaded"}``;
- ``POST /models/load {"model": M}`` → ``{"success": true}`` at once and M loads in the
  background (``load_time`` seconds), evicting the least recently used loaded model when
  ``models_max`` are loaded or loading; 400 ``model is already running`` when M is
  loaded or loading, 404 for a model it does not list (as llama-server answers);
- ``POST /models/unload {"model": M}`` → ``{"success": true}`` (M unloads), 400
  ``model is not found`` for a model it does not list;
- ``POST /v1/chat/completions`` naming M: loads M if needed (as the router does), waits
  for it, then answers (streamed when asked: ``n`` events ``delay`` s apart); 400 when M
  is not listed.

:ivar loads: every load the host started, in order (model ids); :ivar evictions: likewise.
:ivar load_wait: seconds requests spent at the host waiting for their model to load (summed).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from tests.harness import sse_event

__all__ = ["FakeRouter"]


class FakeRouter(Resource):
    """One router-mode host listing ``models``; ``models_max`` (0: no limit) and
    ``load_time`` seconds per load."""

    isLeaf = True

    def __init__(self, models: list[str], models_max: int = 2, load_time: float = 0.3, clock: Any = None) -> None:
        super().__init__()
        self.models = list(models)
        self.models_max = models_max
        self.load_time = load_time
        self.clock = clock if clock is not None else reactor
        self.state: dict[str, str] = {m: "unloaded" for m in models}
        self.used: dict[str, float] = {}
        self.waiting: dict[str, list[Deferred[None]]] = {}
        self.loads: list[str] = []
        self.evictions: list[str] = []
        self.commands: list[tuple[str, str]] = []
        self.completions: list[str] = []
        self.inflight = 0
        self.calls: list[Any] = []
        self.load_wait = 0.0
        self.up = True

    # -- the router's own behaviour ----------------------------------------------------------

    def load(self, model: str) -> None:
        """Start loading ``model`` (evicting the least recently used loaded one when full)."""
        if self.state.get(model) != "unloaded":
            return
        held = [m for m, s in self.state.items() if s in ("loaded", "loading")]
        if self.models_max and len(held) >= self.models_max:
            loaded = [m for m in held if self.state[m] == "loaded"]
            if loaded:
                victim = min(loaded, key=lambda m: self.used.get(m, 0.0))
                self.state[victim] = "unloaded"
                self.evictions.append(victim)
        self.state[model] = "loading"
        self.loads.append(model)
        self.calls = [c for c in self.calls if c.active()] + [self.clock.callLater(self.load_time, self._loaded, model)]

    def _loaded(self, model: str) -> None:
        if self.state.get(model) != "loading":
            return
        self.state[model] = "loaded"
        self.used.setdefault(model, self.clock.seconds())
        for d in self.waiting.pop(model, []):
            d.callback(None)

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
            action = path.decode().rsplit("/", 1)[1]
            self.commands.append((action, str(model)))
            if model not in self.state:
                if action == "load":
                    request.setResponseCode(404)
                    return b'{"error":{"message":"File Not Found","type":"not_found_error","code":404}}'
                request.setResponseCode(400)
                return b'{"error":{"code":400,"message":"model is not found","type":"invalid_request_error"}}'
            if action == "load":
                if self.state[model] != "unloaded":
                    request.setResponseCode(400)
                    return b'{"error":{"code":400,"message":"model is already running","type":"invalid_request_error"}}'
                self.load(model)
            else:
                self.state[model] = "unloaded"
            return b'{"success":true}'
        if path == b"/v1/chat/completions":
            if model not in self.state:
                request.setResponseCode(400)
                return b'{"error":{"code":400,"message":"model not found","type":"invalid_request_error"}}'
            self.completions.append(model)
            self.inflight += 1
            self.used[model] = self.clock.seconds()
            self.load(model)
            if self.state[model] == "loaded":
                self._answer(request, model, doc)
            else:
                d: Deferred[None] = Deferred()
                self.waiting.setdefault(model, []).append(d)
                arrived = self.clock.seconds()

                def loaded(_: object) -> None:
                    self.load_wait += self.clock.seconds() - arrived
                    self._answer(request, model, doc)

                d.addCallback(loaded)
            return NOT_DONE_YET
        request.setResponseCode(404)
        return b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'

    def _answer(self, request: Request, model: str, doc: dict[str, Any]) -> None:
        self.used[model] = self.clock.seconds()
        if not doc.get("stream"):
            request.write(json.dumps({"object": "chat.completion", "model": model, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode())
            self._end(request)
            return
        request.setHeader(b"content-type", b"text/event-stream")
        events, delay = int(doc.get("n", 3)), float(doc.get("delay", 0.0))
        state = {"i": 0, "gone": False}
        request.notifyFinish().addBoth(lambda _: state.__setitem__("gone", True))

        def tick() -> None:
            if state["gone"]:
                self.inflight -= 1
                return
            if state["i"] < events:
                request.write(sse_event(state["i"]))
                state["i"] += 1
                self.clock.callLater(delay, tick)
            else:
                request.write(b"data: [DONE]\n\n")
                self._end(request)

        tick()

    def _end(self, request: Request) -> None:
        self.inflight -= 1
        request.finish()
