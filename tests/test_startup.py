"""Start-up through a real ``twistd`` process (docs/design.md §Configuration, §Operations).

A bad configuration stops ``twistd -n crossbar --config FILE`` at once: exit status 1,
exactly one line ``crossbar: FILE: KEY: problem`` on stderr, no traceback anywhere. A
good one serves ``/_crossbar/livez`` and exits cleanly on SIGTERM after its drain.

Also unit tests of :class:`crossbar.process.startup.StartupGuard`, which turns errors raised
while the service starts (a port in use) into that one line.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import NoReturn

from twisted.application.service import Service
from twisted.internet.error import CannotListenError
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import ConfigError
from crossbar.process.startup import StartupGuard, as_config_error, log_is_terminal, report_and_exit
from tests.process import twistd_argv, twistd_env

START_TIMEOUT = 30.0  # s: a loaded 2-core machine may take several seconds to import
STOP_TIMEOUT = 30.0

GOOD = """\
listen: "tcp:{port}:interface=127.0.0.1"
health: {{interval: 0.5, timeout: 0.5}}
drain: {{delay: 0.1, grace: 0.1}}
hosts:
  a: http://127.0.0.1:{upstream}
routes:
  r:
    hosts: [a]
"""


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _TwistdCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="crossbar-startup-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def write(self, name: str, text: str) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def spawn(self, config: str, twistd_options: tuple[str, ...] = ("-n", "--pidfile=")) -> subprocess.Popen[str]:
        """Start twistd for ``config``; it is killed at cleanup if still running."""
        proc = subprocess.Popen(
            twistd_argv(config, twistd_options), cwd=self.dir, env=twistd_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

        def reap() -> None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.communicate(timeout=STOP_TIMEOUT)
            except (ValueError, OSError, subprocess.TimeoutExpired):
                pass  # already collected, or unkillable: nothing more to do

        self.addCleanup(reap)
        return proc

    def run_to_exit(
        self, config: str, twistd_options: tuple[str, ...] = ("-n", "--pidfile=")
    ) -> tuple[int, str, str, float]:
        """Run twistd for ``config`` until it exits; (status, stdout, stderr, seconds)."""
        started = time.monotonic()
        proc = self.spawn(config, twistd_options)
        try:
            out, err = proc.communicate(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=STOP_TIMEOUT)
            self.fail(f"twistd still running after {START_TIMEOUT}s: it must stop at start-up\n{out}\n{err}")
        return proc.returncode, out, err, time.monotonic() - started

    def assertStartupFails(
        self,
        config: str,
        line: str | None = None,
        prefix: str | None = None,
        twistd_options: tuple[str, ...] = ("-n", "--pidfile="),
    ) -> str:
        """twistd exits 1 quickly; stderr is one line (``line``, or starting ``prefix``)."""
        status, out, err, seconds = self.run_to_exit(config, twistd_options)
        self.assertEqual(status, 1, f"exit status {status}\nstdout:\n{out}\nstderr:\n{err}")
        self.assertNotIn("Traceback", out + err)
        lines = err.splitlines()
        self.assertEqual(len(lines), 1, f"stderr must be exactly one line, got:\n{err}")
        if line is not None:
            self.assertEqual(lines[0], line)
        if prefix is not None:
            self.assertTrue(lines[0].startswith(prefix), f"{lines[0]!r} does not start with {prefix!r}")
        problem = lines[0].removeprefix("crossbar: ")
        self.assertEqual((out + err).count(problem), 1, f"the problem must be told once\nstdout:\n{out}\nstderr:\n{err}")
        self.assertLess(seconds, START_TIMEOUT)
        return lines[0]


class BadConfigTests(_TwistdCase):
    def good_text(self) -> str:
        return GOOD.format(port=free_port(), upstream=free_port())

    def test_unknown_key(self) -> None:
        path = self.write("bad.yaml", self.good_text() + "helth: {interval: 1}\n")
        self.assertStartupFails(
            path,
            f"crossbar: {path}: helth: unknown key "
            "(expected one of: listen, health, timeouts, drain, ops, workers, cluster, hosts, routes)",
        )

    def test_unknown_host_in_route(self) -> None:
        path = self.write("bad.yaml", self.good_text().replace("hosts: [a]", "hosts: [a, gpu-z]"))
        self.assertStartupFails(path, f"crossbar: {path}: routes.r.hosts[1]: unknown host 'gpu-z'")

    def test_duplicate_key(self) -> None:
        path = self.write("bad.yaml", self.good_text() + "drain: {delay: 1}\n")
        self.assertStartupFails(path, f"crossbar: {path}: drain: duplicate key at line 9, column 1 (first at line 3)")

    def test_missing_file(self) -> None:
        path = os.path.join(self.dir, "nowhere.yaml")
        self.assertStartupFails(path, f"crossbar: {path}: cannot read: No such file or directory")

    def test_bad_listen_endpoint_string(self) -> None:
        text = self.good_text()
        path = self.write("bad.yaml", "listen: \"bogus:7777\"\n" + text.split("\n", 1)[1])
        self.assertStartupFails(path, prefix=f"crossbar: {path}: listen: not a valid Twisted endpoint: ")

    def test_bad_listen_port_number(self) -> None:
        text = self.good_text()
        path = self.write("bad.yaml", "listen: \"tcp:notaport\"\n" + text.split("\n", 1)[1])
        self.assertStartupFails(path, prefix=f"crossbar: {path}: listen: not a valid Twisted endpoint: ")

    def test_listen_port_out_of_range(self) -> None:
        """bind() raises OverflowError, not a socket error: still one line."""
        text = self.good_text()
        path = self.write("bad.yaml", "listen: \"tcp:99999:interface=127.0.0.1\"\n" + text.split("\n", 1)[1])
        self.assertStartupFails(path, prefix=f"crossbar: {path}: listen: cannot listen: ")

    def test_listen_ssl_key_missing(self) -> None:
        """Parsing an ssl: endpoint reads its key file: a missing one is one line."""
        text = self.good_text()
        key = os.path.join(self.dir, "missing.pem")
        path = self.write("bad.yaml", f"listen: \"ssl:8443:privateKey={key}\"\n" + text.split("\n", 1)[1])
        self.assertStartupFails(
            path, f"crossbar: {path}: listen: not a valid Twisted endpoint: No such file or directory: {key}"
        )

    def test_listen_unix_socket_in_missing_directory(self) -> None:
        text = self.good_text()
        sock = os.path.join(self.dir, "nowhere", "crossbar.sock")
        path = self.write("bad.yaml", f"listen: \"unix:{sock}\"\n" + text.split("\n", 1)[1])
        self.assertStartupFails(path, prefix=f"crossbar: {path}: listen: cannot listen")

    def test_listen_systemd_without_socket(self) -> None:
        text = self.good_text()
        path = self.write("bad.yaml", "listen: \"systemd:domain=INET:index=0\"\n" + text.split("\n", 1)[1])
        self.assertStartupFails(
            path,
            f"crossbar: {path}: listen: systemd passed no such socket (start crossbar through its .socket unit)",
        )

    def test_listen_port_in_use(self) -> None:
        """A port someone else holds stops start-up; crossbar never runs deaf."""
        port = self.hold_port()
        path = self.write("inuse.yaml", GOOD.format(port=port, upstream=free_port()))
        self.assertStartupFails(
            path, f"crossbar: {path}: listen: cannot listen on 127.0.0.1:{port}: Address already in use"
        )


    def hold_port(self) -> int:
        blocker = socket.socket()
        self.addCleanup(blocker.close)
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        return int(blocker.getsockname()[1])

    def test_port_in_use_json_log_one_line(self) -> None:
        """The JSON log goes to stdout too: the problem is still told once (stderr)."""
        port = self.hold_port()
        path = self.write("inuse.yaml", GOOD.format(port=port, upstream=free_port()))
        self.assertStartupFails(
            path, f"crossbar: {path}: listen: cannot listen on 127.0.0.1:{port}: Address already in use",
            twistd_options=("-n", "--pidfile=", "--logger=crossbar.ops.jsonlog.observer"),
        )

    def test_port_in_use_with_log_file_logs_it_there(self) -> None:
        """-n with --logfile: one line on the terminal, and the log file says it too."""
        port = self.hold_port()
        path = self.write("inuse.yaml", GOOD.format(port=port, upstream=free_port()))
        logfile = os.path.join(self.dir, "crossbar.log")
        self.assertStartupFails(
            path, f"crossbar: {path}: listen: cannot listen on 127.0.0.1:{port}: Address already in use",
            twistd_options=("-n", "--pidfile=", f"--logfile={logfile}"),
        )
        with open(logfile, encoding="utf-8") as f:
            self.assertIn(f"start-up failed: {path}: listen: cannot listen on 127.0.0.1:{port}", f.read())

    def test_port_in_use_removes_own_pidfile(self) -> None:
        """twistd -n with a pidfile: the failed start leaves no stale pidfile behind."""
        port = self.hold_port()
        path = self.write("inuse.yaml", GOOD.format(port=port, upstream=free_port()))
        pidfile = os.path.join(self.dir, "crossbar.pid")
        self.assertStartupFails(
            path, f"crossbar: {path}: listen: cannot listen on 127.0.0.1:{port}: Address already in use",
            twistd_options=("-n", f"--pidfile={pidfile}"),
        )
        self.assertFalse(os.path.exists(pidfile))

    def test_port_in_use_daemonized(self) -> None:
        """Without -n, twistd's parent waits for the daemon's verdict on a pipe: it must
        get one (else it hangs for ever), print it and exit 1; the log has the line and no
        traceback; no pidfile is left."""
        port = self.hold_port()
        path = self.write("inuse.yaml", GOOD.format(port=port, upstream=free_port()))
        pidfile = os.path.join(self.dir, "crossbar.pid")
        logfile = os.path.join(self.dir, "crossbar.log")
        status, out, err, seconds = self.run_to_exit(path, (f"--pidfile={pidfile}", f"--logfile={logfile}"))
        self.assertEqual(status, 1, f"stdout:\n{out}\nstderr:\n{err}")
        self.assertTrue(
            err.startswith(f"An error has occurred: b'crossbar: {path}: listen: "), f"stderr:\n{err}"
        )
        self.assertNotIn("Traceback", out + err)
        deadline = time.monotonic() + STOP_TIMEOUT  # the daemon writes its log as it exits
        line = f"start-up failed: {path}: listen: cannot listen on 127.0.0.1:{port}: Address already in use"
        log = ""
        while time.monotonic() < deadline:
            with open(logfile, encoding="utf-8") as f:
                log = f.read()
            if line in log and not os.path.exists(pidfile):  # the pidfile goes after the line
                break
            time.sleep(0.1)
        self.assertIn(line, log)
        self.assertNotIn("Traceback", log)
        self.assertFalse(os.path.exists(pidfile))


class GoodConfigTests(_TwistdCase):
    def get(self, url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    def test_serves_livez_and_exits_on_sigterm(self) -> None:
        for attempt in range(3):  # the free port may be taken by someone else meanwhile
            port = free_port()
            path = self.write("good.yaml", GOOD.format(port=port, upstream=free_port()))
            proc = self.spawn(path)
            url = f"http://127.0.0.1:{port}/_crossbar/livez"
            deadline = time.monotonic() + START_TIMEOUT
            status = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = self.get(url)
                    break
                except OSError:
                    time.sleep(0.1)
            if proc.poll() is not None:
                out, err = proc.communicate(timeout=STOP_TIMEOUT)
                if "Address already in use" in err and attempt < 2:
                    continue
                self.fail(f"twistd exited with {proc.returncode} at start-up\nstdout:\n{out}\nstderr:\n{err}")
            break
        self.assertEqual(status, 200, "livez did not answer 200 within the start-up bound")

        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=STOP_TIMEOUT)
            self.fail(f"twistd did not exit within {STOP_TIMEOUT}s of SIGTERM\nstdout:\n{out}\nstderr:\n{err}")
        seconds = time.monotonic() - stopped
        self.assertIn(proc.returncode, (0, -signal.SIGTERM), f"stdout:\n{out}\nstderr:\n{err}")
        self.assertNotIn("Traceback", out + err)
        self.assertEqual(err, "", "a good run writes nothing to stderr (twistd -n logs to stdout)")
        self.assertLess(seconds, STOP_TIMEOUT)
        # The listener is really closed: nothing answers on the port any more.
        with socket.socket() as s:
            s.settimeout(5)
            self.assertNotEqual(s.connect_ex(("127.0.0.1", port)), 0)


    def test_relative_config_path_with_rundir_and_workers(self) -> None:
        """``--config rd.yaml`` from the config's directory with ``--rundir=/``: twistd
        changes directory after reading it, and the workers (which read the config
        later) and a SIGHUP must still find the same file."""
        port = free_port()
        self.write("rd.yaml", "workers: 2\n" + GOOD.format(port=port, upstream=free_port()))
        proc = self.spawn("rd.yaml", ("-n", "--pidfile=", "--rundir=/"))
        url = f"http://127.0.0.1:{port}/_crossbar/livez"
        deadline = time.monotonic() + START_TIMEOUT
        status = None
        while status is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = self.get(url)  # a worker answers: it found the config
            except OSError:
                time.sleep(0.1)
        self.assertEqual(status, 200)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=STOP_TIMEOUT)
        self.assertNotIn("cannot read", out + err)
        self.assertNotIn("reload refused", out + err)
        self.assertEqual(out.count("reloaded"), 2, out)  # both workers reloaded


class _Failing(Service):
    def __init__(self, error: Exception, privileged: bool = False) -> None:
        self.error = error
        self.privileged = privileged

    def privilegedStartService(self) -> None:
        if self.privileged:
            raise self.error

    def startService(self) -> None:
        raise self.error


class _Reported(Exception):
    pass


class LogIsTerminalTests(SynchronousTestCase):
    def test_where_the_log_goes(self) -> None:
        from crossbar.ops import jsonlog

        cases: list[tuple[dict[str, object] | None, bool]] = [
            (None, False),
            ({"nodaemon": True, "logfile": None}, True),
            ({"nodaemon": True, "logfile": "-"}, True),
            ({"nodaemon": True, "logfile": "/var/log/crossbar.log"}, False),
            ({"nodaemon": False, "logfile": None}, False),  # a daemon logs to twistd.log
            ({"nodaemon": True, "syslog": True}, False),
            ({"nodaemon": True, "logger": jsonlog.observer}, True),
            ({"nodaemon": True, "logger": lambda: None}, False),
        ]
        for options, expected in cases:
            self.assertEqual(log_is_terminal(options), expected, options)


class LogsJsonLinesTests(SynchronousTestCase):
    def test_the_factory_twistd_resolved_or_its_name(self) -> None:
        """twistd's ``--logger`` reaches the plugin as the factory (ServerOptions resolves
        the name): workers log straight through with either (issue 23: every worker line
        was relayed by the supervisor, ~100 us per request)."""
        from twisted.scripts.twistd import ServerOptions

        from crossbar.ops import jsonlog
        from crossbar.process.daemon import logs_json_lines

        options = ServerOptions()
        options.parseOptions(["-n", "--logger=crossbar.ops.jsonlog.observer", "crossbar", "--config", "x.yaml"])
        self.assertIs(options["logger"], jsonlog.observer)
        self.assertTrue(logs_json_lines(options))
        self.assertTrue(logs_json_lines({"logger": "crossbar.ops.jsonlog.observer"}))
        for other in (None, {}, {"logger": None}, {"logger": lambda: None}, {"logfile": "-"}):
            self.assertFalse(logs_json_lines(other), other)


class StartupGuardTests(SynchronousTestCase):
    def guard(self, inner: Service) -> tuple[StartupGuard, list[ConfigError]]:
        reported: list[ConfigError] = []

        def report(error: ConfigError) -> NoReturn:
            reported.append(error)
            raise _Reported()

        return StartupGuard(inner, "c.yaml", report), reported

    def test_port_in_use_becomes_listen_error(self) -> None:
        error = CannotListenError("127.0.0.1", 7777, OSError(98, "Address already in use"))
        guard, reported = self.guard(_Failing(error))
        self.assertRaises(_Reported, guard.startService)
        self.assertEqual([str(e) for e in reported], ["c.yaml: listen: cannot listen on 127.0.0.1:7777: Address already in use"])

    def test_any_interface_is_shown_as_star(self) -> None:
        error = CannotListenError("", 80, OSError(13, "Permission denied"))
        self.assertEqual(str(as_config_error(error, "c.yaml")), "c.yaml: listen: cannot listen on *:80: Permission denied")

    def test_config_error_from_privileged_start(self) -> None:
        guard, reported = self.guard(_Failing(ConfigError("c.yaml", "listen", "nope"), privileged=True))
        self.assertRaises(_Reported, guard.privilegedStartService)
        self.assertEqual([str(e) for e in reported], ["c.yaml: listen: nope"])

    def test_other_errors_propagate(self) -> None:
        """A bug is not dressed up as a configuration problem."""
        guard, reported = self.guard(_Failing(ZeroDivisionError("bug")))
        self.assertRaises(ZeroDivisionError, guard.startService)
        self.assertEqual(reported, [])

    def test_started_service_runs_inside(self) -> None:
        inner = Service()
        guard, reported = self.guard(inner)
        guard.startService()
        self.assertTrue(inner.running)
        guard.stopService()
        self.assertFalse(inner.running)

    def test_report_answers_twistd_status_pipe_and_removes_own_pidfile(self) -> None:
        r, w = os.pipe()
        self.addCleanup(os.close, r)
        directory = tempfile.mkdtemp(prefix="crossbar-startup-")
        self.addCleanup(shutil.rmtree, directory, True)
        pidfile = os.path.join(directory, "twistd.pid")
        with open(pidfile, "w") as f:
            f.write(f"{os.getpid()}\n")
        twistd: dict[str, object] = {"statusPipe": w, "pidfile": pidfile}
        self.assertRaises(
            SystemExit, report_and_exit, ConfigError("c.yaml", "listen", "x" * 200), io.StringIO(), False, twistd
        )
        message = os.read(r, 1000)
        self.assertEqual(message, (b"1 crossbar: c.yaml: listen: " + b"x" * 200)[:100])
        self.assertIsNone(twistd["statusPipe"])
        self.assertFalse(os.path.exists(pidfile))

    def test_report_leaves_someone_elses_pidfile(self) -> None:
        directory = tempfile.mkdtemp(prefix="crossbar-startup-")
        self.addCleanup(shutil.rmtree, directory, True)
        pidfile = os.path.join(directory, "twistd.pid")
        with open(pidfile, "w") as f:
            f.write("1\n")
        self.assertRaises(
            SystemExit, report_and_exit, ConfigError("c.yaml", "listen", "x"), io.StringIO(), False, {"pidfile": pidfile}
        )
        self.assertTrue(os.path.exists(pidfile))

    def test_report_writes_one_line_and_exits_1(self) -> None:
        out = io.StringIO()
        e = self.assertRaises(SystemExit, report_and_exit, ConfigError("c.yaml", "routes.r", "bad"), out, False)
        self.assertEqual(e.code, 1)
        self.assertEqual(out.getvalue(), "crossbar: c.yaml: routes.r: bad\n")


class CheckTests(_TwistdCase):
    """``twistd crossbar --config FILE --check`` (issue 20 item 11): validates without
    starting, exit 0/1, the same one line a failed start writes."""

    def check(self, path: str) -> tuple[int, str, str]:
        argv = twistd_argv(path) + ["--check"]
        done = subprocess.run(argv, cwd=self.dir, env=twistd_env(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=START_TIMEOUT)
        self.assertNotIn("Traceback", done.stdout + done.stderr)
        return done.returncode, done.stdout, done.stderr

    def test_valid_file(self) -> None:
        port = free_port()
        path = self.write("good.yaml", GOOD.format(port=port, upstream=free_port()))
        with socket.socket() as busy:  # --check binds nothing: a port in use is no error
            busy.bind(("127.0.0.1", port))
            busy.listen()
            self.assertEqual(self.check(path), (0, f"crossbar: {path}: ok\n", ""))

    def test_warnings_are_shown(self) -> None:
        """A setting that loads but is probably a mistake (a host URL ending in /v1) is
        shown by --check as a start logs it; the file is still ok."""
        upstream = free_port()
        path = self.write("v1.yaml", GOOD.format(port=free_port(), upstream=upstream).replace(
            f"a: http://127.0.0.1:{upstream}", f"a: http://127.0.0.1:{upstream}/v1"))
        status, out, err = self.check(path)
        self.assertEqual((status, out), (0, f"crossbar: {path}: ok (1 warning)\n"))
        self.assertEqual(err, f"crossbar: warning: {path}: hosts.a: host 'a': the URL ends in /v1, but crossbar adds "
                              "/v1 itself (requests and polls would go to .../v1/v1/...): give the host's base URL "
                              "without /v1\n")

    def test_invalid_files_say_what_a_start_says(self) -> None:
        good = GOOD.format(port=free_port(), upstream=free_port())
        key = os.path.join(self.dir, "missing.pem")
        cases = {
            "unknown key": (good + "helth: {interval: 1}\n", "helth: unknown key"),
            "unknown host": (good.replace("hosts: [a]", "hosts: [a, gpu-z]"), "routes.r.hosts[1]: unknown host"),
            "ssl key": (f"listen: \"ssl:8443:privateKey={key}\"\n" + good.split("\n", 1)[1],
                        f"listen: not a valid Twisted endpoint: No such file or directory: {key}"),
        }
        for what, (text, problem) in cases.items():
            path = self.write("bad.yaml", text)
            status, out, err = self.check(path)
            self.assertEqual((status, out), (1, ""), what)
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertTrue(err.startswith(f"crossbar: {path}: {problem}"), (what, err))
            started = self.assertStartupFails(path)
            self.assertEqual(err.rstrip("\n"), started, what)
        missing = os.path.join(self.dir, "nowhere.yaml")
        self.assertEqual(self.check(missing), (1, "", f"crossbar: {missing}: cannot read: No such file or directory\n"))
