"""`feeder prep`: documents -> tokenized Arrow IPC shards + manifest.json.

Inputs are streamed (never loaded whole), tokenized by a pool of processes with a bounded
window of work in flight, and written in input order. So memory stays bounded however
large the input, and the output is identical whatever the number of workers.
"""
from __future__ import annotations

import json
import os
import struct
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from feeder import manifest as mf
from feeder import tokenize
from feeder.config import PrepConfig
from feeder.errors import InputError
from feeder.progress import Progress

SUFFIXES = (".jsonl", ".txt", ".parquet", ".tfrecord")

# A unit of work: (kind, payload, file, first line/record number). Workers turn it into
# (tokens with an EOS after each document, per-document lengths).
Unit = tuple[str, object, str, int]


def input_kind(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if not p.is_file():
        raise InputError(f"{path}: not a regular file")
    for suffix in SUFFIXES:
        if p.name.endswith(suffix) or p.name.endswith(suffix + ".gz") and suffix != ".parquet":
            return suffix[1:]
    raise InputError(f"{path}: unknown input type; expected one of {', '.join(SUFFIXES)}")


def read_units(path: str, batch_docs: int) -> Iterator[tuple[Unit, int]]:
    """Yields (unit, input bytes it covers) in document order."""
    kind = input_kind(path)
    if kind == "txt":
        data = Path(path).read_bytes()
        yield ("text", [data.decode("utf-8", errors="replace")], path, 1), len(data)
    elif kind == "jsonl":
        with open(path, "rb") as f:
            lines, first, nbytes = [], 1, 0
            for lineno, line in enumerate(f, 1):
                lines.append(line)
                nbytes += len(line)
                if len(lines) == batch_docs:
                    yield ("jsonl", lines, path, first), nbytes
                    lines, first, nbytes = [], lineno + 1, 0
            if lines:
                yield ("jsonl", lines, path, first), nbytes
    elif kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise InputError(f"{path}: not a readable Parquet file ({e})") from None
        if "text" not in pf.schema_arrow.names:
            raise InputError(f"{path}: no 'text' column (columns: {pf.schema_arrow.names})")
        per_row = os.path.getsize(path) / max(1, pf.metadata.num_rows)
        row = 1
        for rb in pf.iter_batches(batch_size=batch_docs, columns=["text"]):
            texts = [t if t is not None else "" for t in rb.column(0).to_pylist()]
            yield ("text", texts, path, row), int(per_row * len(texts))
            row += len(texts)
    else:  # tfrecord
        records, first, nbytes, index = [], 1, 0, 0
        for index, rec in enumerate(iter_tfrecord(path), 1):
            records.append(rec)
            nbytes += len(rec) + 16
            if len(records) == batch_docs:
                yield ("tfrecord", records, path, first), nbytes
                records, first, nbytes = [], index + 1, 0
        if records:
            yield ("tfrecord", records, path, first), nbytes


def _masked_crc(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def iter_tfrecord(path: str) -> Iterator[bytes]:
    """Records of a TFRecord file, CRC-checked: u64 length, u32 crc(length), data, u32 crc(data)."""
    with open(path, "rb") as f:
        index = 0
        while True:
            head = f.read(12)
            if not head:
                return
            index += 1
            if len(head) < 12:
                raise InputError(f"{path}: record {index}: truncated header")
            (length,), (crc_len,) = struct.unpack("<Q", head[:8]), struct.unpack("<I", head[8:])
            if _masked_crc(head[:8]) != crc_len:
                raise InputError(f"{path}: record {index}: length checksum mismatch (not a TFRecord file?)")
            data, tail = f.read(length), f.read(4)
            if len(data) < length or len(tail) < 4:
                raise InputError(f"{path}: record {index}: truncated")
            if _masked_crc(data) != struct.unpack("<I", tail)[0]:
                raise InputError(f"{path}: record {index}: data checksum mismatch")
            yield data


def write_tfrecord(path: str, examples: list[list[int]], feature: str = "input_ids") -> None:
    """Writes tf.train.Example records holding an int64 feature (for tests and tooling)."""
    from feeder.formats import tf_example_pb2 as tfe

    with open(path, "wb") as f:
        for ids in examples:
            ex = tfe.Example()
            ex.features.feature[feature].int64_list.value.extend(ids)
            data = ex.SerializeToString()
            head = struct.pack("<Q", len(data))
            f.write(head + struct.pack("<I", _masked_crc(head)) + data + struct.pack("<I", _masked_crc(data)))


_TOKENIZER = None


def _init_worker(spec: str, eos_token: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    global _TOKENIZER
    _TOKENIZER = tokenize.load(spec, eos_token)


def encode_unit(unit: Unit) -> tuple[np.ndarray, np.ndarray]:
    kind, payload, path, first = unit
    tok = _TOKENIZER
    if kind == "jsonl":
        texts = []
        for i, line in enumerate(payload):
            lineno = first + i
            if not line.strip():
                continue  # blank lines separate nothing; an empty document is {"text": ""}
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.__class__.__name__}: {e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise InputError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
            texts.append(obj["text"])
        docs = tok.encode_batch(texts)
    elif kind == "text":
        docs = tok.encode_batch(payload)
    else:
        from feeder.formats import tf_example_pb2 as tfe

        docs = []
        for i, rec in enumerate(payload):
            try:
                ex = tfe.Example.FromString(rec)
            except Exception:
                raise InputError(f"{path}: record {first + i}: not a tf.train.Example") from None
            feat = ex.features.feature.get("input_ids")
            if feat is None or feat.WhichOneof("kind") != "int64_list":
                raise InputError(f"{path}: record {first + i}: no int64 'input_ids' feature")
            ids = np.asarray(feat.int64_list.value, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                raise InputError(f"{path}: record {first + i}: token ids must be in [0, {tok.vocab_size}), "
                                 f"got range [{ids.min()}, {ids.max()}]")
            docs.append(ids)
    return join_documents(docs, tok.eos_id, np.dtype(mf.dtype_for_vocab(tok.vocab_size)))


def join_documents(docs: list[np.ndarray], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens with an EOS after each document, per-document lengths including that EOS)."""
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    out = np.full(int(lengths.sum()), eos_id, dtype=dtype)
    ends = np.cumsum(lengths)
    for d, end in zip(docs, ends):
        out[end - 1 - len(d):end - 1] = d
    return out, lengths


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


def prep(cfg: PrepConfig, *, force: bool = False) -> mf.Manifest:
    for path in cfg.inputs:
        input_kind(path)  # fail on a missing or unknown file before any work
    tok = tokenize.load(cfg.tokenizer, cfg.eos_token)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / mf.NAME).exists():
        if not force:
            raise InputError(f"{out} already holds a dataset ({mf.NAME}); pass --force to replace it")
        for old in out.glob("shard-*.arrow"):
            old.unlink()
        (out / mf.NAME).unlink()
    dtype = mf.dtype_for_vocab(tok.vocab_size)
    writer = ShardWriter(out, dtype, cfg.shard_tokens, cfg.chunk_tokens)
    total = sum(os.path.getsize(p) for p in cfg.inputs)
    progress = Progress("prep", total, enabled=cfg.progress)
    try:
        for tokens, lengths, nbytes in tokenized(cfg.inputs, cfg.tokenizer, cfg.eos_token, workers=cfg.workers,
                                                 batch_docs=cfg.batch_docs):
            writer.add(tokens, lengths)
            progress.advance(docs=len(lengths), tokens=len(tokens), nbytes=nbytes)
    finally:
        progress.close()
    shards = writer.close()
    return mf.write(out, mf.Manifest(tokenizer=tok.identity(), vocab_size=tok.vocab_size,
                                     eos_id=tok.eos_id, dtype=dtype, shards=tuple(shards)))


def tokenized(inputs, tokenizer: str, eos_token: str = "", *, workers: int = 0,
              batch_docs: int = 256) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens with an EOS after each document, per-document lengths, input bytes covered),
    in input order, from a pool of tokenizer processes with a bounded window of work in
    flight (2 units per worker): memory stays flat however large the input."""
    workers = workers or os.cpu_count() or 1

    def units():
        for path in inputs:
            yield from read_units(path, batch_docs)

    if workers == 1:
        _init_worker(tokenizer, eos_token)
        for unit, nbytes in units():
            yield (*encode_unit(unit), nbytes)
        return
    import multiprocessing as mp

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                             initargs=(tokenizer, eos_token)) as pool:
        window: deque = deque()
        for unit, nbytes in units():
            window.append((pool.submit(encode_unit, unit), nbytes))
            if len(window) >= 2 * workers:
                fut, n = window.popleft()
                yield (*fut.result(), n)
        while window:
            fut, n = window.popleft()
            yield (*fut.result(), n)
