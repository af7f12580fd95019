"""Best-fit bins built block by block: on every core, by every feeder sharing the cache
directory, in bounded memory (issue 35).

The packing rule (docs/packing.md) is applied per block: block b holds the documents that start
in tokens [b·B, (b + 1)·B) of the source's stream (B = `PackingConfig.block_tokens`), packed by
feeder.core.layout.best_fit on their own; the bins are block 0's, then block 1's, ... So the bins
are a pure function of the documents, seq_len and B, whoever built which block, and a corpus of
at most B tokens has the bins of one whole-corpus pass. A block's documents come from the
source's own table (`Documents.doc_spans`: Megatron's index in whole arrays), never a Python
step per document.

How a build runs: each block is written to `<sidecar>.blocks/NNNNNNN/` (complete, then renamed
into place); one builder per block, elected by an flock on its `.lock` as orders elect theirs,
so threads of this process (the C packer and numpy's gathers release the GIL) and every other
feeder on the cache take blocks until none is left, and a block whose builder died (its flock
released) is built by whoever finds it so. The last block's finder joins them, under
`join.lock`, into the sidecar feeder.sources.packed reads (three .npy arrays and stats.json,
written whole and put in place by feeder.sources.packed), then removes the blocks. `stop()` (SIGTERM) ends every
build between two blocks: the blocks finished stay (a later build takes them up), nothing is
left half-written.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from feeder.core.config import PackingConfig
from feeder.core.layout import PACKER, best_fit, doc_lengths, narrow
from feeder.sources import cache

try:
    from feeder._native import crc32c as crc   # ~10 GB/s, without the GIL
except ImportError:  # no C compiler at install
    from zlib import crc32 as crc

log = logging.getLogger("feeder.packing")

ARRAYS = ("ptr", "start", "length")     # the sidecar's arrays, in the order its digest hashes them
# What np.load raises for an array file that is damaged, cut short or empty (EOFError: what a host
# crash often leaves): a block's or a sidecar's, each then damage, built again.
UNREADABLE = (OSError, ValueError, EOFError)
_COUNTS = ("documents", "bins", "pieces", "tokens", "truncated")   # a block's counts (figures.json)


def array_types(pieces: int, n_tokens: int) -> dict[str, np.dtype]:
    """Each array's dtype, a block's as the joined sidecar's: bin pointers into `pieces` pieces,
    piece starts in a stream of n_tokens, piece lengths. What a reader holds the .npy headers to
    (the checks cover the bytes, not the header that says how to read them)."""
    return {"ptr": narrow(pieces), "start": narrow(n_tokens), "length": np.dtype(np.uint32)}
# Each array's elements in segments of this many, each with its crc32c in the sidecar's figures:
# what a feeder verifies on first use of a bin (feeder.sources.packed), ~2 MB of piece starts, so
# a first batch reads and checks a few MB whatever the corpus (at 10^9 documents the arrays are
# ~16 GB: hashing them whole at open took 23 s).
SEGMENT = 1 << 18


class Stopped(Exception):
    """The build was stopped (SIGTERM) between two blocks."""


class _Torn(Exception):
    """A block on disk is not what its builder wrote."""

    def __init__(self, block: int, why: str):
        super().__init__(f"block {block}: {why}")
        self.block, self.why = block, why


def n_blocks(n_tokens: int, block_tokens: int) -> int:
    return max(1, -(-n_tokens // block_tokens))


def pack_block(source, b: int, seq_len: int, block_tokens: int) -> tuple[dict, dict]:
    """Block b's bins (arrays as the sidecar keeps them, `ptr` counted from the block's first
    piece) and its figures."""
    t0 = time.perf_counter()
    lo = b * block_tokens
    starts, end = source.doc_spans(lo, min(lo + block_tokens, source.n_tokens))
    t1 = time.perf_counter()
    p = best_fit(starts, end, seq_len + 1)
    types = array_types(len(p.start), source.n_tokens)
    arrays = {k: getattr(p, k).astype(types[k], copy=False) for k in ARRAYS}
    lengths = doc_lengths(starts, end)
    figures = {"documents": int(len(starts)), "bins": int(p.n_bins), "pieces": int(len(p.start)),
               "tokens": int(end - starts[0]) if len(starts) else 0,
               "truncated": int(np.count_nonzero(lengths > seq_len + 1)),
               "read_s": t1 - t0, "pack_s": time.perf_counter() - t1}
    return arrays, figures


class _Build:
    """One process's part in building one sidecar."""

    def __init__(self, source, seq_len: int, where: Path, cfg: PackingConfig, note, publish,
                 stopping: threading.Event):
        self.source, self.seq_len, self.where, self.cfg, self.note = source, seq_len, where, cfg, note
        self.publish = publish
        self.parts = where.parent / f"{where.name}.blocks"
        self.n = n_blocks(source.n_tokens, cfg.block_tokens)
        self._lock = threading.Lock()
        self._next = 0
        self.elsewhere: list[int] = []        # blocks another builder held when this one came to them
        self.built_here = 0
        self.errors: list[BaseException] = []
        self.stopped = stopping        # set by the server's shutdown (SIGTERM): its Context's
        self.t0 = time.perf_counter()

    def block_dir(self, b: int) -> Path:
        return self.parts / f"{b:07d}"

    def run(self) -> None:
        self.parts.mkdir(parents=True, exist_ok=True)
        threads = [threading.Thread(target=self._work, name=f"pack-{k}", daemon=True)
                   for k in range(self.cfg.threads(self.n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        for b in sorted(self.elsewhere):      # held by another builder: wait, or build if it died
            self._take(b, wait=True)
        self._join()

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    b, self._next = self._next, self._next + 1
                if b >= self.n or self.errors:
                    return
                if not self._take(b, wait=False):
                    with self._lock:
                        self.elsewhere.append(b)
        except BaseException as e:   # (Stopped, disk full): the build ends with it
            with self._lock:
                self.errors.append(e)

    def _take(self, b: int, *, wait: bool) -> bool:
        """Build block b unless it is there: False when another builder holds it (wait=False)."""
        done = self.block_dir(b)
        while True:
            if self.stopped.is_set():
                raise Stopped()
            if done.is_dir() or (self.where / "stats.json").is_file():
                return True
            with open(self.parts / f"{b:07d}.lock", "a+b") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if not wait:
                        return False
                    self._progress()
                    time.sleep(0.1)
                    continue
                if not done.is_dir():
                    self._write_block(b, done)
                return True

    def _write_block(self, b: int, done: Path) -> None:
        arrays, figures = pack_block(self.source, b, self.seq_len, self.cfg.block_tokens)
        tmp = Path(tempfile.mkdtemp(prefix=f".{b:07d}.", dir=self.parts))
        try:
            for k in ARRAYS:
                np.save(tmp / f"{k}.npy", arrays[k])
            (tmp / "figures.json").write_text(json.dumps({**figures, "check": _check(arrays)}))
            os.rename(tmp, done)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with self._lock:
            self.built_here += 1
        self._progress()

    def _progress(self) -> None:
        try:
            have = sum(1 for e in os.scandir(self.parts) if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:   # joined by another builder
            return
        self.note(f"block {have:,} of {self.n:,} ({self.built_here:,} built here)", have / self.n)

    def _join(self) -> None:
        """The blocks, in order, into the sidecar (written whole, then renamed into place), once:
        whoever holds join.lock first; the others find the sidecar there."""
        if (self.where / "stats.json").is_file():
            clear_leftovers(self.where)   # (a late builder's: made after the join)
            return
        try:
            lock = open(self.parts / "join.lock", "a+b")
        except FileNotFoundError:   # joined and cleared while this one waited
            if (self.where / "stats.json").is_file():
                return
            raise
        with lock:
            while True:
                if self.stopped.is_set():
                    raise Stopped()
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.1)
            if (self.where / "stats.json").is_file():
                return
            for old in self.where.parent.glob(f".{self.where.name}.*"):   # a joiner killed mid-join left it
                shutil.rmtree(old, ignore_errors=True)                      # (13 GB at 10^9 documents)
            self.note(f"joining {self.n:,} blocks", 1.0)
            tmp = Path(tempfile.mkdtemp(prefix=f".{self.where.name}.", dir=self.where.parent))
            try:
                rebuilt: set[int] = set()
                while True:
                    try:
                        stats = self._write_joined(tmp)
                        break
                    except _Torn as e:   # built again here, and the join begun again (once a block:
                        if e.block in rebuilt:   # one that reads back wrong as soon as written is the disk's)
                            raise OSError(f"packing {self.where.name}: block {e.block} does not read back as it "
                                          f"was written ({e.why})") from None
                        rebuilt.add(e.block)   # (counted in feeder_cache_damaged_total, said once: the joiner's)
                        cache.damaged("packing", f"block {e.block} of {self.where.name}", e.why)
                        shutil.rmtree(self.block_dir(e.block), ignore_errors=True)
                        self._write_block(e.block, self.block_dir(e.block))
                self.publish(tmp, self.where, stats)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        shutil.rmtree(self.parts, ignore_errors=True)

    def _figures(self, b: int) -> dict:
        try:
            figures = json.loads((self.block_dir(b) / "figures.json").read_text())
        except (OSError, ValueError) as e:
            raise _Torn(b, f"{type(e).__name__}: {e}") from None
        if not (isinstance(figures, dict) and all(type(figures.get(k)) is int and figures[k] >= 0 for k in _COUNTS)
                and all(type(figures.get(k)) in (int, float) for k in ("read_s", "pack_s"))
                and isinstance(figures.get("check"), list) and len(figures["check"]) == len(ARRAYS)):
            raise _Torn(b, "its figures are not a block's")
        return figures

    def _array(self, b: int, k: str, figures: dict) -> np.ndarray:
        """Block b's array k as written (read, not mapped: mapped pages stay resident), or _Torn:
        a block torn by a host crash or damaged on disk would otherwise be sealed by the
        sidecar's digest."""
        try:
            a = np.load(self.block_dir(b) / f"{k}.npy")
        except UNREADABLE as e:
            raise _Torn(b, f"{type(e).__name__}: {e}") from None
        want = figures["bins"] + 1 if k == "ptr" else figures["pieces"]
        # (the check covers the bytes; the .npy header, which says how to read them, must be pack_block's)
        dtype = array_types(figures["pieces"], self.source.n_tokens)[k]
        if a.dtype != dtype or a.ndim != 1 or len(a) != want \
                or crc(np.ascontiguousarray(a).view(np.uint8).data) != figures["check"][ARRAYS.index(k)]:
            raise _Torn(b, f"its {k} does not match its check")
        return a

    def _copy_part(self, b: int, k: str, fd: int, at: int, figures: dict) -> memoryview | None:
        """Block b's array k copied by the kernel from its file into fd at `at`, then read back
        from there and checked against the block's check: the bytes returned are the sidecar's
        own, what its digest hashes (the join's writes from the process were most of its time:
        2.3 of 3.9 s at 10^8 documents). None where the file system cannot copy or the file is
        not np.save's layout: the caller reads and checks the block and writes what it checked.
        A disk that fills up is the OSError it is, not a torn block."""
        dtype, want = array_types(figures["pieces"], self.source.n_tokens)[k], figures["pieces"]
        n = want * dtype.itemsize
        try:
            f = open(self.block_dir(b) / f"{k}.npy", "rb")
        except OSError as e:
            raise _Torn(b, f"{type(e).__name__}: {e}") from None
        with f:
            try:
                version = np.lib.format.read_magic(f)   # (where its data begins: after the header)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) \
                    else np.lib.format.read_array_header_2_0
                if read_header(f) != ((want,), False, dtype):
                    raise _Torn(b, f"its {k} does not match its check (its header)")
                if f.tell() + n != os.fstat(f.fileno()).st_size or \
                        not cache.copy_range(f.fileno(), f.tell(), fd, at, n):
                    return None
            except (ValueError, EOFError) as e:
                raise _Torn(b, f"{type(e).__name__}: {e}") from None
        got = np.empty(n, np.uint8)
        done = 0
        while done < n:   # (from the page cache the kernel just filled)
            step = os.preadv(fd, [got[done:]], at + done)
            if step == 0:
                raise OSError(errno.EIO, f"the sidecar ends before its part of block {b}")
            done += step
        if crc(got.data) != figures["check"][ARRAYS.index(k)]:
            raise _Torn(b, f"its {k} does not match its check (as copied)")
        return got.data

    def _place(self, b: int, k: str, fd: int, at: int, figures: dict, dtype: np.dtype, shift: int) -> memoryview:
        """Block b's part of array k, checked, into fd at `at` (any thread: without the GIL): the
        bytes as they are in the sidecar. `shift`: the pieces of the blocks before b."""
        try:   # (start, length: the block's bytes are the sidecar's, copied as they are)
            data = None if k == "ptr" else self._copy_part(b, k, fd, at, figures)
            if data is None:
                out = self._array(b, k, figures)
                if k == "ptr":   # a block's bins point at its pieces: shifted by the pieces before it
                    out = out[:-1].astype(dtype)
                    out += dtype.type(shift)
                data = out.view(np.uint8).data
                os.pwrite(fd, data, at)
        except OSError as e:   # (a full disk: which packing, and where)
            raise OSError(e.errno, f"{e.strerror or e}: joining the packing {self.where.name} in "
                                   f"{self.where.parent}") from None
        if len(data):   # (0 bytes would ask sync_file_range for the whole rest of the file)
            cache.write_back(fd, at, len(data))
        return data

    def _write_joined(self, tmp: Path) -> dict:
        figures = [self._figures(b) for b in range(self.n)]
        pieces = [f["pieces"] for f in figures]
        total_pieces, total_bins = sum(pieces), sum(f["bins"] for f in figures)
        dtypes = array_types(total_pieces, self.source.n_tokens)
        sizes = {"ptr": total_bins + 1, "start": total_pieces, "length": total_pieces}
        # Where each block's part of each array goes: after the parts of the blocks before it.
        firsts = {"ptr": np.cumsum([0] + [f["bins"] for f in figures]),
                  "start": np.cumsum([0] + pieces)}
        firsts["length"] = firsts["start"]
        files = {k: open(tmp / f"{k}.npy", "w+b") for k in ARRAYS}
        try:
            heads = {}
            for k, f in files.items():   # (each file at its final size first: the parts land in any order)
                np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtypes[k]),
                                                         "fortran_order": False, "shape": (sizes[k],)})
                heads[k] = f.tell()
                f.truncate(heads[k] + sizes[k] * dtypes[k].itemsize)
                f.flush()

            def copy(k: str, b: int) -> memoryview:
                return self._place(b, k, files[k].fileno(), heads[k] + int(firsts[k][b]) * dtypes[k].itemsize,
                                   figures[b], dtypes[k], int(firsts["start"][b]))

            # The join is what does not divide among cores unless made to: the blocks' parts are read,
            # checked and written by every thread, while this one hashes them in the digest's order
            # (sha256 is sequential: it is the join's only part on one core), a few parts ahead at most.
            h = hashlib.sha256()
            segments = {k: _Segments(dtypes[k].itemsize) for k in ARRAYS}
            parts = [(k, b) for k in ARRAYS for b in range(self.n)]
            ahead = 2 * self.cfg.threads(self.n)
            with ThreadPoolExecutor(self.cfg.threads(self.n), thread_name_prefix="pack-join") as pool:
                pending = deque(pool.submit(copy, *kb) for kb in parts[:ahead])
                for i, (k, b) in enumerate(parts):
                    if self.stopped.is_set():
                        for f in pending:
                            f.cancel()
                        raise Stopped()
                    data = pending.popleft().result()
                    if i + ahead < len(parts):
                        pending.append(pool.submit(copy, *parts[i + ahead]))
                    h.update(data)
                    segments[k].feed(data)
                    if k == "ptr" and b == self.n - 1:   # the bins' end: the pieces' count
                        last = np.array([total_pieces], dtype=dtypes[k])
                        os.pwrite(files[k].fileno(), last.view(np.uint8).data,
                                  heads[k] + total_bins * dtypes[k].itemsize)
                        h.update(last.view(np.uint8).data)
                        segments[k].feed(last.view(np.uint8).data)
                if self.stopped.is_set():   # (the fsyncs wait for what writeback has not done yet)
                    raise Stopped()
                list(pool.map(lambda f: os.fsync(f.fileno()), files.values()))
        finally:
            for f in files.values():
                f.close()
        tokens = self.source.n_tokens
        return {"packer": PACKER, "seq_len": self.seq_len, "fingerprint": self.source.fingerprint,
                "block_tokens": self.cfg.block_tokens, "blocks": self.n,
                "documents": sum(f["documents"] for f in figures), "bins": total_bins,
                "truncated": sum(f["truncated"] for f in figures),
                "padding_fraction": 1 - float(tokens) / (total_bins * (self.seq_len + 1)) if total_bins else 0.0,
                "read_s": sum(f["read_s"] for f in figures), "cpu_pack_s": sum(f["pack_s"] for f in figures),
                # the joiner's own: from its start to the sidecar written (with others' blocks, if any)
                "build_s": time.perf_counter() - self.t0, "workers": self.cfg.threads(self.n),
                "digest": h.hexdigest(), "segment": SEGMENT,
                "segment_checks": {k: segments[k].finish() for k in ARRAYS}}


class _Segments:
    """The crc32c of each SEGMENT elements of an array written in parts of any size."""

    def __init__(self, itemsize: int):
        self.size, self.carry, self.crcs = SEGMENT * itemsize, bytearray(), []

    def feed(self, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        if self.carry:
            take = min(self.size - len(self.carry), len(data))
            self.carry += data[:take]
            data = data[take:]
            if len(self.carry) == self.size:
                self.crcs.append(crc(self.carry))
                self.carry = bytearray()
        while len(data) >= self.size:
            self.crcs.append(crc(data[:self.size]))
            data = data[self.size:]
        self.carry += data

    def finish(self) -> list[int]:
        if self.carry:
            self.crcs.append(crc(self.carry))
            self.carry = bytearray()
        return self.crcs


def _check(arrays: dict) -> list[int]:
    return [crc(np.ascontiguousarray(arrays[k]).view(np.uint8).data) for k in ARRAYS]


def clear_leftovers(where: Path) -> None:
    """The blocks beside a sidecar that is in place: what a joiner killed between publishing the
    sidecar and removing them left (13 GB at 10^9 documents); a builder still at a block finds the
    sidecar and stops."""
    parts = where.parent / f"{where.name}.blocks"
    if parts.is_dir() and (where / "stats.json").is_file():
        shutil.rmtree(parts, ignore_errors=True)


def build(source, seq_len: int, where: Path, cfg: PackingConfig, note, publish,
          stopping: threading.Event) -> dict:
    """Take part in building the sidecar `where` of source's bins at seq_len: blocks on
    cfg.threads() threads, with every other builder of it sharing the directory; returns when
    the sidecar is in place (raises Stopped, within a block, once `stopping` is set: the server
    that asked is shutting down). `note(text, done)` hears the progress; `publish(tmp, where,
    stats)` (feeder.sources.packed, which owns the sidecar's figures and how a cache entry is put
    in place) writes the figures into the directory `tmp` that holds the joined arrays and moves
    it to `where`, whole."""
    t0 = time.perf_counter()
    b = _Build(source, seq_len, where, cfg, note, publish, stopping)
    b.run()
    log.info("packing %s: %d of %d blocks built here in %.1f s", where.name, b.built_here, b.n,
             time.perf_counter() - t0)
    return {"built_here": b.built_here, "build_s": time.perf_counter() - t0, "workers": cfg.threads(b.n)}
