"""A real Redis for the tests (Debian's ``redis-server``), started on a free loopback
port, no persistence, stopped when the test ends.

:func:`start_redis` skips the test with the reason when ``redis-server`` is not
installed (``apt-get install -y redis-server``; ``.ci/run`` installs it) and fails it
instead under ``CI=true``. :class:`RedisServer` can be stopped and started again on the
same port (Redis down mid-load) or paused with SIGSTOP (Redis slow), and answers
commands synchronously for the tests' own checks (:meth:`RedisServer.command`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from twisted.trial.unittest import SkipTest, SynchronousTestCase

__all__ = ["RedisServer", "find_redis_server", "start_redis"]


def find_redis_server() -> str | None:
    """The redis-server executable (PATH, then Debian's /usr/bin), or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    return "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``.

    :param executable: redis-server's path.
    :param password: ``requirepass`` when given.
    :param tls: ``(certificate, key)`` PEM files: Redis also listens with TLS on
        :attr:`tls_port` (clients not asked for a certificate); the plain :attr:`port`
        stays open for the tests' own :meth:`command`.
    """

    def __init__(self, executable: str, password: str | None = None, tls: tuple[str, str] | None = None) -> None:
        self.executable = executable
        self.password = password
        self.tls = tls
        self.port = _free_port()
        self.tls_port = _free_port() if tls else 0
        self.directory = tempfile.mkdtemp(prefix="crossbar-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait (at most 10 s) until it answers PING."""
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", self.directory, "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args += ["--tls-port", str(self.tls_port), "--tls-cert-file", self.tls[0], "--tls-key-file", self.tls[1],
                     "--tls-auth-clients", "no"]
        self.log = os.path.join(self.directory, "redis.log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.command("PING") == "PONG":
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                with open(self.log, "rb") as log:
                    said = log.read().decode(errors="replace")[-2000:]
                raise AssertionError(f"redis-server on port {self.port} did not start: {said}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Kill it (SIGKILL: Redis gone at once) and wait for it."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers (Redis slow)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def command(self, *args: str) -> object:
        """Run one command over a fresh connection and return its reply (simple RESP:
        strings, integers, arrays of bulk strings)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            out = b""
            if self.password:
                out += _encode(("AUTH", self.password))
            out += _encode(args)
            s.sendall(out)
            reader = s.makefile("rb")
            if self.password:
                _read(reader)
            return _read(reader)

    def cleanup(self) -> None:
        """Stop it and remove its directory."""
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _encode(args: tuple[str, ...]) -> bytes:
    out = b"*%d\r\n" % len(args)
    for a in args:
        data = a.encode()
        out += b"$%d\r\n%s\r\n" % (len(data), data)
    return out


def _read(reader: object) -> object:
    line = reader.readline()  # type: ignore[attr-defined]
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = reader.read(n + 2)  # type: ignore[attr-defined]
        return data[:-2].decode()
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read(reader) for _ in range(n)]
    raise RuntimeError(f"unexpected reply {line!r}")


def start_redis(case: SynchronousTestCase, password: str | None = None,
                tls: tuple[str, str] | None = None) -> RedisServer:
    """A running :class:`RedisServer` for the test (stopped at its end).

    :param tls: ``(certificate, key)``: Redis speaks TLS on its ``tls_port`` too.
    :raises SkipTest: no redis-server, or one built without TLS when ``tls`` is asked
        for, not under CI (under ``CI=true`` the test fails: Debian's redis-server has TLS).
    """
    executable = find_redis_server()
    ci = os.environ.get("CI", "").lower() == "true"
    if executable is None:
        reason = "redis-server is not installed (Debian: apt-get install -y redis-server)"
        if ci:
            case.fail(f"CI=true requires redis-server: {reason}")
        raise SkipTest(reason)
    if tls and not has_tls(executable):
        reason = f"{executable} was built without TLS (--tls-port unknown); Debian's redis-server has it"
        if ci:
            case.fail(f"CI=true requires a redis-server with TLS: {reason}")
        raise SkipTest(reason)
    server = RedisServer(executable, password, tls)
    case.addCleanup(server.cleanup)
    server.start()
    return server


def has_tls(executable: str) -> bool:
    """Whether ``executable`` was built with TLS: asked for an impossible ``--tls-port``,
    a build with it refuses the value ("argument must be between 0 and 65535"), one
    without refuses the directive itself ("Bad directive"); either way it exits at once."""
    out = subprocess.run([executable, "--port", "0", "--tls-port", "-1"], capture_output=True, timeout=10)
    text = (out.stdout + out.stderr).decode(errors="replace")
    return "Bad directive or wrong number of arguments" not in text or "tls-port" not in text
