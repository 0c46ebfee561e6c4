"""The directory a supervisor shares with its workers (docs/design.md §Workers).

It is made once the listener is open (a start-up that fails leaves nothing behind), in
systemd's ``RUNTIME_DIRECTORY`` when there is one (never aged out by tmp cleaners), else
in the temporary directory, after the directories of supervisors that are gone were
removed there (:mod:`crossbar.process.leftovers`); it is this process's (claimed) while
it lives, and removed when it stops. It holds the shared counts, the keys' limits, the
workers' metrics and the config snapshot: the text the supervisor validated last, the
only config a worker ever loads.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.logger import Logger

from crossbar.config import Config, ConfigError
from crossbar.process.leftovers import PREFIX, claim, remove_leftovers
from crossbar.state.box_limits import BoxLimits
from crossbar.state.shared import SharedCounts

__all__ = ["WorkerFiles"]

_log = Logger(namespace="crossbar.supervisor")


class WorkerFiles:
    """The workers' directory and the paths in it (each ``""`` until :meth:`make`).

    :ivar directory: the directory.
    :ivar counts: the shared counts' file (:class:`~crossbar.state.shared.SharedCounts`).
    :ivar limits: the keys' limits' file (:class:`~crossbar.state.box_limits.BoxLimits`).
    :ivar metrics: the workers' metrics directory (``PROMETHEUS_MULTIPROC_DIR``).
    :ivar snapshot: the config the workers load (:meth:`write_snapshot`).
    """

    def __init__(self) -> None:
        self.directory = ""
        self.counts = ""
        self.limits = ""
        self.metrics = ""
        self.snapshot = ""
        self._owner: int | None = None  # the descriptor holding the directory's owner lock

    def make(self, config: Config, runtime: str | None, rows: int, limit_slots: int) -> SharedCounts:
        """Make the directory in ``runtime`` (None: the temporary directory) with its
        files for ``rows`` processes (the workers, then the supervisor) and
        ``limit_slots`` keys with limits, and ``config`` as the snapshot; returns the
        shared counts open on the last row (the supervisor's).

        :raises ConfigError: a file cannot be made (the directory is removed again).
        :raises OSError: the directory itself cannot be made."""
        for path, pid in remove_leftovers(runtime or tempfile.gettempdir()):
            _log.info("removed {directory}, left by a supervisor that is gone (pid {pid})", directory=path, pid=pid)
        self.directory = tempfile.mkdtemp(prefix=PREFIX, dir=runtime)
        try:
            self._owner = claim(self.directory)  # held while this process lives: not a leftover
            self.counts = os.path.join(self.directory, "counts")
            SharedCounts.create(self.counts, rows)
            shared = SharedCounts(self.counts, rows, rows - 1)
            self.limits = os.path.join(self.directory, "limits")
            BoxLimits.create(self.limits, rows, limit_slots)
            self.metrics = os.path.join(self.directory, "metrics")
            os.mkdir(self.metrics)
            self.snapshot = os.path.join(self.directory, "config.yaml")
            self.write_snapshot(config)
        except OSError as e:
            self.remove()
            raise ConfigError(config.source, "workers",
                              f"cannot make the workers' shared files in {self.directory}: {e.strerror or e}") from None
        return shared

    def write_snapshot(self, config: Config) -> None:
        """Make ``config``'s text the one workers load (replaced atomically); nothing
        before :meth:`make` (workers are given the snapshot then).

        :raises OSError: it cannot be written."""
        if not self.snapshot:
            return
        temporary = self.snapshot + ".new"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config.text)
        os.replace(temporary, self.snapshot)

    def remove(self) -> None:
        """Remove the directory and give up its claim (the supervisor stopped)."""
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None
