"""CPU per small request of one crossbar, and (``--profile``) where it goes, for a shared machine.

    python bench/cpu_probe.py [--python PY] [--seconds 3] [--reps 3] [--profile] [--top 60] [--src DIR]

Starts ``bench/upstream.py`` (with ``$BENCH_PY``, default ``bench/.venv/bin/python``:
it needs uvloop and httptools) and one crossbar (``PY -m twisted``'s ``twistd`` from
``--python``, default this interpreter, with ``PYTHONPATH=--src``, default this checkout),
drives it with ``wrk -t1 -c16`` POSTing bench (a)'s 90-byte chat request, and prints
crossbar's CPU time (``/proc/<pid>/stat``: user + system, not wall time, so other work on
the machine moves it little) divided by the requests wrk counted, per repetition.

``--workers N`` runs crossbar with ``workers: N`` and prints the CPU of each process
of its tree (the supervisor, each worker) per request besides the whole tree's;
``--log stdout|json`` logs to twistd's standard output (text, or
``--logger crossbar.ops.jsonlog.observer``) instead of ``--logfile`` (issue 33).

``--profile --workers N`` profiles the workers (a ``sitecustomize`` on their
``PYTHONPATH``), their profiles summed.

``--profile`` runs crossbar under cProfile with ``time.process_time`` as its clock,
enabled only for the measured repetitions (``SIGUSR2`` toggles it), and prints per
request: the top functions by inclusive time with their calls per request, and the share
of self time by package. The profiler's own cost inflates every call (a profiled request
costs ~5x an unprofiled one): read the shares and the call counts, not the microseconds.
Measured with it: bench/HISTORY.md, "Leaner request path".
"""
from __future__ import annotations

import argparse
import collections
import os
import pstats
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
BODY = '{"model":"bench","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
_WRAP = """import cProfile, signal, sys, time
out = sys.argv[1]; sys.argv = ["twistd"] + sys.argv[2:]
p = cProfile.Profile(time.process_time); on = [False]
def toggle(*a):
    if not on[0]:
        on[0] = True; p.enable()
    else:
        p.disable(); p.dump_stats(out)
signal.signal(signal.SIGUSR2, toggle)
from twisted.scripts.twistd import run
run()
"""


_WORKER_WRAP = """import sys
if "crossbar.process.worker" in sys.orig_argv:
    import cProfile, os, signal, time
    _p = cProfile.Profile(time.process_time); _on = [False]
    def _toggle(*a):
        if not _on[0]:
            _on[0] = True; _p.enable()
        else:
            _p.disable(); _p.dump_stats(os.environ["CPU_PROBE_PROFILE"] + "." + str(os.getpid()))
    signal.signal(signal.SIGUSR2, _toggle)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--src", default=str(HERE.parent), help="the checkout whose crossbar is measured")
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--streams", type=int, default=0, metavar="N",
                    help="drive N streams of 200 events 5 ms apart (bench (b)'s shape) instead of wrk: figures per event")
    ap.add_argument("--burst", type=int, default=0, metavar="N",
                    help="open N one-event streams at once, each on a new connection, again and again "
                         "(the start of bench (b)'s burst) instead of wrk: figures per stream")
    ap.add_argument("--workers", type=int, default=1, help="workers: N (CPU per process of the tree)")
    ap.add_argument("--log", choices=("file", "stdout", "json"), default="file",
                    help="twistd's log: --logfile (default), its standard output as text, or JSON lines")
    ap.add_argument("--save", metavar="FILE", help="with --profile: keep the profile (and the request count) in FILE")
    ap.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="compare two --save files: calls per request by function, largest changes first")
    a = ap.parse_args()
    if a.diff:
        diff(Path(a.diff[0]), Path(a.diff[1]), a.top)
        return
    tmp = Path(tempfile.mkdtemp(prefix="cpu_probe."))
    bench_py = os.environ.get("BENCH_PY", str(HERE / ".venv/bin/python"))
    up = subprocess.Popen([bench_py, str(HERE / "upstream.py"), "--port", "0"], stdout=subprocess.PIPE, text=True)
    cb = None
    try:
        assert up.stdout is not None
        up_port = int(up.stdout.readline().split()[1])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = tmp / "cb.yaml"
        cfg.write_text(f'listen: "tcp:{port}:interface=127.0.0.1:backlog=1024"\nhealth: {{interval: 5, timeout: 5}}\n'
                       f"hosts:\n  up: http://127.0.0.1:{up_port}\n"
                       "routes:\n  bench:\n    hosts: [up]\n    default_model: bench\n"
                       + (f"workers: {a.workers}\n" if a.workers > 1 else ""))
        prof = tmp / "prof.out"
        env = dict(os.environ, PYTHONPATH=a.src)
        if a.profile and a.workers > 1:  # the workers are profiled (sitecustomize), not the supervisor
            (tmp / "site").mkdir()
            (tmp / "site" / "sitecustomize.py").write_text(_WORKER_WRAP)
            env.update(PYTHONPATH=f"{tmp / 'site'}{os.pathsep}{a.src}", CPU_PROBE_PROFILE=str(prof))
            pre = [a.python, str(Path(a.python).parent / "twistd")]
        elif a.profile:
            (tmp / "wrap.py").write_text(_WRAP)
            pre = [a.python, str(tmp / "wrap.py"), str(prof)]
        else:
            pre = [a.python, str(Path(a.python).parent / "twistd")]
        log = {"file": [f"--logfile={tmp}/cb.log"], "stdout": [],
               "json": ["--logger", "crossbar.ops.jsonlog.observer"]}[a.log]
        cb = subprocess.Popen(pre + ["-n", "--pidfile="] + log + ["crossbar", "--config", str(cfg)],
                              cwd=tmp, env=env,
                              stdout=open(tmp / "cb.out", "w"), stderr=open(tmp / "cb.err", "w"))
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_crossbar/readyz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit((tmp / "cb.err").read_text()[-3000:])
        lua = tmp / "post.lua"
        lua.write_text(f"wrk.method = \"POST\"\nwrk.body = '{BODY}'\nwrk.headers[\"Content-Type\"] = \"application/json\"\n")
        pid = cb.pid

        def cpu_of(p: int) -> float:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

        def sys_of(p: int) -> float:  # the kernel's share: system calls, the network stack
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            return int(f[12]) / os.sysconf("SC_CLK_TCK")

        def processes() -> list[int]:  # the supervisor, then its workers
            kids: list[int] = []
            for task in Path(f"/proc/{pid}/task").iterdir():
                kids += [int(c) for c in (task / "children").read_text().split()]
            return [pid] + sorted(kids)

        def cpu() -> float:
            return sum(cpu_of(p) for p in procs)

        procs = [pid]
        if a.workers > 1:
            for _ in range(100):
                procs = processes()
                if len(procs) == a.workers + 1:
                    break
                time.sleep(0.1)

        def wrk(seconds: int) -> int:
            out = subprocess.run(["wrk", "-t1", "-c16", f"-d{seconds}s", "-s", str(lua),
                                  f"http://127.0.0.1:{port}/bench/v1/chat/completions"],
                                 capture_output=True, text=True).stdout
            m = re.search(r"(\d+) requests in", out)
            if m is None or "Non-2xx" in out:
                raise SystemExit(f"cpu_probe: wrk:\n{out}")
            return int(m.group(1))

        if a.streams or a.burst:
            sys.path.insert(0, str(HERE))
            import asyncio

            from load import run_streams

        if a.streams:
            def wrk(seconds: int) -> int:  # noqa: F811 - the streams drive instead of wrk's
                res = asyncio.run(run_streams("127.0.0.1", port, "/bench", a.streams, 200, 5, 60))
                if res.completed != a.streams:
                    raise SystemExit(f"cpu_probe: {a.streams - res.completed} streams failed")
                return sum(s.events for s in res.streams)

        if a.burst:
            def wrk(seconds: int) -> int:  # noqa: F811 - bursts drive instead of wrk
                async def bursts() -> int:
                    done, end = 0, time.monotonic() + seconds
                    while time.monotonic() < end:
                        res = await run_streams("127.0.0.1", port, "/bench", a.burst, 1, 0, 60)
                        if res.completed != a.burst:
                            raise SystemExit(f"cpu_probe: {a.burst - res.completed} streams of a burst failed")
                        done += a.burst
                    return done
                return asyncio.run(bursts())

        wrk(1)  # warm-up: connections, pools, caches
        profiled = procs[1:] if a.workers > 1 else [pid]

        def toggle() -> None:
            for p in profiled:
                os.kill(p, signal.SIGUSR2)

        if a.profile:
            toggle()
            time.sleep(0.5)
        served, per = 0, []
        for _ in range(a.reps):
            each0 = [cpu_of(p) for p in procs]
            sys0 = sum(sys_of(p) for p in procs)
            t0 = time.monotonic()
            n = wrk(a.seconds)
            wall = time.monotonic() - t0
            each = [(cpu_of(p) - c) / n * 1e6 for p, c in zip(procs, each0)]
            kernel = (sum(sys_of(p) for p in procs) - sys0) / n * 1e6
            per.append(sum(each))
            served += n
            unit = "event" if a.streams else "stream" if a.burst else "request"
            split = ("  (supervisor " + " ".join(f"{e:.1f}" for e in each[:1]) + ", workers "
                     + " ".join(f"{e:.1f}" for e in each[1:]) + ")") if len(procs) > 1 else ""
            print(f"{unit}s {n} ({n / wall:.0f}/s)  crossbar CPU us/{unit} {per[-1]:.1f} (kernel {kernel:.1f}){split}",
                  flush=True)
        print(f"median CPU us/{unit} {sorted(per)[len(per) // 2]:.1f}" + ("  (profiled)" if a.profile else ""))
        if a.profile:
            toggle()
            if a.workers > 1:
                dumps = [Path(f"{prof}.{p}") for p in profiled]
                for _ in range(100):
                    if all(d.exists() for d in dumps):
                        break
                    time.sleep(0.1)
                time.sleep(1)
                merged = pstats.Stats(*(str(d) for d in dumps))
                merged.dump_stats(str(prof))
            else:
                for _ in range(100):
                    if prof.exists():
                        break
                    time.sleep(0.1)
                time.sleep(1)
            report(prof, served, a.top)
            if a.save:
                Path(a.save).write_bytes(prof.read_bytes())
                Path(a.save + ".n").write_text(str(served))
    finally:
        if cb is not None:
            cb.send_signal(signal.SIGINT)
            cb.wait()
        up.kill()
        up.wait()


def report(prof: Path, n: int, top: int) -> None:
    """Per request: top inclusive functions (us, calls, self us) and self time by package."""
    st = pstats.Stats(str(prof))
    rows, groups, calls = [], collections.Counter[str](), collections.Counter[str]()
    for (f, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if "poll' of 'select" in fn:
            continue  # waiting, not working
        short = f.split("site-packages/")[-1]
        if "/crossbar/" in short:
            short = "crossbar/" + short.split("/crossbar/", 1)[1]
        rows.append((ct, nc, tt, f"{fn} ({short}:{line})"))
        parts = short.split("/")
        key = "/".join(parts[:2]) if parts[0] in ("twisted", "crossbar") and len(parts) > 2 else (
            "builtins (C)" if f == "~" else parts[0] if "site-packages/" in f or parts[0] == "crossbar" else "stdlib")
        groups[key] += tt
        calls[key] += nc
    total = sum(groups.values())
    print(f"\nprofiled requests {n}; Python function calls per request {sum(calls.values()) / n:.0f}")
    print("self time by package (% of crossbar CPU, calls per request):")
    for k, v in groups.most_common(14):
        print(f"  {v / total * 100:5.1f}%  {calls[k] / n:6.0f}  {k}")
    print("top inclusive (% of crossbar CPU, calls per request, self %):")
    for ct, nc, tt, name in sorted(rows, reverse=True)[:top]:
        print(f"  {ct / total * 100:5.1f}%  {nc / n:6.2f}  {tt / total * 100:5.1f}%  {name}")


def _calls(path: Path) -> tuple[collections.Counter[str], int]:
    n = int(Path(str(path) + ".n").read_text())
    st = pstats.Stats(str(path))
    out = collections.Counter[str]()
    for (f, line, fn), (_cc, nc, _tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        short = f.split("site-packages/")[-1]
        if "/crossbar/" in short:
            short = "crossbar/" + short.split("/crossbar/", 1)[1]
        out[f"{fn} ({short})"] += nc
    return out, n


def diff(before: Path, after: Path, top: int) -> None:
    """Calls per request of each function in two saved profiles, the largest changes first.

    Call counts do not depend on the machine's load, so two profiles taken at different
    times compare fairly (the timings in them do not)."""
    a, na = _calls(before)
    b, nb = _calls(after)
    print(f"calls per request: before {sum(a.values()) / na:.0f}, after {sum(b.values()) / nb:.0f}")
    rows = sorted(((b[k] / nb - a[k] / na, k) for k in set(a) | set(b)), key=lambda r: -abs(r[0]))
    for d, k in rows[:top]:
        if abs(d) >= 0.05:
            print(f"  {d:+7.2f}  {a[k] / na:6.2f} -> {b[k] / nb:6.2f}  {k}")


if __name__ == "__main__":
    main()
