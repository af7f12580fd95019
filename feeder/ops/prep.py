"""`feeder prep`: documents -> tokenized Arrow IPC shards + manifest.json.

Inputs are streamed (never loaded whole), tokenized by a pool of processes with a bounded
window of work in flight, and written in input order. So memory stays bounded however
large the input, and the output is identical whatever the number of workers.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import struct
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import pyarrow as pa

from feeder.sources import manifest as mf
from feeder.sources.shards import ShardWriter
from feeder.ops import tokenizer
from feeder.core.tool_config import PrepConfig
from feeder.core.errors import InputError
from feeder.core.progress import Progress

SUFFIXES = (".jsonl", ".txt", ".parquet", ".tfrecord")
# Compression is told by the file's first bytes, whatever its name says; the name may add one
# of these suffixes to a kind that is read as a byte stream (Parquet compresses inside).
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
# JSON's \uXXXX escapes can spell half of a UTF-16 pair alone: a string that is no Unicode text.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# A unit of work: (kind, payload, file, first line/record number). Workers turn it into
# (tokens with an EOS after each document, per-document lengths).
Unit = tuple[str, object, str, int]


def input_kind(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file")
    if not p.is_file():
        raise InputError(f"{path}: not a regular file")
    name = p.name
    for packed in COMPRESSED_SUFFIXES:
        if name.endswith(packed) and not name.endswith(".parquet" + packed):
            name = name[:-len(packed)]
            break
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            if suffix == ".parquet" and compression(path):
                raise InputError(f"{path}: a Parquet file compressed whole ({compression(path)}); expected a "
                                 "plain Parquet file (it compresses inside)")
            return suffix[1:]
    raise InputError(f"{path}: unknown input type; expected one of {', '.join(SUFFIXES)} (.jsonl, .txt and "
                     f".tfrecord may be compressed: {', '.join(COMPRESSED_SUFFIXES)})")


def compression(path: str) -> str:
    """The file's compression, by its magic bytes ("" for none)."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for magic, name in MAGIC if head.startswith(magic)), "")


@contextlib.contextmanager
def open_input(path: str) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(the file's content as a byte stream, decompressed by its magic bytes; the raw file,
    whose position says how much of the input is done). Damaged compressed data ends in an
    InputError naming the file."""
    import bz2
    import gzip
    import lzma
    import zlib

    import zstandard

    kind = compression(path)
    with open(path, "rb") as raw:
        if kind == "gzip":
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        elif kind == "bzip2":
            stream = bz2.BZ2File(raw, "rb")
        elif kind == "xz":
            stream = lzma.LZMAFile(raw, "rb")
        elif kind == "zstd":
            stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
        else:
            stream = raw
        try:
            yield stream, raw
        except (EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError) as e:
            raise InputError(f"{path}: damaged {kind} data ({e.__class__.__name__}: {e})") from None
        except OSError as e:
            if stream is raw:
                raise
            raise InputError(f"{path}: damaged {kind} data ({e.__class__.__name__}: {e})") from None


def not_utf8(where: str, data: bytes, e: UnicodeDecodeError) -> InputError:
    """The error for bytes that are not UTF-8, naming where and the first bad byte: text is
    never decoded with replacement characters, which would change it silently."""
    return InputError(f"{where}: not UTF-8: byte {e.start:,} is 0x{data[e.start]:02x} ({e.reason}); "
                      "expected UTF-8 text")


def read_units(path: str, batch_docs: int) -> Iterator[tuple[Unit, int]]:
    """Yields (unit, input bytes it covers) in document order."""
    kind = input_kind(path)
    if kind == "parquet":
        yield from _parquet_units(path, batch_docs)
        return
    with open_input(path) as (f, raw):
        packed = f is not raw
        if kind == "txt":
            data = f.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise not_utf8(f"{path}{' (decompressed)' if packed else ''}", data, e) from None
            yield ("text", [text], path, 1), raw.tell()
        elif kind == "jsonl":
            lines, first, done = [], 1, 0
            for lineno, line in enumerate(f, 1):
                lines.append(line)
                if len(lines) == batch_docs:
                    yield ("jsonl", lines, path, first), raw.tell() - done
                    lines, first, done = [], lineno + 1, raw.tell()
            if lines:
                yield ("jsonl", lines, path, first), raw.tell() - done
        else:  # tfrecord
            records, first, done, index = [], 1, 0, 0
            for index, rec in enumerate(iter_tfrecord(f, path), 1):
                records.append(rec)
                if len(records) == batch_docs:
                    yield ("tfrecord", records, path, first), raw.tell() - done
                    records, first, done = [], index + 1, raw.tell()
            if records:
                yield ("tfrecord", records, path, first), raw.tell() - done


def _parquet_units(path: str, batch_docs: int) -> Iterator[tuple[Unit, int]]:
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
        try:
            texts = [t if t is not None else "" for t in rb.column(0).to_pylist()]
        except UnicodeDecodeError:  # Arrow does not check a string column's UTF-8 on read
            for i, value in enumerate(rb.column(0).cast(pa.binary()).to_pylist()):
                try:
                    (value or b"").decode("utf-8")
                except UnicodeDecodeError as e:
                    raise not_utf8(f"{path}: row {row + i}: 'text'", value, e) from None
            raise
        yield ("text", texts, path, row), int(per_row * len(texts))
        row += len(texts)


def _masked_crc(data: bytes) -> int:
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def iter_tfrecord(f: BinaryIO, path: str) -> Iterator[bytes]:
    """Records of a TFRecord stream, CRC-checked: u64 length, u32 crc(length), data, u32 crc(data)."""
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
    from feeder.tfrecord import tf_example_pb2 as tfe

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
    _TOKENIZER = tokenizer.load(spec, eos_token)


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
            except UnicodeDecodeError as e:
                raise not_utf8(f"{path}:{lineno}", line, e) from None
            except (ValueError, RecursionError) as e:   # RecursionError: nested past the parser's depth
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.__class__.__name__}: {e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise InputError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
            text = obj["text"]
            # Refused, not repaired: replacing it would change the text silently, and the
            # surrogate itself has no UTF-8 bytes to tokenize.
            if (bad := _LONE_SURROGATE.search(text)) is not None:
                raise InputError(f"{path}:{lineno}: 'text' holds a lone UTF-16 surrogate \\u{ord(bad.group()):04x} "
                                 f"at character {bad.start():,}, which is not a Unicode character; expected "
                                 "\\ud800-\\udfff escapes only in high-low pairs")
            texts.append(text)
        docs = tok.encode_batch(texts)
    elif kind == "text":
        docs = tok.encode_batch(payload)
    else:
        from feeder.tfrecord import tf_example_pb2 as tfe

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


def prep(cfg: PrepConfig, *, force: bool = False) -> mf.Manifest:
    for path in cfg.inputs:
        input_kind(path)  # fail on a missing or unknown file before any work
    tok = tokenizer.load(cfg.tokenizer, cfg.eos_token)
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out}: cannot make the directory ({e.strerror})") from None
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
    n_documents = sum(s.n_documents for s in shards)
    if sum(s.n_tokens for s in shards) == n_documents:  # each document is its tokens and one EOS
        for s in shards:
            (out / s.path).unlink()
        raise InputError(
            "the inputs hold no documents: the dataset would have no tokens, and every stream would be refused; "
            "expected at least one document with text" if not n_documents else
            f"the inputs hold only empty documents ({n_documents:,}): the dataset would hold end-of-document "
            "markers only, nothing to train on; expected at least one document with text")
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
