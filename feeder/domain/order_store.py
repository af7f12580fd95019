"""The order store: torch's large epoch orders, built once, kept narrow, memory-mapped, shared.

torch.randperm is a sequential shuffle: an epoch of n samples can only be had by drawing all n
(feeder.order.torch_randperm, O(n) time), so it is drawn once per (n, seed + epoch, loop) and
kept as a file of uint32 ids (uint64 past 2^32) in the cache directory:
`<cache>/orders/randperm-<fwd|io>-n<N>-s<SEED32>.u32`. Every process (`--processes N`), every job
and every feeder that reads that directory (a region's shared filesystem) maps the one copy;
only the pages read are resident. The next epoch's order is built in the background while this
one is served (`prepare`), so an epoch boundary does not stall.

One builder per file: an flock on `<file>.lock` elects it across processes and hosts; the
others wait for the file to appear. A large order is drawn in anonymous memory on huge pages
(2 MB TLB entries: at 10^9 samples the shuffle's page walks were a fifth of its time, 39 s ->
28 s) and then written out in one sequential pass that frees each part as it goes; elsewhere it
is drawn in memory-backed space (/dev/shm where the cache directory is on a disk: a
random-access shuffle over a disk-backed mapping is paced by writeback, ~4x slower). Either way
it is moved into place complete (rename), so a reader never sees a partial order. Progress is
kept per build (`builds()`: status, metrics, the log), and `stop()` (SIGTERM) ends a build
within milliseconds. Files beyond `max_bytes` are removed oldest-used first.

A rank does not wait for a build: its stream is served the order's first EARLY_POSITIONS,
drawn apart by every process that needs them (feeder.core.order.torch_prefix: milliseconds for the
forward loop, 0.62 s at 2.4*10^8 and 2.9 s at 10^9 for the inside-out one, against seconds to
minutes for the whole), while the whole is built; past them it waits for the whole (sampler.reach).

Nothing in the file is trusted (issue 34: a file of zeros left by a host crash, or 32 entries
overwritten, was served as ids). The ids are followed by a trailer written at build
(`TRAILER`: the order's identity, n, seed and loop, checked against the order asked for, and its
checks, feeder.order.order_checks), and the file is fsynced before it
is renamed into place and the directory after. A process verifies a file whole before it maps
it for streams, in one pass over blocks on up to 8 threads (torch's 10^9 order, 4 GB: 0.85 s on one
core of a Xeon server, 0.12 s on 8; see docs/guarantees.md): its size (truncated, or written
without its trailer), the trailer's n, the sums a permutation of [0, n) must have (any entry
overwritten, zeroed or out of range), and the position digests the builder recorded (swaps,
which keep every sum). A file that fails is said once in the log, counted (cache.damaged),
removed and built again while the ranks wait, as for any build; none of it is served.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import time

import numpy as np

from feeder.core import order
from feeder.core.errors import FailedPrecondition, InvalidArgument
from feeder.core.sampler import Early, OrderPending
from feeder.domain import order_file
from feeder.domain.order_build import Build
from feeder.domain.order_file import TRAILER
from feeder.domain.order_space import HOST, huge_pages_for, memory_backed, orders_directory, remove_orphans, shm_dir
from feeder.sources import cache

log = logging.getLogger("feeder.orders")

RETRY_S = 5.0           # a failed build is tried again this often
# What makes the cache directory unusable for an order (not the order's fault): then it is drawn
# in memory instead (OrderStore._in_memory).
UNUSABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}
# The first positions of an order being built, drawn apart and served meanwhile (`get(early=True)`;
# 4 MB of uint32): a rank's list in them is EARLY_POSITIONS / world samples, minutes of training
# for the ranks of a large job while the whole (a few seconds at 10^8, minutes at 10^10) is built.
EARLY_POSITIONS = 1 << 20
EARLY_WAIT_S = 1.0      # how long the first to ask waits for them (see _early)
WRITE_CHUNK = 64 << 20  # the huge-page build is written out and freed in parts this large


class OrderStore:
    """Large torch orders for one feeder process (see the module doc)."""

    def __init__(self, cache_dir: str, *, max_bytes: int = 64 << 30):
        # Why the cache directory cannot hold orders ("" while it can), for `feeder status` and the log.
        self.unusable = ""
        try:
            self.dir = orders_directory(cache_dir)
        except InvalidArgument as e:   # (not this user's, read-only): orders in a directory of the process's own
            self.dir = str(cache.own_directory("orders"))
            self.unusable = (f"{e}; epoch orders are built in {self.dir}, this process's own, not shared: give "
                             "this user a writable --cache-dir with room")
            log.warning(self.unusable)
        remove_orphans(self.dir)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._mapped: dict[str, np.ndarray] = {}      # name -> the file's mapping (read-only)
        self._builds: dict[str, Build] = {}           # name -> in progress here or waited for
        self._threads: dict[str, threading.Thread] = {}
        self._stopped = False
        self.built = 0            # builds finished by this process (metrics)
        self.build_seconds = 0.0
        self.verify_seconds = 0.0   # spent verifying files before mapping them (metrics)
        self._opening = threading.Lock()   # one verification at a time: ranks that ask together wait for it
        self._unreadable: dict[str, OSError] = {}   # orders whose file can be neither read nor replaced

    # -- what plans call (feeder.core.sampler.epoch_order, with the server's feeder.sources.Context) --
    def get(self, n: int, seed: int, kind: str, early: bool = False):
        """The order, or OrderPending (its build started, or waited for) saying how far it is;
        with `early`, its first EARLY_POSITIONS (sampler.Early) once they are drawn, while the
        whole is built (this process draws them, whoever builds the whole)."""
        name = self.name(n, seed, kind)
        with self._lock:
            hit = self._mapped.get(name)
        if hit is not None:
            return hit
        self._check_fits(n)
        with self._opening:
            with self._lock:
                hit = self._mapped.get(name)
            got = hit if hit is not None else self._open(name, n, seed, kind)
        if got is not None:
            return got
        b = self._start(name, n, seed, kind)
        if early and (part := self._early(b, seed, kind)) is not None:
            return part if len(part) == n else Early(part, n, b.describe)
        if b.error:
            raise OrderPending(f"the build of {name} failed ({b.error}); trying again every {RETRY_S:.0f} s")
        raise OrderPending(b.describe())

    def prepare(self, n: int, seed: int, kind: str) -> None:
        """Start building an order that will be needed soon, unless it exists or is under way."""
        name = self.name(n, seed, kind)
        with self._lock:
            if name in self._mapped or name in self._builds:
                return
        if n * order.order_dtype(n).itemsize > self.max_bytes:
            return   # (refused when asked for: get says why)
        if not os.path.exists(os.path.join(self.dir, name)):
            self._start(name, n, seed, kind)

    def builds(self) -> list[Build]:
        with self._lock:
            return list(self._builds.values())

    def stop(self, wait_s: float = 5.0) -> None:
        """End every build now (SIGTERM): their loops see the flag within ~10 ms, and their
        partial files (gigabytes of /dev/shm, which is memory) are removed before this returns."""
        with self._lock:
            self._stopped = True
            for b in self._builds.values():
                b.stop()
            threads = list(self._threads.values())
        deadline = time.monotonic() + wait_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- inside --
    def _check_fits(self, n: int) -> None:
        """An order larger than the cache's budget is refused before anything is built or
        removed (it would first evict every other order, then fail, and be tried again forever)."""
        size = n * order.order_dtype(n).itemsize
        if size > self.max_bytes:   # (--cache-max-gb is read as GiB: said in GiB)
            raise FailedPrecondition(
                f"torch's order of {n:,} samples is a file of {size / 2**30:,.1f} GiB, more than this feeder's order "
                f"cache holds (--cache-max-gb {self.max_bytes / 2**30:g} GiB): ask for permutation='stateless' (no "
                "file, any size), or serve with a larger --cache-max-gb")

    @staticmethod
    def name(n: int, seed: int, kind: str) -> str:
        loop = "io" if order.inside_out(kind, n) else "fwd"
        # torch seeds MT19937 with the seed's low 32 bits: seeds equal mod 2^32 share an order
        return f"randperm-{loop}-n{n}-s{seed & 0xFFFFFFFF}.u{8 * order.order_dtype(n).itemsize}"

    def _open(self, name: str, n: int, seed: int, kind: str) -> np.ndarray | None:
        """The order file `name`, verified whole (see the module doc) and mapped; None when it is
        not there, or was not sound (then it is removed, and the caller builds it again). The
        mapping served is the one verified (of the file opened, not of whatever the name points
        to by then: another process may replace it meanwhile)."""
        path = os.path.join(self.dir, name)
        dtype = order.order_dtype(n)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:   # not there yet
            return None
        except OSError as e:   # there, but not ours to read (chmod 000, another user's): drawn again
            try:
                os.unlink(path)   # (in its place, where the directory lets us)
                log.warning("order %s in %s could not be read (%s): removed, drawing it again", name, self.dir,
                            e.strerror)
            except OSError:
                self._unreadable[name] = e
            return None
        try:
            st = os.fstat(fd)
            t0 = time.perf_counter()
            why, mm = order_file.verified(fd, st.st_size, n, dtype, seed, kind)
            took = time.perf_counter() - t0
        finally:
            os.close(fd)   # (a mapping outlives its descriptor)
        if why:   # (removed only if it is still the file checked: another process may have rebuilt it)
            cache.remove_damaged(path, (st.st_dev, st.st_ino), "order", f"{name} in {self.dir}", why)
            return None
        arr = np.frombuffer(mm, dtype=dtype)   # (keeps the mapping open as long as it is used)
        self.verify_seconds += took
        log.info("order %s: verified in %.2f s (%.1f GB/s)", name, took, n * dtype.itemsize / max(took, 1e-9) / 1e9)
        os.utime(path)   # used: the last to be removed when the directory is over its budget
        with self._lock:
            self._mapped[name] = arr
            while len(self._mapped) > 8:   # the mappings of epochs long gone (a job's ranks are close)
                self._mapped.pop(next(iter(self._mapped)))
        return arr

    def _start(self, name: str, n: int, seed: int, kind: str) -> Build:
        with self._lock:
            b = self._builds.get(name)
            if b is not None and (not b.error or time.monotonic() - b.failed_at < RETRY_S):
                return b   # (a failed build is tried again RETRY_S after it failed, not at every poll)
            old, b = b, Build(name=name, n=n)
            self._builds[name] = b
            if old is not None and old.early is not None:   # (a failed build's early part: still the order's)
                b.early, b.early_started = old.early, old.early_started
                b.early_done.set()
            if self._stopped:
                b.stop()
            t = threading.Thread(target=self._build, args=(b, seed, kind), name=f"feeder-order-{n}", daemon=True)
            self._threads[name] = t
        t.start()
        return b

    def _early(self, b: Build, seed: int, kind: str) -> np.ndarray | None:
        """b's first positions, once drawn (else None: the stream says so, and asks again).
        The first to ask starts their drawing and waits for it up to EARLY_WAIT_S (the forward
        loop's take milliseconds, the inside-out loop's 0.62 s at 2.4*10^8: within it that
        rank's first batch is not put off to its stream's next poll). Only that one: the
        others return at once, so a new large order holds one thread of the feeder's shared
        pool for at most EARLY_WAIT_S, not every thread its ranks ask on (outside review: a
        job of 8 ranks starting on a 10^9 order held all 4 for a second, and another job's
        first batch waited 0.8 s)."""
        with self._lock:
            start = not b.early_started
            if start:
                b.early_started = time.monotonic()
                t = threading.Thread(target=self._draw_early, args=(b, seed, kind), name=f"feeder-order-{b.n}-early",
                                     daemon=True)
                self._threads[b.name + "#early"] = t
        if start:
            t.start()
            b.early_done.wait(EARLY_WAIT_S)
        return b.early

    def _draw_early(self, b: Build, seed: int, kind: str) -> None:
        try:
            t0 = time.monotonic()
            ids, stopped = order.torch_prefix(b.n, EARLY_POSITIONS, seed, kind, progress=b.early_progress)
            if not stopped:
                ids.setflags(write=False)
                b.early = ids
                log.info("order %s: its first %s positions drawn in %.2f s, served while the whole is built",
                         b.name, f"{len(ids):,}", time.monotonic() - t0)
        except Exception as e:   # (memory): the ranks wait for the whole, as without them
            log.error("order %s: its first positions could not be drawn: %s", b.name, e)
        finally:
            b.early_done.set()
            with self._lock:
                self._threads.pop(b.name + "#early", None)

    def _build(self, b: Build, seed: int, kind: str) -> None:
        path = os.path.join(self.dir, b.name)
        try:
            if b.name in self._unreadable:
                raise self._unreadable[b.name]
            with open(path + ".lock", "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:   # another process builds it: wait for the file
                    b.here = False
                    self._wait_for_other(b, path, lock)
                    return
                if not os.path.exists(path):
                    self._draw(b, path, seed, kind)
                if os.path.exists(path):   # (a waiter that opened it finds the order there once it has it)
                    os.unlink(path + ".lock")
        except OSError as e:
            if e.errno in UNUSABLE and self._in_memory(b, seed, kind, e):
                return   # (served: drawn in this process's memory instead)
            b.error, b.failed_at = str(e), time.monotonic()
            log.error("order %s: build failed: %s", b.name, e)
        except Exception as e:   # the stream says so and asks again
            b.error, b.failed_at = str(e), time.monotonic()
            log.error("order %s: build failed: %s", b.name, e)
        finally:
            with self._lock:
                if not b.error:
                    self._builds.pop(b.name, None)
                    b.early_progress[1] = 1   # (the whole is there: its early part, if still drawn, is not needed)
                self._threads.pop(b.name, None)

    def _in_memory(self, b: Build, seed: int, kind: str, e: OSError) -> bool:
        """The cache directory cannot hold the order (no permission, read-only, full): the data is
        sound, so the order is drawn in this process's memory and served, not shared, with a
        warning and `feeder status` saying what to fix (issue 44.2: the rank waited in silence
        while the log said "build failed" every 5 s). False when the draw itself fails."""
        why = (f"cache directory {self.dir}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}); epoch "
               "orders are drawn in each feeder process's memory, not shared: give this user a writable directory "
               "with room (--cache-dir)")
        if why != self.unusable:
            log.warning("%s (order %s)", why, b.name)
        self.unusable = why
        try:
            arr = order.torch_randperm(b.n, seed, kind)[0]
        except Exception as err:   # noqa: BLE001 - (memory): the build's own error is what the rank hears
            log.error("order %s: drawing it in memory failed too: %s", b.name, err)
            return False
        arr.setflags(write=False)
        with self._lock:
            self._mapped[b.name] = arr
            while len(self._mapped) > 8:
                self._mapped.pop(next(iter(self._mapped)))
        self.built += 1
        return True

    def _wait_for_other(self, b: Build, path: str, lock) -> None:
        """Another process holds the lock: take its progress from the sidecar, until the file
        is there or the lock is free (the builder died: then build it here)."""
        while not b.progress[1]:
            if os.path.exists(path):
                return
            try:
                b.progress[0] = int(open(path + ".progress").read() or 0)
            except (OSError, ValueError):
                pass
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(0.2)
                continue
            b.here = True   # the lock is ours: its holder is gone
            if not os.path.exists(path):
                raise RuntimeError("the process building it went away; building it here next")
            return

    def _draw(self, b: Build, path: str, seed: int, kind: str) -> None:
        n, dtype = b.n, order.order_dtype(b.n)
        size = n * dtype.itemsize
        remove_orphans(self.dir)   # (a builder SIGKILLed since this process started: its part holds room)
        self._make_room(size + TRAILER.size)
        huge = huge_pages_for(size)
        # A rank waiting for the early part has it sooner with a core to itself (on a 2-core host
        # the two draws at once put a first batch at 2.4*10^8 off by a fifth); the whole waits
        # for it at most EARLY_WAIT_S.
        if b.early_started:
            b.early_done.wait(max(0.0, b.early_started + EARLY_WAIT_S - time.monotonic()))
        scratch_dir = self.dir if huge or memory_backed(self.dir) else shm_dir(size) or self.dir
        scratch = os.path.join(scratch_dir, f".{b.name}.{HOST}.{os.getpid()}.part")   # (see order_space.remove_orphans)
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        log.info("order %s: building %s (%.1f GiB) %s", b.name, f"{n:,} ids", size / 2**30,
                 "on huge pages" if huge else f"in {scratch_dir}")
        t0 = time.monotonic()
        # Progress into the log and the sidecar until this build ends, however it ends: the
        # reporter is stopped and joined before the sidecar is removed, so none is left behind.
        ended = threading.Event()
        reporter = threading.Thread(target=self._report, args=(b, path, ended), daemon=True)
        try:
            with os.fdopen(fd, "r+b") as f:
                reporter.start()
                stopped = (self._draw_on_huge_pages if huge else self._draw_mapped)(b, f, scratch_dir, seed, kind, dtype)
                if stopped:
                    raise _Stopped()
                if scratch_dir != self.dir:   # onto the cache directory's filesystem, in one pass
                    part = os.path.join(self.dir, os.path.basename(scratch))
                    try:
                        shutil.copyfile(scratch, part)
                    except BaseException:   # (a full disk: the part copied so far must not fill it)
                        if os.path.exists(part):
                            os.unlink(part)
                        raise
                    os.unlink(scratch)
                    scratch = part
                cache.publish(scratch, path)   # (fsynced, renamed, the directory fsynced: see cache.py)
        except _Stopped:
            log.info("order %s: build stopped at %.0f%%", b.name, 100 * b.fraction)
            b.error, b.failed_at = "stopped", time.monotonic()
            return
        finally:
            ended.set()
            if reporter.is_alive():
                reporter.join()
            if os.path.exists(scratch):
                os.unlink(scratch)
            try:
                os.unlink(path + ".progress")
            except OSError:
                pass
        took = time.monotonic() - t0
        self.built += 1
        self.build_seconds += took
        log.info("order %s: built in %.1f s", b.name, took)

    @staticmethod
    def _draw_mapped(b: Build, f, where: str, seed: int, kind: str, dtype: np.dtype) -> bool:
        """Drawn straight into the file `f` (in directory `where`), mapped: True when stopped."""
        size = b.n * dtype.itemsize
        # Every block reserved now: a sparse file on a filesystem that fills up during the
        # build would kill this process with SIGBUS at the first page it cannot back; this
        # raises "No space left on device" instead (said to the ranks, tried again later).
        os.posix_fallocate(f.fileno(), 0, size + TRAILER.size)
        with mmap.mmap(f.fileno(), size) as mm:
            out = np.frombuffer(mm, dtype=dtype)
            stopped = order.torch_randperm(b.n, seed, kind, out=out, progress=b.progress)[1]
            trailer = None if stopped else order_file.trailer(b.n, out, seed, kind)
            del out   # (the mapping closes only once no array views it)
        if not stopped:
            os.pwrite(f.fileno(), trailer, size)
            os.fsync(f.fileno())
        return stopped

    @staticmethod
    def _draw_on_huge_pages(b: Build, f, where: str, seed: int, kind: str, dtype: np.dtype) -> bool:
        """Drawn in anonymous memory on huge pages, then written to `f` in order, each part
        freed once written (so the order is held about once, not twice, even when `f` is on
        tmpfs); a full filesystem is an OSError, never a SIGBUS. True when stopped."""
        size = b.n * dtype.itemsize
        # Room first, so a full filesystem fails now and not after a draw of 30 s (drawn again
        # and again). On a disk the blocks are reserved; on tmpfs reserving them would hold
        # the order twice while it is drawn, so there free space is checked instead.
        if memory_backed(where):
            st = os.fstatvfs(f.fileno())
            if st.f_bavail * st.f_frsize < size:
                raise OSError(errno.ENOSPC, f"No space left on device: the order needs {size:,} bytes, "
                                            f"{where} has {st.f_bavail * st.f_frsize:,} free")
        else:
            os.posix_fallocate(f.fileno(), 0, size + TRAILER.size)
        with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as mm:
            try:
                mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:   # a kernel without them: the same order, on small pages
                pass
            out = np.frombuffer(mm, dtype=dtype)
            stopped = order.torch_randperm(b.n, seed, kind, out=out, progress=b.progress)[1]
            trailer = None if stopped else order_file.trailer(b.n, out, seed, kind)
            del out
            if stopped:
                return True
            view = memoryview(mm)
            try:
                for at in range(0, size, WRITE_CHUNK):
                    if b.progress[1]:   # stop() while writing out (SIGTERM): within one part
                        return True
                    f.write(view[at:at + WRITE_CHUNK])
                    f.flush()
                    cache.write_back(f.fileno(), at, min(WRITE_CHUNK, size - at))   # (less for the fsync)
                    mm.madvise(mmap.MADV_DONTNEED, at, min(WRITE_CHUNK, size - at))
                f.write(trailer)
                f.flush()   # all of it in the file before the file is renamed into place
                os.fsync(f.fileno())
            finally:
                view.release()
        return False

    def _report(self, b: Build, path: str, ended: threading.Event) -> None:
        """Progress into the log every 10 % and into a sidecar other processes read."""
        shown = 0
        while not ended.is_set() and not b.progress[1] and b.fraction < 1:
            f = b.fraction
            if f >= shown + 0.1:
                shown = int(f * 10) / 10
                log.info("%s", b.describe())
            try:
                with open(path + ".progress", "w") as p:
                    p.write(str(int(b.progress[0])))
            except OSError:
                pass
            ended.wait(0.5)

    def _make_room(self, size: int) -> None:
        """Remove the least recently used orders until `size` more bytes fit in max_bytes."""
        files, parts = [], 0
        for e in os.scandir(self.dir):
            if e.name.startswith("randperm-") and not e.name.endswith((".lock", ".progress")):
                st = e.stat()
                files.append((st.st_mtime, st.st_size, e.path))
            elif e.name.startswith(".randperm-") and e.name.endswith(".part"):
                try:   # builds under way (here or on another host) hold room too; never removed here
                    parts += e.stat().st_blocks * 512
                except FileNotFoundError:
                    pass
        total = parts + sum(s for _, s, _ in files)
        for _, s, p in sorted(files):
            if total + size <= self.max_bytes:
                break
            os.unlink(p)   # (a process that maps it keeps its pages; a new one builds it again)
            total -= s
            log.info("order cache: removed %s (over %.1f GiB)", os.path.basename(p), self.max_bytes / 2**30)


class _Stopped(Exception):
    pass
