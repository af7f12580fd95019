"""Shards on Lustre or any POSIX path: the only module that reads dataset files.

Arrow IPC shards are memory-mapped and served zero-copy from the map; Parquet shards
(Spark's list-of-integers `tokens` column) are decoded one row group at a time into a
small cache, with an EOS added after each row. Every chunk is checked against the
manifest's sha256 the first time it is read, so a corrupt shard is reported by name and
never served, without reading the whole dataset before the first batch.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa

from feeder.sources import NO_CONTEXT, Context, packed_samples
from feeder.sources import manifest as mf
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor, Mixture
from feeder.core.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, Unavailable, WrongReplica
from feeder.core.layout import Bounds, window_bounds
from feeder.core.planning import StreamPlan
from feeder.core.rows import Rows

log = logging.getLogger("feeder.source")

# Chunks whose document starts are kept (int64 each: a 16 M-token chunk of web text holds some
# 20 000 documents, 160 KB; 256 of them ~40 MB at most), the most recently asked.
DOC_STARTS_KEPT = 256


class PosixSource:
    """A prepped dataset directory (a `Source`): every rank's plan is a StreamPlan over it."""

    def __init__(self, root: str | os.PathLike, *, name: str = "", manifest: mf.Manifest | None = None,
                 cache_bytes: int = 256 << 20):
        self.root = Path(root)
        if not self.root.is_dir():
            raise NotFound(f"dataset directory {self.root} does not exist")
        self.manifest = manifest or mf.read(self.root)
        m = self.manifest
        self.name = name or self.root.name
        self.fingerprint = m.fingerprint
        self.n_tokens, self.n_documents = m.n_tokens, m.n_documents
        self.vocab_size, self.eos_id = m.vocab_size, m.eos_id
        self.dtype = np.dtype(m.dtype)
        # Global chunk table: chunk k covers tokens [starts[k], starts[k+1]).
        self._where: list[tuple[int, int]] = []
        starts = [0]
        for si, shard in enumerate(m.shards):
            for ci, chunk in enumerate(shard.chunks):
                self._where.append((si, ci))
                starts.append(starts[-1] + chunk.n_tokens)
        self._starts = starts
        self.chunk_starts = np.asarray(starts, dtype=np.int64)
        self._lock = threading.Lock()
        self._mapped: dict[int, np.ndarray] = {}     # verified Arrow chunks (views of the map)
        self._readers: dict[int, object] = {}
        self._decoded: OrderedDict[int, np.ndarray] = OrderedDict()  # verified Parquet chunks
        self._decoded_bytes, self._cache_bytes = 0, cache_bytes
        self._bad: dict[int, str] = {}               # shard index -> why it cannot be served
        self._doc_starts: OrderedDict[int, np.ndarray] = OrderedDict()   # chunk -> its documents' starts
        for si, shard in enumerate(m.shards):
            path = self.root / shard.path
            size = path.stat().st_size if path.exists() else -1
            if size < 0:
                self._bad[si] = f"shard {shard.path} is missing from {self.root}"
            elif size != shard.bytes:
                self._bad[si] = (f"shard {shard.path} is truncated or altered: {size} bytes on disk, "
                                 f"the manifest says {shard.bytes}")
            if si in self._bad:
                log.error("dataset %s: %s; streams that reach it will fail", self.name, self._bad[si])

    def plan(self, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT) -> StreamPlan:
        """The plan of one rank's stream over this dataset (Source.plan)."""
        if spec.expected_fingerprint and spec.expected_fingerprint != self.fingerprint:
            raise WrongReplica(
                f"dataset fingerprint mismatch: the job expects {spec.expected_fingerprint}, this feeder's "
                f"replica of {self.name!r} has {self.fingerprint}; refusing to serve other data")
        if cursor is not None and cursor.src is not None:
            what = "a mixture's position" if type(cursor.src) is Mixture else \
                f"a Kafka position ({type(cursor.src).__name__})"
            raise FailedPrecondition(f"cursor does not fit this stream: it holds {what}; this stream reads "
                                     f"dataset {self.name!r} from files")
        table = packed_samples(self, spec, ctx)   # (None: concat, this source's own windows)
        if table is not None:
            return StreamPlan(spec, n_tokens=self.n_tokens, n_samples=table.n_samples, fingerprint=table.fingerprint,
                              cursor=cursor, data=table, orders=ctx.orders)
        return StreamPlan(spec, n_tokens=self.n_tokens, fingerprint=self.fingerprint, cursor=cursor, data=self,
                          orders=ctx.orders)

    def close(self) -> None:
        """Nothing to let go of: the maps close with the process."""

    def boundaries(self, starts: np.ndarray, n: int) -> Bounds:
        """The document starts inside rows [starts[i], starts[i] + n) (`locate_bounds`)."""
        return locate_bounds(self, starts, n)

    def doc_starts(self, k: int) -> np.ndarray:
        """int64, sorted: where documents start in the stream inside chunk k. From what the format
        records (our shards' and Hugging Face's rows, Megatron's index, MDS samples), or, for
        files that record none, after each EOS token. Kept for the last chunks asked."""
        got = self._recent(self._doc_starts, k)
        if got is not None:
            return got
        si, ci = self._where[k]
        if si in self._bad:
            raise DataLoss(self._bad[si])
        rel = self._chunk_doc_starts(si, ci)
        size = self._starts[k + 1] - self._starts[k]
        if rel is None:   # by EOS: a document starts after each EOS (and at the stream's start)
            rel = np.flatnonzero(self.chunk(k)[:-1] == self.eos_id) + 1
            first = k == 0
            if not first:   # the chunk's first token starts one if the token before it is an EOS
                before = np.empty(1, dtype=self.dtype)
                self.read(self._starts[k] - 1, before)
                first = int(before[0]) == self.eos_id
            if first:
                rel = np.concatenate(([0], rel))
        rel = np.unique(np.asarray(rel, dtype=np.int64))   # (an empty document starts nothing)
        if len(rel) and (rel[0] < 0 or rel[-1] >= size):
            raise DataLoss(f"shard {self.manifest.shards[si].path}: chunk {ci}'s documents start outside its "
                           f"{size} tokens")
        got = rel + self._starts[k]
        with self._lock:
            self._doc_starts[k] = got
            while len(self._doc_starts) > DOC_STARTS_KEPT:
                self._doc_starts.popitem(last=False)
        return got

    def all_doc_starts(self) -> np.ndarray:
        """Where every document starts (small corpora and tools: O(documents) in memory)."""
        return self.doc_spans(0, self.n_tokens)[0]

    def doc_spans(self, lo: int, hi: int) -> tuple[np.ndarray, int]:
        """(`Documents`) Where the documents that start in tokens [lo, hi) start, and where the
        last of them ends: from the chunks the range touches, each chunk's starts as doc_starts
        finds them (a record batch's offsets, an EOS scan), then the next chunks until a document
        starts at or past hi. A format with a table of its own overrides it (FormatSource)."""
        lo, hi = max(0, lo), min(hi, self.n_tokens)
        if lo >= hi:
            return np.zeros(0, np.int64), lo
        bounds = self.chunk_starts
        first, last = (int(k) for k in np.searchsorted(bounds, [lo, hi - 1], side="right") - 1)
        parts = [self.doc_starts(k) for k in range(first, last + 1)]
        got = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        starts = got[(got >= lo) & (got < hi)]
        after = got[got >= hi]
        k = last + 1
        while not len(after) and k < len(self._where):
            after = self.doc_starts(k)
            k += 1
        return starts, int(after[0]) if len(after) else self.n_tokens

    def read(self, start: int, out: np.ndarray) -> None:
        n = len(out)
        if start < 0 or start + n > self.n_tokens:
            raise outside(start, n, self.n_tokens)
        k = bisect.bisect_right(self._starts, start) - 1
        arr = self._mapped.get(k)
        if arr is not None and start + n <= self._starts[k + 1]:   # the common case: one verified chunk
            off = start - self._starts[k]
            out[:] = arr[off:off + n]
            return
        done = 0
        while done < n:
            arr = self.chunk(k)
            off = start + done - self._starts[k]
            take = min(n - done, len(arr) - off)
            out[done:done + take] = arr[off:off + take]
            done += take
            k += 1

    def locate(self, starts: np.ndarray, n: int) -> Rows:
        """Where rows [starts[i], starts[i] + n) lie, without copying them (`locate_rows`)."""
        return locate_rows(self, starts, n)

    def read_many(self, starts: np.ndarray, n: int) -> np.ndarray:
        """[len(starts), n] tokens, row i from starts[i]: one memcpy per row (no Python call
        per sample)."""
        return self.locate(starts, n).gather(self.dtype)

    def chunk(self, k: int) -> np.ndarray:
        """Chunk k's tokens, verified on first read (DataLoss if the shard cannot be served)."""
        arr = self._mapped.get(k)
        if arr is not None:
            return arr
        arr = self._recent(self._decoded, k)
        if arr is not None:
            return arr
        si, ci = self._where[k]
        if si in self._bad:
            raise DataLoss(self._bad[si])
        shard = self.manifest.shards[si]
        try:
            arr, mapped = self._load(si, ci)
        except (pa.ArrowException, OSError, ValueError) as e:
            self._bad[si] = f"shard {shard.path} cannot be read: {e}"
            raise DataLoss(self._bad[si]) from None
        why = self._check(si, ci, arr)
        if why:
            self._bad[si] = why
            log.error("dataset %s: %s", self.name, why)
            raise DataLoss(why)
        with self._lock:
            if mapped:
                self._mapped[k] = arr
            else:
                self._decoded[k] = arr
                self._decoded_bytes += arr.nbytes
                while self._decoded_bytes > self._cache_bytes and len(self._decoded) > 1:
                    _, old = self._decoded.popitem(last=False)
                    self._decoded_bytes -= old.nbytes
        return arr

    def _recent(self, cache: OrderedDict, k: int) -> np.ndarray | None:
        """Chunk k's entry in a bounded cache (then the most recently used), or None."""
        with self._lock:
            got = cache.get(k)
            if got is not None:
                cache.move_to_end(k)
            return got

    def rescrub(self, k: int) -> tuple[int, str]:
        """Check chunk k again if it was verified and is served from the memory map (what a
        later change on disk would reach unseen): (bytes hashed, why it cannot be served, or "").
        A changed chunk leaves the map and its shard is DATA_LOSS from then on. Decoded chunks
        are copies, checked each time they are read from disk, and are not scrubbed."""
        arr = self._mapped.get(k)
        if arr is None:
            return 0, ""
        si, ci = self._where[k]
        why = self._check(si, ci, arr)
        if why:
            why = f"{why} (found by the background scrub after it had been served)"
            with self._lock:
                self._bad[si] = why
                self._mapped.pop(k, None)
        return arr.nbytes, why

    # The two steps a source of another on-disk format (feeder.sources.formats) replaces:
    # how a chunk is read, and what is checked on its first read.
    def _load(self, si: int, ci: int) -> tuple[np.ndarray, bool]:
        """Chunk ci of shard si, and whether it is a view of a map (kept for good) or decoded
        (kept in the bounded cache)."""
        if self.manifest.shards[si].format == "arrow":
            return self._load_arrow(si, ci), True
        return self._load_parquet(si, ci), False

    def _check(self, si: int, ci: int, arr: np.ndarray) -> str:
        """Why the chunk just read cannot be served ("" when it can)."""
        shard = self.manifest.shards[si]
        want = shard.chunks[ci]
        if len(arr) != want.n_tokens or hashlib.sha256(arr).hexdigest() != want.sha256:
            return f"shard {shard.path} is corrupt: chunk {ci} failed its sha256 check against the manifest"
        return ""

    def _chunk_doc_starts(self, si: int, ci: int) -> np.ndarray | None:
        """Where documents start inside chunk ci of shard si (offsets), or None: after each EOS.
        A row of our shards is a document (its EOS stored, or added after it for Parquet)."""
        shard = self.manifest.shards[si]
        try:
            if shard.format == "arrow":
                off = self._arrow_reader(si).get_batch(ci).column(0).offsets.to_numpy()
                return off[:-1] - off[0]
            import pyarrow.parquet as pq

            col = pq.ParquetFile(str(self.root / shard.path)).read_row_group(ci, columns=[shard.tokens_column]).column(0)
            return rows_doc_starts(col.combine_chunks(), adds_eos=True)
        except (pa.ArrowException, OSError, ValueError) as e:
            self._bad[si] = f"shard {shard.path} cannot be read: {e}"
            raise DataLoss(self._bad[si]) from None

    def _arrow_reader(self, si: int):
        reader = self._readers.get(si)
        if reader is None:
            path = self.root / self.manifest.shards[si].path
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
            self._readers[si] = reader
        return reader

    def _load_arrow(self, si: int, ci: int) -> np.ndarray:
        col = self._arrow_reader(si).get_batch(ci).column(0)
        return col.values.to_numpy(zero_copy_only=True)  # a view of the memory map

    def _load_parquet(self, si: int, ci: int) -> np.ndarray:
        import pyarrow.parquet as pq

        shard = self.manifest.shards[si]
        table = pq.ParquetFile(str(self.root / shard.path)).read_row_group(ci, columns=[shard.tokens_column])
        return with_eos(table.column(0).combine_chunks(), self.eos_id, self.dtype)


def with_eos(lists: pa.Array, eos_id: int, dtype: np.dtype) -> np.ndarray:
    """Flatten a list<int> array into one stream with EOS after every row."""
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)
    out = np.full(len(values) + len(lengths), eos_id, dtype=dtype)
    # Row j's tokens move right by j (one EOS before them per earlier row).
    dest = np.arange(len(values), dtype=np.int64) + np.repeat(np.arange(len(lengths)), lengths)
    out[dest] = values
    return out


def rows_doc_starts(lists: pa.Array, *, adds_eos: bool) -> np.ndarray:
    """Where each row of a list<int> array starts in its chunk's stream (a row is a document;
    with `adds_eos`, one EOS follows each, as with_eos writes them)."""
    off = np.asarray(lists.offsets, dtype=np.int64)
    rel = off[:-1] - off[0]
    return rel + np.arange(len(rel), dtype=np.int64) if adds_eos else rel


def index_parquet(root: str | os.PathLike, *, vocab_size: int, eos_id: int,
                  tokens_column: str = "tokens") -> mf.Manifest:
    """A manifest for a directory of Parquet files with a list-of-integers tokens column
    (what Spark writes), built by reading it once; the data is served as it is."""
    import pyarrow.parquet as pq

    root = Path(root)
    files = sorted(p for p in root.rglob("*.parquet") if p.is_file())
    if not files:
        raise NotFound(f"{root} has neither {mf.NAME} nor Parquet files")
    if vocab_size <= 0 or not 0 <= eos_id < vocab_size:
        raise InvalidArgument(f"a Parquet token dataset needs --vocab-size > 0 and 0 <= --eos-id < vocab size, "
                              f"got vocab_size={vocab_size}, eos_id={eos_id}")
    dtype = np.dtype(mf.dtype_for_vocab(vocab_size))
    shards = []
    for path in files:
        pf = pq.ParquetFile(str(path))
        if tokens_column not in pf.schema_arrow.names:
            raise InvalidArgument(f"{path}: no {tokens_column!r} column (columns: {pf.schema_arrow.names})")
        chunks = []
        for rg in range(pf.num_row_groups):
            lists = pf.read_row_group(rg, columns=[tokens_column]).column(0).combine_chunks()
            if not pa.types.is_list(lists.type) and not pa.types.is_large_list(lists.type):
                raise InvalidArgument(f"{path}: column {tokens_column!r} is {lists.type}, expected a list of integers")
            vals = lists.values.to_numpy(zero_copy_only=False)
            if vals.size and (vals.min() < 0 or vals.max() >= vocab_size):
                raise InvalidArgument(f"{path}: row group {rg}: token ids must be in [0, {vocab_size}), "
                                      f"got [{vals.min()}, {vals.max()}]")
            arr = with_eos(lists, eos_id, dtype)
            chunks.append(mf.Chunk(n_documents=len(lists), n_tokens=len(arr),
                                   sha256=hashlib.sha256(arr).hexdigest()))
        shards.append(mf.Shard(path=path.relative_to(root).as_posix(), format="parquet",
                               n_documents=sum(c.n_documents for c in chunks),
                               n_tokens=sum(c.n_tokens for c in chunks), bytes=path.stat().st_size,
                               sha256=mf.file_sha256(path), chunks=tuple(chunks), tokens_column=tokens_column))
    m = mf.Manifest(tokenizer={"kind": "external", "vocab_size": vocab_size, "eos_id": eos_id},
                    vocab_size=vocab_size, eos_id=eos_id, dtype=dtype.name, shards=tuple(shards))
    return m.with_fingerprint()


def outside(start: int, n: int, n_tokens: int) -> Unavailable:
    """Rows past the data are never the caller's mistake (its ids come from this feeder's plan):
    an order, index or packing here is wrong (issue 34: a damaged order's id ≥ n was
    INVALID_ARGUMENT, and the rank gave up). Failover-class: another feeder may serve it."""
    return Unavailable(f"tokens [{start}, {start + n}) are outside the dataset's {n_tokens}: this feeder's "
                       "sample table is wrong; resume on another feeder", elsewhere=True)


def locate_rows(table, starts: np.ndarray, n: int) -> Rows:
    """Where rows [starts[i], starts[i] + n) of a chunk table lie, without copying them: row i
    is bufs[which[i]][offs[i]:offs[i] + n]. The buffers are the table's verified chunks (views
    of the memory map, or decoded Parquet), plus one array holding the rare rows that cross a
    chunk boundary, read here. A table is a PosixSource, or the sources of a mixture joined end
    to end (feeder.sources.mixture.Joined): `chunk_starts` (chunk k covers tokens
    [chunk_starts[k], chunk_starts[k + 1])), `chunk(k)`, `read(start, out)`, `n_tokens` and `dtype`."""
    starts = np.asarray(starts, dtype=np.int64)
    if len(starts) and (starts.min() < 0 or starts.max() + n > table.n_tokens):
        bad = int(starts[(starts < 0) | (starts + n > table.n_tokens)][0])
        raise outside(bad, n, table.n_tokens)
    bounds = table.chunk_starts
    ks = np.searchsorted(bounds, starts, side="right") - 1
    chunks, which = np.unique(ks, return_inverse=True)   # a run touches few chunks; each loaded once
    bufs = [table.chunk(k) for k in chunks.tolist()]
    offs = starts - bounds[ks]
    across = np.flatnonzero(starts + n > bounds[ks + 1])
    if len(across):
        extra = np.empty((len(across), n), dtype=table.dtype)
        for j, i in enumerate(across.tolist()):
            table.read(int(starts[i]), extra[j])
        which[across], offs[across] = len(bufs), np.arange(len(across), dtype=np.int64) * n
        bufs.append(extra.reshape(-1))
    return Rows(bufs, which.astype(np.int64, copy=False), offs, n)


def locate_bounds(table, starts: np.ndarray, n: int) -> Bounds:
    """The document starts inside rows [starts[i], starts[i] + n) of a chunk table (as
    locate_rows: a PosixSource or a mixture's sources joined), from its chunks' `doc_starts(k)`:
    those of every chunk a row touches, joined in stream order, then searched once."""
    starts = np.asarray(starts, dtype=np.int64)
    bounds = table.chunk_starts
    first = np.searchsorted(bounds, starts, side="right") - 1
    last = np.searchsorted(bounds, starts + n - 1, side="right") - 1
    chunks = set(np.unique(np.concatenate((first, last))).tolist())
    for a, b in zip(first[last - first > 1].tolist(), last[last - first > 1].tolist()):   # rows over 3+ chunks
        chunks.update(range(a + 1, b))
    parts = [table.doc_starts(k) for k in sorted(chunks)]
    return window_bounds(np.concatenate(parts) if parts else np.zeros(0, np.int64), starts, n)
