"""StreamReply bytes written by hand, on the batch-building threads.

A 4 MiB reply of 128 batches costs ~13 ms to build and serialize with protobuf objects, and
grpc.aio does that on the event loop: with 8 ranks the loop did little else. Here the reply
is assembled from each batch's fields in the proto3 wire format (the payload is copied once,
by the final join) and handed to gRPC as bytes. tests/test_wire.py checks that protobuf
parses it into exactly the message protobuf itself would build.
"""
from __future__ import annotations

from feeder.pipeline.batcher import EncodedBatch
from feeder.service.servicer import COMPRESSION_ENUM, DTYPE_ENUM


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
    """A length-delimited field (wire type 2): key, length, data."""
    return [varint(field << 3 | 2), varint(len(data)), data]


def _varints(fields) -> bytes:
    """Varint fields (wire type 0), leaving zeros out as proto3 does."""
    return b"".join(varint(field << 3) + varint(v) for field, v in fields if v)


def _batch(b: EncodedBatch) -> list:
    parts = [_varints(((1, b.epoch), (2, b.step), (3, b.n), (4, b.sample_len), (5, DTYPE_ENUM[b.dtype]),
                       (6, COMPRESSION_ENUM[b.compression])))]
    for field, data in ((7, b.tokens), (8, b.sample_ids), (9, b.cursor)):
        if data:  # proto3 leaves empty fields out
            parts += _ld(field, data)
    parts.append(_varints(((10, b.raw_size), (11, b.crc32c))))
    return parts


def encode_reply(batches: list[EncodedBatch], region: str) -> bytes:
    parts = []
    for b in batches:
        body = _batch(b)
        parts += [varint(1 << 3 | 2), varint(sum(len(p) for p in body)), *body]
    if region:
        parts += _ld(2, region.encode())
    return b"".join(parts)
