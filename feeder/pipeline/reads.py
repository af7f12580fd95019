"""The source reads in flight on a feeder process's threads, and which of them are stuck.

A stream's (or a members' window's) next message is built on the batch pool: it reads the
source (a chunk of a file, a Kafka snapshot) and cuts, packs and frames the batches. A read
that never returns (a hung filesystem, a dead NFS server, an OST that stalls) leaves the
stream silent while the server still answers: what its ranks must not wait out. Each build is
recorded here from its submission until its thread returns (not until its awaiting task gives
up: the thread is what is stuck), with the sources it reads and the stream waiting on it;
Engine.watch_reads asks which are older than --stuck-after-s.
"""
from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass
class Read:
    names: tuple[str, ...]     # the sources it reads (a mixture's all)
    since: float               # monotonic time it was submitted
    what: str                  # for the log and status: "job J rank R"
    streams: list = field(default_factory=list)   # the streams waiting on it (ended when it is stuck)
    told: bool = False         # said once in the log


class Reads:
    """The builds in flight (thread-safe: their threads remove them when they return)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[int, Read] = {}
        self._n = 0

    async def run(self, pool: ThreadPoolExecutor, fn, *args, names: tuple[str, ...], what: str, streams=()):
        """fn(*args) on the pool, recorded while its thread runs it."""
        read = Read(names=names, since=time.monotonic(), what=what, streams=list(streams))
        with self._lock:
            k, self._n = self._n, self._n + 1
            self._open[k] = read
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def returned(cf) -> None:   # (on the pool's thread)
            self._close(k)
            loop.call_soon_threadsafe(_settle, done, cf)

        # Not asyncio.wrap_future: a stream that gives up waiting (it is ended) must not cancel a
        # build still queued behind stuck reads; that one stays recorded until a thread runs it.
        pool.submit(fn, *args).add_done_callback(returned)
        return await done

    def _close(self, k: int) -> None:
        with self._lock:
            self._open.pop(k, None)

    def older_than(self, age_s: float, now: float | None = None) -> list[Read]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return [r for r in self._open.values() if now - r.since > age_s]

    def in_flight(self) -> int:
        with self._lock:
            return len(self._open)


def name_threads(name: str) -> None:
    """Give the calling thread an OS name (what `top -H`, `ps -L` and /proc show): a pool's
    initializer, so an operator can tell the batch threads (and a stuck one) apart."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _settle(done: asyncio.Future, cf) -> None:
    if done.cancelled():
        return
    e = cf.exception()
    if e is not None:
        done.set_exception(e)
    else:
        done.set_result(cf.result())
