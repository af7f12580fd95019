"""StreamReply bytes written by hand, on the batch-building threads.

A 4 MiB reply of 128 batches costs ~13 ms to build and serialize with protobuf objects, and
grpc.aio does that on the event loop: with 8 ranks the loop did little else. Here the reply
is written from a Block in the proto3 wire format and handed to gRPC as bytes: by the C
writer (feeder/_native.c: one allocation, the token copy and the CRC-32Cs without the GIL) or,
where it was not built, by the Python one below. tests/test_wire.py checks that both give
the same bytes, and that protobuf parses them into exactly the message it would build.
"""
from __future__ import annotations

import google_crc32c
import numpy as np

from feeder.core.layout import ranges
from feeder.pipeline.batcher import Block
from feeder.service.convert import COMPRESSION_ENUM, DTYPE_ENUM

try:
    from feeder._native import frame as _frame
    from feeder._native import sources as _native_sources
except ImportError:  # no C compiler at install
    _frame = _native_sources = None


def _varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


_SMALL = [_varint(v) for v in range(1 << 14)]   # keys, lengths of small fields, most values


def varint(v: int) -> bytes:
    return _SMALL[v] if v < 16384 else _varint(v)


def _ld(field: int, data) -> list:
    """A length-delimited field (wire type 2): key, length, data; proto3 leaves an empty one out."""
    return [varint(field << 3 | 2), varint(len(data)), data] if len(data) else []


def _varints(fields) -> bytes:
    """Varint fields (wire type 0), leaving zeros out as proto3 does."""
    return b"".join(varint(field << 3) + varint(v) for field, v in fields if v)


def encode_reply_py(block: Block, region: str) -> bytes:
    parts = []
    dtype, comp, sample_len = DTYPE_ENUM[block.dtype], COMPRESSION_ENUM[block.compression], block.sample_len
    bounds, tokens = block.bounds(), block.token_array()
    for j in range(len(block)):
        a, b = bounds[j], bounds[j + 1]
        raw = tokens[a:b].tobytes()
        payload = raw if block.payloads is None else block.payloads[j]
        body = [_varints(((1, int(block.epochs[j])), (2, int(block.steps[j])), (3, b - a), (4, sample_len),
                          (5, dtype), (6, comp))),
                *_ld(7, payload), *_ld(8, block.ids[a:b].astype("<i8").tobytes()), *_ld(9, block.cursors[j]),
                _varints(((10, len(raw)), (11, google_crc32c.value(raw))))]
        parts += [varint(1 << 3 | 2), varint(sum(len(p) for p in body)), *body]
    parts += _ld(2, region.encode())
    return b"".join(parts)


def _sources(block: Block) -> bytes:
    """StreamReply.sources (field 3), a mixture's: one entry per batch. Fields of a message may
    come in any order and a repeated one is the concatenation of its entries, so they follow
    the batches and the region as written by either writer."""
    if block.sources is None:
        return b""
    if _native_sources is not None:   # (~2 us a message; the numpy below ~40, under one GIL for every rank)
        return _native_sources(np.ascontiguousarray(block.sources, dtype=np.int64),
                               np.ascontiguousarray(block.counts, dtype=np.int64))
    return _sources_np(block)


def _sources_np(block: Block) -> bytes:
    """_sources without the C extension."""
    return _entries(3, np.ascontiguousarray(block.sources, dtype="<i8").view(np.uint8), 8 * block.counts)


def _entries(field: int, data: np.ndarray, sizes: np.ndarray) -> bytes:
    """A repeated bytes field: entry j is the next sizes[j] bytes of `data` (uint8), each with
    its key and length, in one numpy pass for the whole block instead of a Python call per
    batch (a message holds up to 256)."""
    size = np.asarray(sizes, dtype=np.int64)
    if len(size) == 0 or size.max() >= 1 << 21:      # (never: a batch of 262144 samples)
        bounds = np.concatenate(([0], np.cumsum(size))).tolist()
        return b"".join(b"".join(_ld(field, data[bounds[j]:bounds[j + 1]].tobytes())) for j in range(len(size)))
    # The varint of each size is 1 to 3 bytes, each byte a column.
    nvar = 1 + (size >= 1 << 7) + (size >= 1 << 14)
    head = 1 + nvar
    starts = np.concatenate(([0], np.cumsum(head + size)[:-1]))
    out = np.empty(int((head + size).sum()), dtype=np.uint8)
    is_data = np.ones(len(out), dtype=bool)
    out[starts] = field << 3 | 2
    is_data[starts] = False
    for b in range(3):
        has = nvar > b
        at = starts[has] + 1 + b
        out[at] = ((size[has] >> (7 * b)) & 0x7F) | np.where(nvar[has] > b + 1, 0x80, 0)
        is_data[at] = False
    out[is_data] = data
    return out.tobytes()


def _elastic(block: Block) -> bytes:
    """StreamReply.elastic (field 6), an elastic stream's: per batch (parts, part, step samples)."""
    if block.elastic is None:
        return b""
    return _entries(6, np.ascontiguousarray(block.elastic[:, :3], dtype="<i8").reshape(-1).view(np.uint8),
                    np.full(len(block), 24, dtype=np.int64))


def _boundaries(block: Block) -> bytes:
    """StreamReply.boundaries (field 5): one entry per batch, after everything else (as the
    sources): per sample the document starts inside it, a few bytes where its tokens are
    thousands (feeder.layout.Bounds.to_bytes)."""
    b = block.boundaries
    if b is None:
        return b""
    k = len(block.counts)
    rows = np.concatenate(([0], np.cumsum(block.counts)))     # batch j: samples rows[j]..rows[j + 1]
    ptr = b.ptr()
    n = rows[1:] - rows[:-1]
    # Batch j's entry is its samples' counts, then their lengths, then their starts: three runs
    # of one array (counts, lengths, starts joined), gathered for the whole block at once.
    lo = np.stack((rows[:-1], len(b.counts) + rows[:-1], 2 * len(b.counts) + ptr[rows[:-1]]), axis=1).reshape(-1)
    cnt = np.stack((n, n, ptr[rows[1:]] - ptr[rows[:-1]]), axis=1).reshape(-1)
    joined = np.concatenate((b.counts, b.lengths, b.starts)).astype("<i4", copy=False)
    data = joined[ranges(lo, cnt)].view(np.uint8)
    return _entries(5, data, 4 * cnt.reshape(k, 3).sum(axis=1))


def encode_reply(block: Block, region: str) -> bytes:
    if _frame is None:
        return encode_reply_py(block, region) + _sources(block) + _boundaries(block) + _elastic(block)
    rows = block.rows
    return _frame(block.tokens, block.payloads, block.ids, block.counts, block.epochs, block.steps, block.cursors,
                  block.sample_len, np.dtype(block.dtype).itemsize, DTYPE_ENUM[block.dtype],
                  COMPRESSION_ENUM[block.compression], region.encode(),
                  None if rows is None else (rows.bufs, rows.which, rows.offs),
                  _sources(block) + _boundaries(block) + _elastic(block))
