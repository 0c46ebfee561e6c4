"""tools/llama_server.py as a newcomer meets it: its help names no private command,
``write-model`` works under its public name, and a server's run log does not outlive it
(nor do logs of servers that died unstopped, after a day)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.harness import require_llama_server
from tools import llama_server
from tools.llama_server import LlamaServer, free_port, main, prune_run_logs

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "llama_server.py")


class HelpTests(SynchronousTestCase):
    def test_help_names_no_private_command(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            e = self.assertRaises(SystemExit, main, ["--help"])
        self.assertEqual(e.code, 0)
        self.assertIn("write-model", out.getvalue())
        self.assertNotIn("_write", out.getvalue())


class WriteModelTests(SynchronousTestCase):
    def test_write_model(self) -> None:
        """The public ``write-model`` writes a GGUF file (in an interpreter with gguf:
        this one, or the provisioned private venv; skipped when neither is there)."""
        python = sys.executable
        if subprocess.run([python, "-c", "import gguf, numpy"], capture_output=True).returncode != 0:
            python = str(llama_server.home() / "venv" / "bin" / "python")
            if not os.path.exists(python):
                raise SkipTest("no interpreter with gguf (run tools/llama_server.py provision)")
        directory = tempfile.mkdtemp(prefix="crossbar-tool-")
        self.addCleanup(shutil.rmtree, directory, True)
        out = os.path.join(directory, "m.gguf")
        subprocess.run([python, TOOL, "write-model", out, "tiny-a", "7"], check=True, timeout=120)
        with open(out, "rb") as f:
            self.assertEqual(f.read(4), b"GGUF")


class ProvisionLockTests(SynchronousTestCase):
    def test_provisioners_take_turns(self) -> None:
        """Two provisioners of one cache (parallel test workers, CI jobs) never work at
        once: while one holds ``provision.lock`` another waits, then finds the work
        done (here: the real binary named by CROSSBAR_LLAMA_SERVER and the tiny models
        already in a fresh cache directory) and prints the binary."""
        require_llama_server(self)
        binary = llama_server.find_llama_server()
        assert binary is not None
        cache = Path(tempfile.mkdtemp(prefix="crossbar-cache-"))
        self.addCleanup(shutil.rmtree, cache, True)
        models = cache / llama_server.models_dir().name
        models.mkdir()
        for name in llama_server.MODELS:
            (models / f"{name}.gguf").symlink_to(llama_server.model_path(name))
        env = dict(os.environ, CROSSBAR_LLAMA_HOME=str(cache), CROSSBAR_LLAMA_SERVER=binary)
        with open(cache / "provision.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            other = subprocess.Popen([sys.executable, TOOL, "provision"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
            self.addCleanup(lambda: other.poll() is None and other.kill())
            time.sleep(1.0)
            self.assertIsNone(other.poll(), "provision went on while another held the lock")
        out, _ = other.communicate(timeout=60)
        self.assertEqual(other.returncode, 0, out)
        self.assertEqual(out.decode().strip().splitlines()[-1], binary)


class PruneRunLogsTests(SynchronousTestCase):
    def test_old_logs_without_live_server_go(self) -> None:
        run = Path(tempfile.mkdtemp(prefix="crossbar-run-"))
        self.addCleanup(shutil.rmtree, run, True)
        now = time.time()
        old, fresh, alive, other = (run / n for n in ("llama-1.log", "llama-2.log", "llama-3.log", "notes.log"))
        for path in (old, fresh, alive, other):
            path.write_text("x")
            os.utime(path, (now - 2 * 86400, now - 2 * 86400))
        os.utime(fresh, (now - 60, now - 60))
        (run / "llama-3.pid").write_text(f"{os.getpid()}\n")  # a live process
        self.assertEqual(prune_run_logs(run, now=now), [old])
        self.assertEqual(sorted(p.name for p in run.iterdir()), ["llama-2.log", "llama-3.log", "llama-3.pid", "notes.log"])


class RunLogTests(SynchronousTestCase):
    def test_stop_removes_the_log(self) -> None:
        require_llama_server(self)
        srv = LlamaServer("single")
        self.addCleanup(srv.stop)
        srv.start()
        self.assertTrue(srv.log_path.exists())
        srv.stop()
        self.assertFalse(srv.log_path.exists())

    def test_cli_stop_removes_the_log(self) -> None:
        require_llama_server(self)
        port = free_port()
        started = subprocess.run([sys.executable, TOOL, "start", str(port)], capture_output=True, text=True,
                                 timeout=120)
        self.addCleanup(subprocess.run, [sys.executable, TOOL, "stop", str(port)], capture_output=True, timeout=60)
        self.assertEqual(started.returncode, 0, started.stderr)
        log = llama_server.home() / "run" / f"llama-{port}.log"
        self.assertIn(f"log={log}", started.stdout)
        self.assertTrue(log.exists())
        stopped = subprocess.run([sys.executable, TOOL, "stop", str(port)], capture_output=True, text=True, timeout=60)
        self.assertEqual(stopped.returncode, 0, stopped.stderr)
        self.assertFalse(log.exists())
