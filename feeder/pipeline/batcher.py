"""Planned runs -> a Block: where their tokens lie (`Plan.locate`; gathered in one pass when
compressed, or taken from runs that carry them), cursors written, payloads compressed. One
Block is what one reply carries; this is the one way a Block is built, whatever the source.

Runs on the prefetch threads; the copies, zstd and (in the wire writer) crc32c release the
GIL. A feeder process serves every rank from one GIL, so the work here is done per block (one
locate per run, a vectorized plan, precomputed cursor heads) rather than per batch or sample.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from feeder.core import context
from feeder.core.cursor import CursorWriter
from feeder.core.layout import Bounds
from feeder.core.planning import PlannedRun
from feeder.core.rows import Rows
from feeder.sources import Plan


@dataclass(frozen=True, slots=True)
class Block:
    """Consecutive batches of one stream, column-wise."""
    epochs: np.ndarray           # int64 [k]
    steps: np.ndarray            # int64 [k]
    counts: np.ndarray           # int64 [k]: samples in each batch
    ids: np.ndarray              # int64 [sum(counts)]
    tokens: np.ndarray | None    # [sum(counts), sample_len] in the source's (narrow) dtype, C-contiguous;
                                 # None while `rows` says where they are
    cursors: list[bytes]         # resume right after each batch
    payloads: list[bytes] | None  # each batch's tokens compressed; None: the raw tokens are the payload
    dtype: str                   # "uint16" | "uint32"
    compression: str             # "none" | "zstd"
    sample_len: int
    samples_in_epoch: int        # the rank's total for the last batch's epoch (for progress)
    raw_bytes: int               # of the tokens
    payload_bytes: int           # on the wire: raw_bytes, or the compressed size
    read_s: float = 0.0          # time spent reading the source for the whole block
    rows: Rows | None = None     # uncompressed from a mapped source: where the tokens lie, for the
                                 # reply writer to copy straight into the reply (one copy, not two)
    sources: np.ndarray | None = None   # int64 [sum(counts)]: a mixture's source of each sample,
    positions: np.ndarray | None = None  # and the epoch position it fills (for the ledger)
    boundaries: Bounds | None = None     # where documents start in each sample (streams with boundaries)
    elastic: np.ndarray | None = None    # int64 [k, 5]: an elastic stream's (parts, part, step samples, base, end) per batch

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def n_tokens(self) -> int:
        return int(self.counts.sum()) * self.sample_len

    def framed(self, copy_s: float = 0.0) -> "Block":
        """This block without its tokens and payloads, once they are in the reply's bytes: a
        queued message then holds its memory once, not twice. `copy_s`: time the reply writer
        spent cutting rows from the source, which counts as reading it (that copy is where
        a memory-mapped file is actually read)."""
        return dataclasses.replace(self, tokens=None, payloads=None, rows=None, boundaries=None,
                                   read_s=self.read_s + copy_s)

    def token_array(self) -> np.ndarray:
        """The tokens as one [sum(counts), sample_len] array (gathered if they are still rows)."""
        if self.tokens is None and self.rows is not None:
            return self.rows.gather(np.dtype(self.dtype))
        return self.tokens

    def bounds(self) -> list[int]:
        """Row offsets of the batches in tokens/ids: batch j is rows [bounds[j], bounds[j + 1])."""
        return [0, *np.cumsum(self.counts).tolist()]


_NAMES: dict[np.dtype, str] = {}   # dtype.name is computed on every access (~14 us)
_CODECS: dict[int, pa.Codec] = {}


def _zstd(level: int) -> pa.Codec:
    codec = _CODECS.get(level)
    if codec is None:
        codec = _CODECS[level] = pa.Codec("zstd", compression_level=level)
    return codec


def _block(rows: Rows, *, ids, counts, epochs, steps, cursors, compression: str, level: int,
           samples_in_epoch: int, read_s: float, dtype: np.dtype, sources: np.ndarray | None = None,
           positions: np.ndarray | None = None, boundaries: Bounds | None = None,
           windows: list[tuple[int, int]] | None = None, elastic: np.ndarray | None = None) -> Block:
    tokens, payloads = None, None
    sample_len = rows.n
    if windows is not None:   # a context-parallel member's windows of each sample (feeder.core.context)
        tokens, rows = context.take(rows.gather(dtype), windows), None
        sample_len = tokens.shape[1]
    raw_bytes = len(ids) * sample_len * dtype.itemsize
    if compression != "none" and tokens is None:   # (uncompressed, the reply writer cuts the rows into the reply)
        tokens, rows = rows.gather(dtype), None
    if compression != "none":
        if compression == "zstd":
            codec, at = _zstd(level), 0
            payloads = []
            for k in counts.tolist():
                payloads.append(codec.compress(tokens[at:at + k], asbytes=True))
                at += k
    return Block(epochs=epochs, steps=steps, counts=counts, ids=ids, tokens=tokens, rows=rows, cursors=cursors,
                 payloads=payloads, dtype=_NAMES.get(dtype) or _NAMES.setdefault(dtype, dtype.name),
                 compression=compression, sample_len=sample_len, samples_in_epoch=samples_in_epoch,
                 raw_bytes=raw_bytes, read_s=read_s,
                 payload_bytes=raw_bytes if payloads is None else sum(map(len, payloads)), sources=sources,
                 positions=positions, boundaries=boundaries, elastic=elastic)


def block_from_runs(plan: Plan, runs: list[PlannedRun], *, seq_len: int, compression: str, level: int,
                    cursors: CursorWriter, windows: list[tuple[int, int]] | None = None) -> Block:
    """Consecutive runs of one stream as a Block: their rows located (or the tokens the plan
    read, for runs that carry them: a plan's runs all do or all do not) in one pass. `windows`:
    a context-parallel member's (offset, length) windows of each sample, the only tokens it gets
    (ids, cursors and boundaries stay the whole sample's)."""
    ids = runs[0].ids if len(runs) == 1 else np.concatenate([r.ids for r in runs])
    sources = positions = None
    if runs[0].sources is not None:   # a mixture: ids are within each sample's source
        sources = runs[0].sources if len(runs) == 1 else np.concatenate([r.sources for r in runs])
        positions = runs[0].positions if len(runs) == 1 else np.concatenate([r.positions for r in runs])
    t0 = time.perf_counter()
    bounds: Bounds | None = None
    if sources is not None:
        rows = plan.locate(ids * seq_len, seq_len + 1, sources)
        if plan.spec.boundaries:
            bounds = plan.boundaries(ids * seq_len, seq_len + 1, sources)
    elif runs[0].tokens is None:
        rows = plan.locate(ids * seq_len, seq_len + 1)
        if plan.spec.boundaries:
            bounds = plan.boundaries(ids * seq_len, seq_len + 1)
    else:
        rows = Rows.of(runs[0].tokens if len(runs) == 1 else np.concatenate([r.tokens for r in runs]))
    read_s = time.perf_counter() - t0
    # The columns as Python lists, one numpy call each at the end: a message may hold several
    # short runs (an epoch ends inside it), and small numpy calls per run cost more than the loop.
    written: list[bytes] = []
    counts: list[int] = []
    epochs: list[int] = []
    steps: list[int] = []
    for r in runs:
        stops = r.stops.tolist()
        if r.cursors is None:
            written += cursors.many(world=r.world, epoch=r.epoch, base=r.base, stops=stops, first_step=r.step)
        else:
            written += [cursors.encode(c) for c in r.cursors]
        counts += [b - a for a, b in zip([r.start, *stops], stops)]
        epochs += [r.epoch] * len(stops)
        # (an elastic run is one global step's part: every batch of it is of that step)
        steps += range(r.step, r.step + len(stops)) if r.elastic is None else [r.step] * len(stops)
    elastic = None
    if runs[0].elastic is not None:
        elastic = runs[0].elastic if len(runs) == 1 else np.concatenate([r.elastic for r in runs])
    return _block(rows, ids=ids, counts=np.array(counts, dtype=np.int64), epochs=np.array(epochs, dtype=np.int64),
                  steps=np.array(steps, dtype=np.int64), cursors=written, compression=compression, level=level,
                  samples_in_epoch=runs[-1].samples_in_epoch, read_s=read_s, dtype=plan.dtype, sources=sources,
                  positions=positions, boundaries=bounds, windows=windows, elastic=elastic)
