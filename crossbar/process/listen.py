"""The listening sockets of crossbar (docs/design.md §Shape, §Workers): the server endpoint
from ``listen`` and the service that listens on it (:class:`ListenService`: the single
process, and a worker on the socket its supervisor opened), and the sockets a
supervisor opens for its workers (:class:`WorkerListeners`)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.abstract import isIPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint, serverFromString
from twisted.internet.protocol import ServerFactory
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.config import Config, ConfigError
from crossbar.proxy.connections import RateLimitedAcceptErrors, with_backlog
from crossbar.compat.twisted import wrap_port_logger
from crossbar.waiting import Condition

__all__ = ["ListenService", "TCPAddress", "WorkerListeners", "listen_endpoint", "tcp_address"]


def listen_endpoint(reactor: Any, config: Config) -> Any:
    """The server endpoint for ``config.listen``.

    :raises ConfigError: the string is not a valid Twisted endpoint, names a systemd
        socket that was not passed, or loading it failed (e.g. an ``ssl:`` key file).
    """
    try:
        return serverFromString(reactor, with_backlog(config.listen))
    except IndexError:
        if config.listen.startswith("systemd:"):
            raise ConfigError(
                config.source, "listen", "systemd passed no such socket (start crossbar through its .socket unit)",
            ) from None
        raise ConfigError(config.source, "listen", "not a valid Twisted endpoint") from None
    except Exception as e:  # parsing may also load files (ssl: keys) or plugins
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        filename = getattr(e, "filename", None)
        if filename:  # a key or certificate file of an ssl: listener: name it
            why = f"{why}: {filename}"
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
        from twisted.internet import reactor

        # EMFILE and other accept errors: one log line a minute, not one per connection.
        wrap_port_logger(port, lambda observer: RateLimitedAcceptErrors(observer, reactor))
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


@dataclass(frozen=True)
class TCPAddress:
    """Where a ``tcp:`` or ``tcp6:`` listen string binds, as Twisted parses it.

    :ivar port: the port (0: one the kernel picks).
    :ivar interface: the address to bind (``""``: every IPv4 address; ``"::"`` for
        ``tcp6:`` by default).
    :ivar backlog: the listen backlog (connections).
    """

    port: int
    interface: str
    backlog: int


class _TCPArguments:
    """Stands in for the reactor while Twisted's own endpoint parser turns a listen
    string into ``listenTCP`` arguments (``IReactorTCP``), which it keeps instead of
    listening: the string means here exactly what it means to ``serverFromString``."""

    def __init__(self) -> None:
        self.address: TCPAddress | None = None

    def listenTCP(self, port: int, factory: IProtocolFactory, backlog: int = 50, interface: str = "") -> None:
        self.address = TCPAddress(port, interface, backlog)


def tcp_address(config: Config) -> TCPAddress | None:
    """Where ``config.listen`` binds when it is a plain TCP listener (``tcp:``,
    ``tcp6:``, any ``interface=`` or ``backlog=``), else None (``systemd:``, ``ssl:``,
    ``unix:`` ...).

    :raises ConfigError: as :func:`listen_endpoint`.
    """
    arguments = _TCPArguments()
    endpoint = listen_endpoint(arguments, config)
    if not isinstance(endpoint, (TCP4ServerEndpoint, TCP6ServerEndpoint)):
        return None
    endpoint.listen(ServerFactory())
    return arguments.address


class WorkerListeners(MultiService):
    """The listening sockets of a supervisor's workers (docs/design.md §Workers), opened by
    the supervisor before ``twistd`` drops privileges (so ports below 1024 work), and
    never accepted on by it.

    - A TCP listener (``tcp:``, ``tcp6:``): one socket per worker, all bound to the
      same address with ``SO_REUSEPORT``. The kernel spreads incoming connections
      over the sockets by a hash of their addresses, so a burst of connections is
      shared evenly by the workers (one socket shared by every worker gives most of a
      burst to one worker: whoever wakes first accepts). A worker that dies leaves its
      socket with the supervisor: connections the kernel gives it meanwhile wait in its
      backlog for the replacement worker (they are not lost).
    - Any other listener (a ``systemd:`` socket passed by socket activation: there is
      one, and it cannot be split): one socket, shared by every worker, as a Twisted
      port that never reads. Each connection goes to the worker that accepts first.

    :param reactor: parses ``listen`` (and, for a shared socket, listens).
    :param config: its ``listen`` is used.
    :param count: the workers, one socket each.
    :raises ConfigError: ``listen`` is not a valid endpoint.
    """

    _log = Logger(namespace="crossbar")

    def __init__(self, reactor: Any, config: Config, count: int) -> None:
        super().__init__()
        self.address = tcp_address(config)
        self.count = count
        self._sockets: list[socket.socket] = []
        self._shared: ListenService | None = None
        if self.address is None:
            self._shared = ListenService(listen_endpoint(reactor, config), _NeverAccept())
            self._shared.setServiceParent(self)

    @property
    def shared(self) -> bool:
        """Every worker accepts on one socket (else: one each)."""
        return self._shared is not None

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        self._open()

    def startService(self) -> None:
        super().startService()
        self._open()  # started without privilegedStartService (tests)

    def _open(self) -> None:
        if self._shared is not None:
            port = self._shared.port
            stop = getattr(port, "stopReading", None)
            if stop is not None:
                stop()  # open for the workers, never accepted on here
            return
        if self._sockets:
            return
        address = self.address
        assert address is not None
        try:
            self._sockets = _reuse_port_sockets(address, self.count)
        except OSError as e:
            raise CannotListenError(address.interface, address.port, e) from None
        host, port = self._sockets[0].getsockname()[:2]
        self._log.info("listening on {address} (one socket per worker: {count})",
                       address=f"{host}:{port}", count=self.count)

    def fileno(self, index: int) -> int:
        """The listening socket worker ``index`` accepts on.

        :raises RuntimeError: not started."""
        if self._shared is not None:
            port = self._shared.port
            if port is None:
                raise RuntimeError("the workers' listener is not open")
            return int(port.fileno())  # type: ignore[attr-defined]
        if not self._sockets:
            raise RuntimeError("the workers' listeners are not open")
        return self._sockets[index].fileno()

    def stopService(self) -> Deferred[None] | None:
        stopped = super().stopService()
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()
        return stopped


class _NeverAccept(ServerFactory):
    """The supervisor's factory for a shared listener: its port never reads, and it
    would refuse if it did."""

    noisy = False

    def buildProtocol(self, addr: Any) -> None:
        return None


def _reuse_port_sockets(address: TCPAddress, count: int) -> list[socket.socket]:
    """``count`` listening sockets on ``address`` with ``SO_REUSEPORT`` (the first
    picks the port when it is 0, the others join it).

    :raises OSError: one cannot be bound (address in use, no such interface)."""
    family = socket.AF_INET6 if isIPv6Address(address.interface) else socket.AF_INET
    if family == socket.AF_INET6:  # with a scope (fe80::1%eth0), as Twisted binds it
        where: Any = socket.getaddrinfo(address.interface, address.port, family, socket.SOCK_STREAM, 0,
                                        socket.AI_NUMERICHOST)[0][4]
    else:
        where = (address.interface, address.port)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Twisted's ports
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(where)
            sock.listen(address.backlog)
            sock.setblocking(False)  # a worker's reactor accepts until EAGAIN
            if not where[1]:  # the kernel picked the port: the others join it
                where = (where[0], sock.getsockname()[1], *where[2:])
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
