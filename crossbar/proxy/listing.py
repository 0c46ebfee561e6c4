"""The route model list as an exchange (docs/design.md §The proxy, rule 10; §"Several
crossbars", last bullet).

``GET /{route}/v1/models`` (and ``/models``) is answered by crossbar from the health
table (:func:`~crossbar.proxy.modellist.models_body`), never by a host. A new or
restarted worker or instance does not answer it while a host of the route has not had
its first poll: the request waits in the route's queue as a request waits for room,
counted like one, and is answered as soon as the polls are in (or, at the queue's
timeout or when it may not wait, with what the polls so far give).
"""

from __future__ import annotations

from crossbar.hosts.balance import awaits_first_poll
from crossbar.paths import PathKind
from crossbar.proxy.exchange import Exchange
from crossbar.proxy.head import Refusal
from crossbar.proxy.modellist import models_body
from crossbar.proxy.phase import Phase, acts_in

__all__ = ["ModelListing"]


class ModelListing(Exchange):
    """A request for the route model list (rule 10)."""

    def start(self, checked: Refusal | PathKind) -> None:
        """Answer the list, or wait for the route's first polls (see the module doc)."""
        self.request.on_lost = self.on_client_gone
        assert self.route is not None
        if awaits_first_poll(self.route, self.config.hosts, self.runtime.table.all()):
            self.runtime.begin(self)
            self._enter(Phase.FORWARDING)
            self.enqueue()
            return
        self.answer_models()

    def forward(self, waiting: bool = False) -> bool:
        """Answered once every host of the route has had its first poll (True), else it
        keeps waiting (False)."""
        assert self.route is not None
        if awaits_first_poll(self.route, self.config.hosts, self.runtime.table.all()):
            return False
        self.leave_queue()
        self.answer_models()
        return True

    def queue_refused(self, refusal: str) -> None:
        """No queue to wait in: the list as the polls so far give it."""
        self.answer_models()

    @acts_in(Phase.QUEUED)
    def on_queue_timeout(self) -> None:
        """The polls took longer than ``queue.timeout``: the list as they give it so far."""
        self.answer_models()

    def answer_models(self) -> None:
        """Rule 10: the route model list from the health table, or 503 ``no healthy host``."""
        assert self.route is not None
        body = models_body(self.route, self.runtime.table.all())
        return self.answer_error(503, "no healthy host") if body is None else self.answer(200, body)
