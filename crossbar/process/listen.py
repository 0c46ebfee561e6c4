"""The listening socket of one crossbar process (DESIGN.md §Shape, §Workers): the
server endpoint from ``listen`` and the service that listens on it. Used by the
single-process service and by the workers' supervisor alike."""

from __future__ import annotations

from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.config import Config, ConfigError
from crossbar.waiting import Condition

__all__ = ["ListenService", "listen_endpoint"]


def listen_endpoint(reactor: Any, config: Config) -> Any:
    """The server endpoint for ``config.listen``.

    :raises ConfigError: the string is not a valid Twisted endpoint, names a systemd
        socket that was not passed, or loading it failed (e.g. an ``ssl:`` key file).
    """
    try:
        return serverFromString(reactor, config.listen)
    except IndexError:
        if config.listen.startswith("systemd:"):
            raise ConfigError(
                config.source, "listen", "systemd passed no such socket (start crossbar through its .socket unit)",
            ) from None
        raise ConfigError(config.source, "listen", "not a valid Twisted endpoint") from None
    except Exception as e:  # parsing may also load files (ssl: keys) or plugins
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ConfigError(config.source, "listen", f"not a valid Twisted endpoint: {why}") from None


class ListenService(Service):
    """Listens on ``endpoint`` while running; :attr:`port` is the listening port.

    A listen that fails at once (address in use, bad interface) raises
    ``CannotListenError`` from ``startService``, so ``twistd`` stops at start-up
    instead of running deaf.
    """

    _log = Logger(namespace="crossbar")

    def __init__(self, endpoint: IStreamServerEndpoint, factory: IProtocolFactory) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.port: IListeningPort | None = None
        self._listening: Deferred[IListeningPort] | None = None
        self._listened_condition = Condition(lambda: self.port is not None)

    def privilegedStartService(self) -> None:
        """Listen before twistd drops privileges (``--uid``), so ports below 1024 work."""
        super().privilegedStartService()
        self._listen()

    def startService(self) -> None:
        super().startService()
        if self._listening is None:  # started without privilegedStartService (tests)
            self._listen()

    def _listen(self) -> None:
        try:
            d = self.endpoint.listen(self.factory)
        except Exception as e:  # e.g. OverflowError for a port over 65535
            raise CannotListenError(None, None, e) from None
        self._listening = d
        d.addCallback(self._listened)
        if d.called:  # TCP, UNIX, systemd: listening (or not) at once
            failures: list[Failure] = []
            d.addErrback(failures.append)
            if failures:
                error = failures[0].value
                if isinstance(error, CannotListenError):
                    raise error
                raise CannotListenError(None, None, error)  # e.g. a unix socket's lock file
        else:
            d.addErrback(self._listen_failed)

    def _listen_failed(self, failure: Failure) -> None:
        """A listen that failed later (e.g. a slow endpoint): running deaf helps nobody."""
        self._log.failure("cannot listen; stopping", failure=failure)
        from twisted.internet import reactor

        reactor.stop()

    def _listened(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        host = port.getHost()
        self._log.info("listening on {address}", address=f"{getattr(host, 'host', host)}:{getattr(host, 'port', '')}")
        self._listened_condition.check()
        return port

    def when_listening(self) -> Deferred[IListeningPort]:
        """Fires with the listening port once listening."""
        assert self._listening is not None, "not started"
        def port(_: None) -> IListeningPort:
            assert self.port is not None
            return self.port

        return self._listened_condition.wait().addCallback(port)

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        self._listening = None
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None
