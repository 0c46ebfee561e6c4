"""The workers' directories that supervisors left behind (docs/design.md §Workers).

A supervisor makes its workers' shared files in a fresh ``crossbar-workers-*``
directory and removes it when it stops. One killed with SIGKILL (or by the OOM killer)
cannot: its directory stayed in the temp folder for ever. So each supervisor marks its
directory as its own for as long as it lives (:func:`claim`: an ``owner`` file naming
its pid, which it holds an exclusive ``flock`` on), and when it starts removes the
directories whose owner is gone (:func:`remove_leftovers`).

The lock says whether the owner lives, not the pid: the kernel drops a process's
locks when it dies, however it dies, while a pid is reused (a container's supervisor
is often pid 1 every time). A directory is removed only when its ``owner`` file can be
locked, i.e. no live process holds it: never a live supervisor's. A directory without
an ``owner`` file (one a supervisor is making right now, or one of a crossbar that did
not mark its directories) is left alone, as is anything not a directory of this user.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat

__all__ = ["OWNER", "PREFIX", "claim", "owner_gone", "remove_leftovers"]

PREFIX = "crossbar-workers-"
"""How a supervisor's directory is named (:func:`tempfile.mkdtemp`'s prefix)."""
OWNER = "owner"
"""The file in it that says whose it is: the owner's pid, locked while it lives."""


def claim(directory: str) -> int:
    """Mark ``directory`` as this process's while it lives: its ``owner`` file holds
    this pid and is locked through the returned descriptor (keep it open; it is not
    inherited by child processes). The file is locked before it takes its name, so no
    one ever sees it unlocked while its owner lives.

    :raises OSError: the file cannot be made or locked."""
    temporary = os.path.join(directory, f".{OWNER}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(temporary, os.path.join(directory, OWNER))
    except OSError:
        os.close(fd)
        raise
    return fd


def owner_gone(directory: str) -> int | None:
    """The pid that owned ``directory`` when no live process holds its ``owner`` file
    any more (0 when the file names none), else None: its owner lives, or it has no
    ``owner`` file, or the file cannot be read."""
    try:
        fd = os.open(os.path.join(directory, OWNER), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return None  # held: its owner lives
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else 0
    finally:
        os.close(fd)


def remove_leftovers(parent: str) -> list[tuple[str, int]]:
    """Remove every ``crossbar-workers-*`` directory of this user in ``parent`` whose
    owner is gone (:func:`owner_gone`); returns each one removed with the pid that
    owned it. Never raises: what cannot be read or removed is left."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        pid = owner_gone(path)
        if pid is None:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append((path, pid))
    return removed
