"""Planned batch -> encoded batch: gather samples from the source, narrow, checksum, compress.

Runs on the prefetch threads; numpy copies, crc32c and zstd all release the GIL.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import google_crc32c
import numpy as np
import pyarrow as pa

from feeder.pipeline.plan import PlannedBatch
from feeder.sources import TokenSource


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    epoch: int
    step: int
    n: int
    sample_len: int
    dtype: str             # "uint16" | "uint32"
    compression: str       # "none" | "zstd"
    tokens: bytes
    sample_ids: bytes      # little-endian int64
    cursor: bytes
    raw_size: int
    crc32c: int
    read_s: float = 0.0    # time spent reading the source

    @property
    def wire_bytes(self) -> int:
        return len(self.tokens) + len(self.sample_ids) + len(self.cursor) + 32


def gather(source: TokenSource, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """[k, seq_len + 1] tokens in the source's (narrow) dtype; sample i starts at i * seq_len."""
    out = np.empty((len(ids), seq_len + 1), dtype=source.dtype)
    for row, sample in zip(out, ids.tolist()):
        source.read(sample * seq_len, row)
    return out


def gather_run(source: TokenSource, run: list[PlannedBatch], seq_len: int) -> list[PlannedBatch]:
    """The run's batches with their tokens read in one pass over the source (sources with
    read_many), each charged its share of the read time."""
    if not hasattr(source, "read_many") or len(run) < 2:
        return run
    t0 = time.perf_counter()
    rows = source.read_many(np.concatenate([p.ids for p in run]) * seq_len, seq_len + 1)
    share = (time.perf_counter() - t0) / len(run)
    out, at = [], 0
    for p in run:
        k = len(p.ids)
        out.append(dataclasses.replace(p, tokens=rows[at:at + k], read_s=share))
        at += k
    return out


_NAMES: dict[np.dtype, str] = {}   # dtype.name is computed on every access (~14 us)
_CODECS: dict[int, pa.Codec] = {}


def _zstd(level: int) -> pa.Codec:
    codec = _CODECS.get(level)
    if codec is None:
        codec = _CODECS[level] = pa.Codec("zstd", compression_level=level)
    return codec


def encode(source: TokenSource, planned: PlannedBatch, *, seq_len: int, compression: str, level: int,
           secret: bytes) -> EncodedBatch:
    t0 = time.perf_counter()
    tokens = planned.tokens if planned.tokens is not None else gather(source, planned.ids, seq_len)
    read_s = planned.read_s + time.perf_counter() - t0
    raw = tokens.tobytes()   # google_crc32c takes bytes only; uncompressed, this is the payload itself
    payload = _zstd(level).compress(raw, asbytes=True) if compression == "zstd" else raw
    return EncodedBatch(epoch=planned.epoch, step=planned.step, n=len(planned.ids), sample_len=seq_len + 1,
                        dtype=_NAMES.get(source.dtype) or _NAMES.setdefault(source.dtype, source.dtype.name),
                        compression=compression, tokens=payload,
                        sample_ids=planned.ids.astype("<i8").tobytes(), cursor=planned.cursor.encode(secret),
                        raw_size=len(raw), crc32c=google_crc32c.value(raw), read_s=read_s)
