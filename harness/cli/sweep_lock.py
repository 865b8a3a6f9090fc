"""One process at a time in a sweep folder.

Two ``kvbench -m ... sweep_id=same`` started together would run every job twice into the same
folders, each overwriting the other's files and mixing lines in their logs. ``SweepLock``
(``hydra.callbacks`` in conf/config.yaml) takes an exclusive lock on ``<sweep folder>/.lock``
when a multirun starts, in the launching process, before the sweeper writes anything; the
file says who holds it. The lock is the operating system's (``flock``): it ends with its
process however that process ends, so a killed sweep leaves no stale lock behind. A second
process is refused in one line naming the holder, exit status 2, or, with
``sweep_wait=true``, waits until the holder ends and then runs (skipping the jobs it finished).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from harness.cli.run import PARTIAL

LOCK_FILE = ".lock"


class SweepLock(Callback):
    """On multirun start: lock the sweep folder for this process (refused or waiting when
    another holds it); on multirun end: release it."""

    def __init__(self) -> None:
        self._held: IO[str] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.sweep.dir))
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / LOCK_FILE, "a+")  # noqa: SIM115  (held until the sweep ends)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "a process that has not said who it is yet"
            if not config.get("sweep_wait", False):
                lock.close()
                print(
                    f"kvbench: error: {folder} is in use by another sweep ({holder}): wait for "
                    "it to end, add sweep_wait=true to run after it, or choose another sweep_id",
                    file=sys.stderr,
                )
                sys.exit(2)
            print(f"kvbench: waiting for {folder}: in use by {holder}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        lock.flush()
        self._held = lock

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        with contextlib.suppress(OSError):  # its jobs moved out: gone once empty
            (Path(str(config.hydra.sweep.dir)) / PARTIAL).rmdir()
        if self._held is not None:
            self._held.close()  # closing the file releases the lock
            self._held = None
