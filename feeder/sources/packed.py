"""A source's samples as best-fit bins (`packing="best_fit"`): the sidecar, built once, and the
table a StreamPlan reads bins from.

The packing (feeder.layout.best_fit) is a pure function of the source's documents and seq_len,
so it is built once per (source fingerprint, seq_len) and kept in the cache directory as three
narrow arrays (`.npy`, memory-mapped: bin pointers, piece starts, piece lengths) and a JSON of
its figures; every process and every feeder that shares the directory maps the one copy, and a
feeder elsewhere builds the same bytes. Its identity (source fingerprint, seq_len, packer) is
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
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from feeder.sources import cache, preparing
from feeder.core.errors import FailedPrecondition, Unavailable
from feeder.core.layout import PACKED_PREFIX, PACKER, Bounds, Packing, best_fit
from feeder.core.rows import Rows

try:
    from feeder._native import pieces as _pieces   # a bin's documents, one memcpy each, without the GIL
except ImportError:  # no C compiler at install
    _pieces = None

log = logging.getLogger("feeder.packing")

_directory: str = ""
_lock = threading.Lock()          # _tables and _building only: never held across a build
_tables: dict[tuple[str, int], "PackedTable"] = {}
_building: dict[tuple[str, int], threading.Lock] = {}   # one build per (source, seq_len) at a time


def use_directory(cache_dir: str) -> None:
    """Where sidecars are kept: `<cache>/packing` (a server sets its cache directory)."""
    global _directory
    _directory = os.path.join(cache_dir, "packing") if cache_dir else ""


def directory() -> Path:
    d = Path(_directory or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                        "feeder", "packing"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def identity(fingerprint: str, seq_len: int) -> str:
    """The fingerprint of a packed stream: the data's, the bin size and the packer's rule."""
    return PACKED_PREFIX + hashlib.sha256(f"{fingerprint}\0{seq_len}\0{PACKER}".encode()).hexdigest()[:40]


class PackedTable:
    """Bins of a source (a chunk table: `read`, `doc_starts`, `dtype`, `eos_id`) at seq_len;
    what a StreamPlan reads its samples from (`locate`, `boundaries`, `dtype`)."""

    def __init__(self, source, seq_len: int, packing: Packing, stats: dict):
        self.source, self.seq_len, self.packing, self.stats = source, seq_len, packing, stats
        self.dtype, self.eos_id = source.dtype, source.eos_id
        self.n_samples = packing.n_bins
        self.n_tokens = source.n_tokens
        # The cursors' fingerprint: the sidecar's name and the bins' own digest, so two feeders
        # whose bins differ (a flat file rewritten in place keeps its fingerprint) refuse each
        # other's cursors instead of resuming another packing.
        self.fingerprint = PACKED_PREFIX + hashlib.sha256(
            f"{identity(source.fingerprint, seq_len)}\0{stats['digest']}".encode()).hexdigest()[:40]

    def _bins(self, starts: np.ndarray, n: int) -> np.ndarray:
        if n != self.seq_len + 1:
            raise ValueError(f"a packed table of seq_len {self.seq_len} is read in samples of {self.seq_len + 1}")
        return np.asarray(starts, dtype=np.int64) // self.seq_len

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


def packed(source, seq_len: int) -> PackedTable:
    """The best-fit bins of `source` at seq_len: mapped from the sidecar, built first if there
    is none (once per process; the build is noted for waiting ranks and `feeder status`)."""
    key = (source.fingerprint, seq_len)
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
        where = directory() / identity(source.fingerprint, seq_len)
        # Processes sharing the cache may find a damaged sidecar together: each removes only the
        # one it checked (cache.remove_damaged), and one that finds the sidecar gone again (another
        # removed its copy) builds or reads again, a few times.
        for _ in range(3):
            loaded = _load(where, source, seq_len) if (where / "stats.json").is_file() else None
            if loaded is None:
                build(source, seq_len, where)
                loaded = _load(where, source, seq_len)
            if loaded is not None:
                break
        else:
            raise Unavailable(f"the packing of {getattr(source, 'name', '?')} at seq_len {seq_len} in {where} does "
                              "not read back as it was written (see the feeder's log)", elsewhere=True)
        table = PackedTable(source, seq_len, Packing(capacity=seq_len + 1, **loaded[1]), loaded[0])
        with _lock:
            _tables[key] = table
        return table


_ARRAYS = ("ptr", "start", "length")


def _digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in _ARRAYS:
        h.update(np.ascontiguousarray(arrays[k]).view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def _figures_digest(stats: dict) -> str:
    """The sha256 of a sidecar's figures (all of stats.json but this digest): a flipped byte in
    the figures status shows is found as one in the arrays is."""
    return hashlib.sha256(json.dumps({k: v for k, v in stats.items() if k != "figures_sha256"},
                                     sort_keys=True).encode()).hexdigest()


def _load(where: Path, source, seq_len: int) -> tuple[dict, dict] | None:
    """The sidecar's figures and arrays, checked against what it must be (its own digest, the
    source, seq_len, the packer, sizes that agree); None, with the sidecar removed, when it is
    not (damaged, truncated, another seq_len's copied in): it is then built again."""
    seen = cache.identity(where)   # (before it is read: only this one is removed if it fails)
    try:
        stats = json.loads((where / "stats.json").read_text())
        arrays = {k: np.load(where / f"{k}.npy", mmap_mode="r") for k in _ARRAYS}
        n_bins, n_pieces = int(stats["bins"]), len(arrays["start"])
        wrong = [what for what, bad in (
            ("seq_len", stats.get("seq_len") != seq_len), ("packer", stats.get("packer") != PACKER),
            ("source fingerprint", stats.get("fingerprint") != source.fingerprint),
            ("bin pointers", len(arrays["ptr"]) != n_bins + 1 or int(arrays["ptr"][-1]) != n_pieces),
            ("piece lengths", len(arrays["length"]) != n_pieces),
            ("digest", stats.get("digest") != _digest(arrays)),
            ("figures", stats.get("figures_sha256") != _figures_digest(stats))) if bad]
        if not wrong:
            return stats, arrays
        why = "its " + ", ".join(wrong) + " do not match"
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"{type(e).__name__}: {e}"
    cache.remove_damaged(where, seen, "packing", f"sidecar {where}", why)
    return None


def build(source, seq_len: int, where: Path) -> dict:
    """Pack the source's documents and write the sidecar (complete, then renamed into place)."""
    note = f"packing {getattr(source, 'name', '?')} for seq_len {seq_len}"
    preparing.note(note, f"{note}: reading where {source.n_documents or 'its'} documents start")
    try:
        t0 = time.perf_counter()
        starts = source.all_doc_starts()
        preparing.note(note, f"{note}: best-fit decreasing over {len(starts):,} documents")
        t1 = time.perf_counter()
        packing = best_fit(starts, source.n_tokens, seq_len + 1)
        pack_s = time.perf_counter() - t1
        if packing.n_bins == 0:
            raise FailedPrecondition(f"dataset {getattr(source, 'name', '?')} has no tokens to pack")
        lengths = np.diff(np.append(starts, source.n_tokens))
        stats = {"packer": PACKER, "seq_len": seq_len, "fingerprint": source.fingerprint,
                 "documents": int(len(starts)), "bins": int(packing.n_bins),
                 "truncated": int(np.count_nonzero(lengths > seq_len + 1)),
                 "padding_fraction": 1 - float(source.n_tokens) / (packing.n_bins * (seq_len + 1)),
                 "read_s": t1 - t0, "pack_s": pack_s,
                 "pack_s_per_million": pack_s / max(len(starts), 1) * 1e6,
                 "digest": _digest({k: getattr(packing, k) for k in _ARRAYS})}
        stats["figures_sha256"] = _figures_digest(stats)
        tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=where.parent))
        for k in ("ptr", "start", "length"):
            np.save(tmp / f"{k}.npy", getattr(packing, k))
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
        try:
            cache.publish(tmp, where)   # (fsynced, renamed, its directory fsynced)
        except OSError:   # another process got there first: its bins are the same
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        log.info("packed %s", describe({"dataset": getattr(source, "name", "?"), **stats}))
        return stats
    finally:
        preparing.finished(note)


def describe(stats: dict) -> str:
    """One line of a packing's figures (`feeder status`, the log)."""
    return (f"{stats.get('dataset', '?')} seq_len {stats['seq_len']}: {stats['documents']:,} documents in "
            f"{stats['bins']:,} bins, {100 * stats['padding_fraction']:.2f}% padding, {stats['truncated']:,} "
            f"truncated (longer than a bin), packed in {stats['pack_s']:.2f} s "
            f"({stats['pack_s_per_million']:.2f} s per 10^6 documents)")


def built() -> list[dict]:
    """The figures of the packings this process serves (for `feeder status`)."""
    with _lock:
        return [{"dataset": getattr(t.source, "name", ""), **t.stats} for t in _tables.values()]
