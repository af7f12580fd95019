"""The hand-written StreamReply bytes (the C writer and the Python one) are the same, and parse
into exactly the message protobuf builds."""
from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from feeder.pipeline.batcher import Block
from feeder.service import wire
from feeder.service.servicer import to_proto
from feeder.v1 import feeder_pb2 as pb

from feeder import _native  # built at install (make env); without it the feeder uses the numpy and Python paths


def block(counts, *, sample_len=9, dtype=np.uint16, compression="none", epochs=None, steps=None, cursor_len=150,
          seed=0) -> Block:
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts, dtype=np.int64)
    k, rows = len(counts), int(counts.sum())
    tokens = rng.integers(0, np.iinfo(dtype).max, size=(rows, sample_len), dtype=dtype)
    payloads = None
    if compression == "zstd":
        payloads, at = [], 0
        for c in counts.tolist():
            payloads.append(bytes(rng.integers(0, 256, size=c * 3, dtype=np.uint8)))  # any bytes: framed as given
            at += c
    return Block(epochs=np.asarray(epochs if epochs is not None else [3] * k, dtype=np.int64),
                 steps=np.asarray(steps if steps is not None else range(2**40, 2**40 + k), dtype=np.int64),
                 counts=counts, ids=rng.integers(0, 2**62, size=rows, dtype=np.int64), tokens=tokens,
                 cursors=[bytes(rng.integers(0, 256, size=cursor_len, dtype=np.uint8)) for _ in range(k)],
                 payloads=payloads, dtype=np.dtype(dtype).name, compression=compression, sample_len=sample_len,
                 samples_in_epoch=100, raw_bytes=tokens.nbytes,
                 payload_bytes=tokens.nbytes if payloads is None else sum(map(len, payloads)))


@pytest.mark.parametrize("b,region", [
    (block([8]), "eu-west"),
    (block([8, 8, 3], dtype=np.uint32, compression="zstd", epochs=[0, 0, 1], steps=[0, 1, 0]), ""),
    (block([0], cursor_len=0, epochs=[0], steps=[0]), "r"),
    (block([1] * 200, sample_len=2049, steps=range(200)), "ümlaut-region"),
    (block([5, 0, 7], sample_len=1, compression="zstd"), "x" * 300),
])
def test_wire_bytes_equal_protobufs_message(b, region):
    want = to_proto(b, region)
    for ours in (wire.encode_reply_py(b, region), _native.frame(
            b.tokens, b.payloads, b.ids, b.counts, b.epochs, b.steps, b.cursors, b.sample_len, b.tokens.itemsize,
            wire.DTYPE_ENUM[b.dtype], wire.COMPRESSION_ENUM[b.compression], region.encode())):
        assert pb.StreamReply.FromString(ours) == want
        assert len(ours) == want.ByteSize()
    assert wire.encode_reply(b, region) == wire.encode_reply_py(b, region)


def test_the_c_writer_refuses_arrays_that_do_not_match_the_counts():
    b = block([4, 4])
    args = [b.tokens, None, b.ids, b.counts, b.epochs, b.steps, b.cursors, b.sample_len, 2, 1, 1, b""]
    for i, bad in ((0, b.tokens[:7]), (2, b.ids[:7]), (4, b.epochs[:1]), (6, b.cursors[:1] + [None])):
        with pytest.raises((ValueError, TypeError)):
            _native.frame(*args[:i], bad, *args[i + 1:])


def test_crc32c_equals_google_crc32c_at_every_length_and_alignment():
    data = np.random.default_rng(1).integers(0, 256, size=5000, dtype=np.uint8).tobytes()
    for start in range(9):
        for n in (0, 1, 7, 8, 9, 63, 64, 65, 1000, 4000):
            want = google_crc32c.value(data[start:start + n])
            assert _native.crc32c(data[start:start + n]) == _native.crc32c_soft(data[start:start + n]) == want


def test_varint():
    from google.protobuf.internal.encoder import _VarintBytes

    for v in (0, 1, 127, 128, 300, 2**32 - 1, 2**63):
        assert wire.varint(v) == _VarintBytes(v)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_gather_rows_equals_slicing_and_refuses_rows_out_of_range(dtype):
    src = np.arange(10_000, dtype=dtype)
    src.setflags(write=False)   # memory-mapped chunks are read-only
    offsets = np.array([17, 0, 10_000 - 9, 17], dtype=np.int64)
    out = np.zeros((4, 9), dtype=dtype)
    _native.gather_rows(src, offsets, 9, out, None)
    assert (out == np.stack([src[o:o + 9] for o in offsets])).all()
    scattered = np.zeros((6, 9), dtype=dtype)
    _native.gather_rows(src, offsets[:2], 9, scattered, np.array([5, 2], dtype=np.int64))
    assert (scattered[5] == src[17:26]).all() and (scattered[2] == src[0:9]).all() and not scattered[[0, 1, 3, 4]].any()
    for bad_offsets, rows in (([10_000 - 8], None), ([-1], None), ([0], np.array([6], dtype=np.int64))):
        with pytest.raises(IndexError, match="out of range"):
            _native.gather_rows(src, np.array(bad_offsets, dtype=np.int64), 9, scattered, rows)
