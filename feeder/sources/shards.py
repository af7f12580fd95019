"""Writing our own format: documents into Arrow IPC shards with a chunk table (what `feeder prep`
writes, and what a Kafka epoch's snapshot is made of)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from feeder.sources import manifest as mf


class ShardWriter:
    """Writes documents into shard-NNNNN.arrow files, one record batch per ~chunk_tokens."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int, chunk_tokens: int):
        self.out, self.dtype = out, np.dtype(dtype)
        self.shard_tokens, self.chunk_tokens = shard_tokens, chunk_tokens
        self.schema = pa.schema([("tokens", pa.list_(pa.from_numpy_dtype(self.dtype)))])
        self.shards: list[mf.Shard] = []
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._pending_tokens = 0
        self._writer = None
        self._chunks: list[mf.Chunk] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        # Split at document boundaries so record batches stay near chunk_tokens.
        ends = np.cumsum(lengths)
        start_doc, start_tok = 0, 0
        while start_doc < len(lengths):
            room = self.chunk_tokens - self._pending_tokens
            k = int(np.searchsorted(ends[start_doc:] - start_tok, room, side="right"))
            k = max(k, 1)
            stop_doc = start_doc + k
            stop_tok = int(ends[stop_doc - 1])
            self._pending.append((tokens[start_tok:stop_tok], lengths[start_doc:stop_doc]))
            self._pending_tokens += stop_tok - start_tok
            start_doc, start_tok = stop_doc, stop_tok
            if self._pending_tokens >= self.chunk_tokens:
                self._flush_chunk()

    def _flush_chunk(self) -> None:
        if not self._pending:
            return
        values = np.concatenate([t for t, _ in self._pending]).astype(self.dtype, copy=False)
        lengths = np.concatenate([l for _, l in self._pending])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        if self._writer is None:
            path = self.out / f"shard-{len(self.shards):05d}.arrow"
            self._writer = pa.ipc.new_file(str(path), self.schema)
            self._path = path
        self._writer.write_batch(pa.record_batch([arr], schema=self.schema))
        import hashlib

        self._chunks.append(mf.Chunk(n_documents=len(lengths), n_tokens=len(values),
                                     sha256=hashlib.sha256(values.tobytes()).hexdigest()))
        self._pending, self._pending_tokens = [], 0
        if sum(c.n_tokens for c in self._chunks) >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self.shards.append(mf.Shard(
            path=self._path.name, format="arrow", n_documents=sum(c.n_documents for c in self._chunks),
            n_tokens=sum(c.n_tokens for c in self._chunks), bytes=self._path.stat().st_size,
            sha256=mf.file_sha256(self._path), chunks=tuple(self._chunks)))
        self._writer, self._chunks = None, []

    def close(self) -> list[mf.Shard]:
        self._flush_chunk()
        self._close_shard()
        return self.shards
