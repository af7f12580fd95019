"""Build a directory once for every process and host that shares a cache directory (a region's
feeders on its shared filesystem, or the processes of `serve --processes N`).

The builder holds `DIR.building`, a small JSON file made with O_EXCL that it rewrites every
second with its progress (so its mtime is a heartbeat). Everyone else waits while that file is
fresh, reading the progress from it, until DIR holds its finished marker. A builder that died
(the file not rewritten for STALE_S) is taken over: its file is renamed aside first, so of
several waiters that see it stale only one removes it. No fcntl locks: they are not reliable
on every shared filesystem, and a rename or an O_EXCL create is.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("feeder.kafka")

STALE_S = 30.0       # a builder's file not rewritten for this long: the builder is gone
BEAT_S = 1.0


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + ".building")


def read_progress(out: Path) -> dict | None:
    """The progress the builder of `out` last wrote, or None when none builds it."""
    try:
        return json.loads(lock_path(out).read_text())
    except (OSError, ValueError):
        return None


class Beat:
    """The builder's side: rewrites its lock file with `progress()` every BEAT_S until stopped."""

    def __init__(self, lock: Path, progress: Callable[[], dict]):
        self.lock, self.progress = lock, progress
        self._stop = threading.Event()
        self._who = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._thread = threading.Thread(target=self._run, name="snapshot-beat", daemon=True)
        self._thread.start()

    def write(self) -> None:
        tmp = self.lock.with_name(f"{self.lock.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_text(json.dumps({**self._who, **self.progress()}))
            os.replace(tmp, self.lock)   # readers see a whole file, and its mtime is the heartbeat
        except OSError as e:
            log.warning("cannot update %s: %s", self.lock, e)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.write()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def build_once(out: Path, done: Callable[[], bool], build: Callable[[], None], *,
               waiting: Callable[[dict | None], None], stale_s: float = STALE_S) -> bool:
    """Make `out` exist (`done()` true) by running `build()` here or by waiting for the process
    that runs it elsewhere; `waiting(progress)` is called about every second while waiting.
    Returns True if this process built it. `build` owns the lock file while it runs (it should
    start a Beat on lock_path(out)); a failed build releases it and raises."""
    lock = lock_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    while not done():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _wait_or_take_over(lock, stale_s, waiting)
            continue
        os.close(fd)
        try:
            if done():   # finished between our check and our create
                return False
            build()
            return True
        finally:
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
    return False


def _wait_or_take_over(lock: Path, stale_s: float, waiting: Callable[[dict | None], None]) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age <= stale_s:
        waiting(read_progress(lock.with_name(lock.name[:-len(".building")])))
        time.sleep(BEAT_S)
        return
    aside = lock.with_name(f"{lock.name}.stale-{os.getpid()}-{threading.get_ident()}")
    try:
        os.rename(lock, aside)   # only one of the waiters that saw it stale gets to move it
    except FileNotFoundError:
        return
    if time.time() - aside.stat().st_mtime <= stale_s:   # it was renewed just before our rename: put it back
        try:
            os.link(aside, lock)
        except FileExistsError:
            pass
    else:
        log.warning("the builder of %s stopped beating %.0fs ago; building it here", lock, age)
    aside.unlink()
