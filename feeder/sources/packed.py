"""A source's samples as best-fit bins (`packing="best_fit"`): the sidecar, built once, and the
table a StreamPlan reads bins from.

The packing (feeder.layout.best_fit over each block of documents: feeder.sources.pack_blocks,
which builds it on every core and with every feeder sharing the directory) is a pure function
of the source's documents, seq_len and the block size, so it is built once per (source
fingerprint, seq_len) and kept in the cache directory as three
narrow arrays (`.npy`, memory-mapped: bin pointers, piece starts, piece lengths) and a JSON of
its figures; every process and every feeder that shares the directory maps the one copy, and a
feeder elsewhere builds the same bytes. Its identity (source fingerprint, seq_len, packer, block
size) is
the fingerprint of every packed stream's cursors, so a cursor of `concat` samples, of another
seq_len or of another packer never resumes a packed stream.

Sample i is bin i: a plan addresses it as it addresses concat windows (row start i·seq_len),
so the sampler's dealing, cursors, resume, reshard and workers are one code path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import numpy as np

from feeder.core import packing
from feeder.core.errors import FailedPrecondition, Unavailable
from feeder.core.layout import PACKED_PREFIX, PACKER, Bounds, Packing, ranges
from feeder.core.config import PackingConfig
from feeder.sources import cache, pack_blocks, preparing
from feeder.core.rows import Rows

try:
    from feeder._native import pieces as _pieces   # a bin's documents, one memcpy each, without the GIL
except ImportError:  # no C compiler at install
    _pieces = None
from feeder.sources.pack_blocks import crc as _crc   # (the builder's: the checks were written with it)

log = logging.getLogger("feeder.packing")

_lock = threading.Lock()          # _tables and _building only: never held across a build
_tables: dict[tuple[str, int, int], "PackedTable"] = {}
_building: dict[tuple[str, int, int], threading.Lock] = {}   # one build per (source, seq_len) at a time
# Why the cache directory could not hold a packing ("": it could), for `feeder status`; and the
# process's own directory the packings are built in instead (made on first need).
problem = ""


def directory(cache_dir: str = "") -> Path:
    """Where sidecars are kept: `<cache_dir>/packing` (the server's cache directory, from its
    feeder.sources.Context), else the user's cache."""
    d = Path(os.path.join(cache_dir, "packing") if cache_dir else
             os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "feeder", "packing"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def identity(fingerprint: str, seq_len: int, block_tokens: int) -> str:
    """The fingerprint of a packed stream: the data's, the bin size and the packer's rule (its
    block size among it: blocks are packed apart)."""
    return PACKED_PREFIX + hashlib.sha256(
        f"{fingerprint}\0{seq_len}\0{PACKER}\0{block_tokens}".encode()).hexdigest()[:40]


class PackedTable:
    """Bins of a source (a chunk table: `read`, `doc_starts`, `dtype`, `eos_id`) at seq_len;
    what a StreamPlan reads its samples from (`locate`, `boundaries`, `dtype`)."""

    def __init__(self, source, seq_len: int, packing: Packing, stats: dict, first_use: "_FirstUse | None" = None):
        self.source, self.seq_len, self.packing, self.stats = source, seq_len, packing, stats
        self.first_use = first_use   # the arrays' segments, checked as bins first read them
        self.dtype, self.eos_id = source.dtype, source.eos_id
        self.n_samples = packing.n_bins
        self.n_tokens = source.n_tokens
        # The cursors' fingerprint: the sidecar's name and the bins' own digest, so two feeders
        # whose bins differ (a flat file rewritten in place keeps its fingerprint) refuse each
        # other's cursors instead of resuming another packing.
        self.fingerprint = PACKED_PREFIX + hashlib.sha256(
            f"{identity(source.fingerprint, seq_len, stats['block_tokens'])}\0{stats['digest']}".encode()
        ).hexdigest()[:40]

    def _bins(self, starts: np.ndarray, n: int) -> np.ndarray:
        if n != self.seq_len + 1:
            raise ValueError(f"a packed table of seq_len {self.seq_len} is read in samples of {self.seq_len + 1}")
        bins = np.asarray(starts, dtype=np.int64) // self.seq_len
        if self.first_use is not None:   # (every read of the arrays passes here)
            self.first_use.verify(self, bins)
        return bins

    def locate(self, starts: np.ndarray, n: int) -> Rows:
        """The bins whose rows a plan addresses as [i·seq_len, i·seq_len + n): their documents
        copied in, the rest padding (EOS, which the boundaries mark as padding)."""
        bins = self._bins(starts, n)
        counts, at, length, offset = self.packing.pieces(bins)
        out = np.full((len(bins), n), self.eos_id, dtype=self.dtype)
        dest = np.repeat(np.arange(len(bins), dtype=np.int64) * n, counts) + offset
        flat = out.reshape(-1)
        bounds = self.source.chunk_starts
        ks = np.searchsorted(bounds, at, side="right") - 1
        inside = at + length <= bounds[ks + 1]
        if _pieces is not None and inside.any():   # each piece from its verified chunk, one memcpy
            chunks, which = np.unique(ks[inside], return_inverse=True)
            bufs = [self.source.chunk(k) for k in chunks.tolist()]
            _pieces(bufs, which.astype(np.int64), at[inside] - bounds[ks[inside]], length[inside], dest[inside], flat)
            rest = np.flatnonzero(~inside)          # the few across two chunks
        else:
            rest = np.arange(len(at))
        for i in rest.tolist():
            self.source.read(int(at[i]), flat[dest[i]:dest[i] + length[i]])
        return Rows.of(out)

    def boundaries(self, starts: np.ndarray, n: int) -> Bounds:
        return self.packing.bounds(self._bins(starts, n))


def packed(source, seq_len: int, ctx) -> PackedTable:
    """The best-fit bins of `source` (feeder.sources.Documents) at seq_len: mapped from the
    sidecar in the server's cache directory (`ctx`: a feeder.sources.Context), built first if
    there is none (once per process; the build is noted for waiting ranks and `feeder status`)."""
    cfg = ctx.packing
    key = (source.fingerprint, seq_len, cfg.block_tokens)   # (the block size: tests change it)
    with _lock:
        got = _tables.get(key)
        if got is not None and got.source is source:
            return got
        building = _building.setdefault(key, threading.Lock())
    # (a build takes seconds to minutes: other datasets' streams and `feeder status` go on)
    with building:
        with _lock:
            got = _tables.get(key)
            if got is not None and got.source is source:
                return got
        try:
            where = directory(ctx.cache_dir) / identity(source.fingerprint, seq_len, cfg.block_tokens)
        except OSError as e:   # (the directory cannot even be made)
            where = _instead(ctx.cache_dir, e) / identity(source.fingerprint, seq_len, cfg.block_tokens)
        # Processes sharing the cache may find a damaged sidecar together: each removes only the
        # one it checked (cache.remove_damaged), and one that finds the sidecar gone again (another
        # removed its copy) builds or reads again, a few times.
        for _ in range(3):
            # (a sidecar is published whole: one there without its figures, or a file in its
            # place, is damage, removed by _load, not a build under way)
            loaded = _load(where, source, seq_len, cfg) if where.exists() or where.is_symlink() else None
            if loaded is None:
                try:
                    build(source, seq_len, where, ctx)
                except OSError as e:   # read-only, full, not this user's: built where this process can
                    if where.parent == cache.own_directory("packing"):
                        raise
                    where = _instead(ctx.cache_dir, e) / where.name
                    build(source, seq_len, where, ctx)
                loaded = _load(where, source, seq_len, cfg)
            if loaded is not None:
                break
        else:
            raise Unavailable(f"the packing of {getattr(source, 'name', '?')} at seq_len {seq_len} in {where} does "
                              "not read back as it was written (see the feeder's log)", elsewhere=True)
        pack_blocks.clear_leftovers(where)
        if loaded[0]["bins"] == 0:
            raise FailedPrecondition(f"dataset {getattr(source, 'name', '?')} has no tokens to pack")
        stats, arrays, first_use = loaded
        table = PackedTable(source, seq_len, Packing(capacity=seq_len + 1, **arrays), stats, first_use)
        with _lock:
            _tables[key] = table
        return table


_ARRAYS = pack_blocks.ARRAYS


def _instead(cache_dir: str, e: OSError) -> Path:
    """The cache directory cannot hold a packing (issue 44.2: a full disk failed every stream with
    UNKNOWN until the rank gave up): this process builds its packings in a directory of its own
    (in memory, /dev/shm, where there is one), with a warning and `feeder status` saying what to
    fix. The data is sound, so the rank is served; only the sharing is lost."""
    global problem
    elsewhere = cache.own_directory("packing")
    where = os.path.join(cache_dir, "packing") if cache_dir else "the user cache"
    problem = cache.cannot_keep("packings", where, e, f"packs in {elsewhere}", problem)
    return elsewhere


def _digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in _ARRAYS:
        a = arrays[k]
        if isinstance(a, np.memmap):   # read from the file, not through the map: mapped pages would
            _hash_file(h, a)           # stay in the feeder's resident memory (1.3 GB at 10^8 documents)
        else:
            h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def _hash_file(h, a: np.memmap) -> None:
    buf = bytearray(8 << 20)
    left = a.nbytes
    with open(a.filename, "rb", buffering=0) as f:
        f.seek(a.offset)
        while left:
            got = f.readinto(memoryview(buf)[:min(left, len(buf))])
            if not got:
                raise ValueError(f"{a.filename} ends {left} bytes early")
            h.update(memoryview(buf)[:got])
            left -= got


def _figures_digest(stats: dict) -> str:
    """The sha256 of a sidecar's figures (all of stats.json but this digest): a flipped byte in
    the figures status shows is found as one in the arrays is."""
    return hashlib.sha256(json.dumps({k: v for k, v in stats.items() if k != "figures_sha256"},
                                     sort_keys=True).encode()).hexdigest()


def _load(where: Path, source, seq_len: int, cfg: PackingConfig) -> tuple[dict, dict, "_FirstUse | None"] | None:
    """The sidecar's figures and arrays, checked against what it must be (its figures' digest,
    the source, seq_len, the packer, sizes that agree), and the check of the arrays' segments on
    their first use (or, for a sidecar written before segments had checks, the arrays' digest
    now, whole); None, with the sidecar removed, when it is not (damaged, truncated, another
    seq_len's copied in): it is then built again."""
    seen = cache.identity(where)   # (before it is read: only this one is removed if it fails)
    try:
        stats = json.loads((where / "stats.json").read_text())
        arrays = {k: np.load(where / f"{k}.npy", mmap_mode="r") for k in _ARRAYS}
        n_bins, n_pieces = int(stats["bins"]), len(arrays["start"])
        checks = stats.get("segment_checks")
        types = pack_blocks.array_types(n_pieces, source.n_tokens)   # (the checks cover bytes, not headers)
        wrong = [what for what, bad in (
            ("figures", stats.get("figures_sha256") != _figures_digest(stats)),
            ("array types", any(arrays[k].dtype != types[k] or arrays[k].ndim != 1 for k in _ARRAYS)),
            ("seq_len", stats.get("seq_len") != seq_len), ("packer", stats.get("packer") != PACKER),
            ("block size", stats.get("block_tokens") != cfg.block_tokens),
            ("source fingerprint", stats.get("fingerprint") != source.fingerprint),
            ("bin pointers", len(arrays["ptr"]) != n_bins + 1 or int(arrays["ptr"][-1]) != n_pieces),
            ("piece lengths", len(arrays["length"]) != n_pieces),
            ("segment checks", checks is not None and not _FirstUse.fits(checks, stats.get("segment"), arrays)),
            ("digest", checks is None and stats.get("digest") != _digest(arrays))) if bad]
        if not wrong:
            first_use = None
            if checks is not None:
                stats = {k: v for k, v in stats.items() if k != "segment_checks"}
                first_use = _FirstUse(where, seen, int(stats["segment"]), checks, arrays)
            return stats, arrays, first_use
        why = "its " + ", ".join(wrong) + " do not match"
    except (*pack_blocks.UNREADABLE, KeyError, TypeError) as e:
        why = f"{type(e).__name__}: {e}"
    cache.remove_damaged(where, seen, "packing", f"sidecar {where}", why)
    return None


class _FirstUse:
    """The check of a sidecar's arrays, a segment (pack_blocks.SEGMENT elements) at a time, the
    first time a bin reads it: the bin pointers' segments first, then those of the pieces they
    point at. Every read of the arrays goes through PackedTable._bins, so nothing of a segment is
    served before its crc32c matches what the builder wrote (~10 GB/s: a first batch checks a few
    MB at any size). A segment that does not match: the sidecar is removed (counted, logged once),
    the table forgotten, and the stream ends UNAVAILABLE; the rank resumes on a plan that builds
    the packing again, or elsewhere meanwhile."""

    def __init__(self, where: Path, seen, segment: int, checks: dict, arrays: dict):
        self.where, self.seen, self.segment, self.arrays = where, seen, segment, arrays
        self.checks = {k: np.asarray(checks[k], dtype=np.int64) for k in _ARRAYS}
        self.ok = {k: np.zeros(len(self.checks[k]), dtype=bool) for k in _ARRAYS}
        self.damage = ""

    @staticmethod
    def fits(checks, segment, arrays: dict) -> bool:
        return isinstance(segment, int) and segment > 0 and isinstance(checks, dict) and all(
            isinstance(checks.get(k), list) and len(checks[k]) == -(-len(arrays[k]) // segment) for k in _ARRAYS)

    def verify(self, table: "PackedTable", bins: np.ndarray) -> None:
        if self.damage:
            self._refuse(table)
        if not len(bins):
            return
        e = self.segment
        self._check(table, "ptr", np.unique(np.concatenate([bins // e, (bins + 1) // e])))
        ptr = self.arrays["ptr"]
        lo, hi = ptr[bins].astype(np.int64), ptr[bins + 1].astype(np.int64)
        if (hi <= lo).any() or int(hi.max()) > len(self.arrays["start"]):   # (checked, yet not bins: a build's bug)
            self.damage = "its bin pointers do not point at pieces"
            self._refuse(table)
        first, last = lo // e, (hi - 1) // e
        segments = np.unique(ranges(first, last - first + 1))   # (every segment a bin's pieces lie in)
        self._check(table, "start", segments)
        self._check(table, "length", segments)

    def _check(self, table: "PackedTable", k: str, segments: np.ndarray) -> None:
        ok, e, a = self.ok[k], self.segment, self.arrays[k]
        for s in segments[~ok[segments]].tolist():
            if _crc(np.ascontiguousarray(a[s * e:(s + 1) * e]).view(np.uint8).data) != self.checks[k][s]:
                self.damage = f"its {k} array's segment {s} does not match its check"
                self._refuse(table)
            ok[s] = True

    def _refuse(self, table: "PackedTable"):
        cache.remove_damaged(self.where, self.seen, "packing", f"sidecar {self.where}", self.damage)
        with _lock:
            for key, t in list(_tables.items()):
                if t is table:
                    del _tables[key]
        raise Unavailable(f"the packing of {getattr(table.source, 'name', '?')} at seq_len {table.seq_len} was found "
                          f"damaged before it was served ({self.damage}): it is built again; resume")


def build(source, seq_len: int, where: Path, ctx) -> dict:
    """Build the sidecar with every other builder sharing the directory (feeder.sources.pack_blocks:
    blocks on every core, one builder per block), noting the progress for waiting ranks,
    `feeder status` and the metrics."""
    name = f"packing {getattr(source, 'name', '?')} for seq_len {seq_len}"
    preparing.note(name, f"{name}: starting", 0.0)
    try:
        ran = pack_blocks.build(source, seq_len, where, ctx.packing,
                                lambda what, done: preparing.note(name, f"{name}: {what}", done), _publish,
                                ctx.stopping)
    except pack_blocks.Stopped:
        raise Unavailable(f"the feeder is stopping: {name} was stopped (resume elsewhere)") from None
    finally:
        preparing.finished(name)
    stats = json.loads((where / "stats.json").read_text())
    log.info("packed %s (%d of its blocks here)", describe({"dataset": getattr(source, "name", "?"), **stats}),
             ran["built_here"])
    return stats


def _publish(tmp: Path, where: Path, stats: dict) -> None:
    """The joined arrays in `tmp` (fsynced) and their figures become the sidecar `where`: the
    figures written, the directory fsynced, renamed into place, its parent fsynced (a host crash
    leaves it whole or absent)."""
    stats["figures_sha256"] = _figures_digest(stats)   # (checked at load with the arrays' digest)
    (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
    cache.publish(tmp, where)   # the files, the rename and the directory, fsynced


def describe(stats: dict) -> str:
    """One line of a packing's figures (`feeder status`, the log)."""
    cpu_s = stats["read_s"] + stats["cpu_pack_s"]
    return (f"{stats.get('dataset', '?')} seq_len {stats['seq_len']}: {stats['documents']:,} documents in "
            f"{stats['bins']:,} bins, {100 * stats['padding_fraction']:.2f}% padding, {stats['truncated']:,} "
            f"truncated (longer than a bin), {stats['blocks']:,} blocks packed in {cpu_s:.2f} s of one core "
            f"({cpu_s / max(stats['documents'], 1) * 1e6:.2f} s per 10^6 documents)"
            + f", built in {stats['build_s']:.2f} s on {stats['workers']} threads")


def built() -> list[dict]:
    """The figures of the packings this process serves (for `feeder status`)."""
    with _lock:
        return [{"dataset": getattr(t.source, "name", ""), **t.stats} for t in _tables.values()]


# The kind a stream names (packing="best_fit"); its prefix begins every packed stream's fingerprint.
packing.register(packing.PackingKind("best_fit", PACKED_PREFIX, wrap=packed))
