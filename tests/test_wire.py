"""The hand-written StreamReply bytes (the C writer and the Python one) are the same, and parse
into exactly the message protobuf builds."""
from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from feeder.pipeline.batcher import Block
from feeder.service import wire
from feeder.v1 import feeder_pb2 as pb

from feeder import _native  # built at install (make env); without it the feeder uses the numpy and Python paths


def to_proto(block: Block, region: str) -> pb.StreamReply:
    """The reply as protobuf's own objects build it: the reference the hand-written bytes must equal."""
    bounds, tokens, out = block.bounds(), block.token_array(), []
    for j in range(len(block)):
        a, b = bounds[j], bounds[j + 1]
        raw = tokens[a:b].tobytes()
        out.append(pb.Batch(epoch=int(block.epochs[j]), step=int(block.steps[j]), n=b - a, sample_len=block.sample_len,
                            dtype=wire.DTYPE_ENUM[block.dtype], compression=wire.COMPRESSION_ENUM[block.compression],
                            tokens=raw if block.payloads is None else block.payloads[j],
                            sample_ids=block.ids[a:b].astype("<i8").tobytes(), cursor=block.cursors[j],
                            raw_size=len(raw), crc32c=google_crc32c.value(raw)))
    return pb.StreamReply(batches=out, region=region)


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
def test_gather_equals_slicing_from_several_buffers_and_refuses_rows_out_of_range(dtype):
    a, b = np.arange(10_000, dtype=dtype), np.arange(50, 80, dtype=dtype)
    a.setflags(write=False)   # memory-mapped chunks are read-only
    which = np.array([0, 1, 0, 1, 0], dtype=np.int64)
    offs = np.array([17, 0, 10_000 - 9, 30 - 9, 17], dtype=np.int64)
    out = np.zeros((5, 9), dtype=dtype)
    _native.gather([a, b], which, offs, 9, out)
    assert (out == np.stack([(a, b)[w][o:o + 9] for w, o in zip(which, offs)])).all()
    for bad_which, bad_off in (([0], [10_000 - 8]), ([0], [-1]), ([2], [0]), ([-1], [0]), ([1], [22])):
        with pytest.raises(IndexError, match="out of range"):
            _native.gather([a, b], np.array(bad_which, dtype=np.int64), np.array(bad_off, dtype=np.int64), 9,
                           out[:1])
    with pytest.raises(ValueError, match="items of"):          # a buffer of another dtype
        _native.gather([a.astype(np.uint8)], which[:1] * 0, offs[:1], 9, out[:1])
    with pytest.raises(ValueError, match="out has"):
        _native.gather([a, b], which, offs, 9, out[:4])


def as_rows(b: Block, seed: int = 0) -> Block:
    """The same block with its tokens as rows scattered over three buffers (as PosixSource.locate
    gives them), for the writer that cuts them straight into the reply."""
    from dataclasses import replace

    from feeder.sources.posix import Rows

    rng = np.random.default_rng(seed)
    n = b.sample_len
    which = rng.integers(0, 3, size=len(b.tokens)).astype(np.int64)
    bufs = [rng.integers(0, 9, size=(len(b.tokens) + 3) * n + 1).astype(b.tokens.dtype) for _ in range(3)]
    offs = np.zeros(len(b.tokens), dtype=np.int64)
    for w in range(3):   # each row its own slot, in random order, one item off alignment
        mine = np.flatnonzero(which == w)
        offs[mine] = rng.permutation(len(b.tokens) + 3)[:len(mine)] * n + 1
    for i, (w, o) in enumerate(zip(which, offs)):
        bufs[w][o:o + n] = b.tokens[i]
    return replace(b, tokens=None, rows=Rows(bufs, which, offs, n))


def test_tokens_cut_straight_into_the_reply_give_protobufs_bytes_on_and_off_varint_boundaries():
    """A batch's length prefix comes before its tokens but counts its checksum (0-6 bytes);
    a batch whose prefix size depends on the checksum (a body just under 2^14) takes the
    staged path. The cursor lengths walk the first batch's body across 16384."""
    sample_len, kinds = (16384 - 120) // 2, set()
    for cursor_len in range(72, 90):
        for seed in range(3):
            b = block([1, 1], sample_len=sample_len, cursor_len=cursor_len, seed=seed)
            first = to_proto(b, "eu").batches[0]
            first.crc32c = 0
            kinds.add("staged" if (first.ByteSize() < 16384) != (first.ByteSize() + 6 < 16384) else "direct")
            direct = wire.encode_reply(as_rows(b, seed), "eu")   # the C writer, cutting rows into the reply
            assert direct == to_proto(b, "eu").SerializeToString() == wire.encode_reply_py(b, "eu")
    assert kinds == {"staged", "direct"}


@pytest.mark.parametrize("counts", [[8], [8, 8, 3], [0], [1] * 200, [5, 0, 7]])
def test_a_block_of_rows_frames_the_bytes_of_the_same_block_with_its_tokens(counts):
    b = block(counts, sample_len=33)
    r = as_rows(b)
    assert r.tokens is None
    assert np.array_equal(r.token_array(), b.tokens)
    assert wire.encode_reply(r, "x") == wire.encode_reply(b, "x") == to_proto(b, "x").SerializeToString()
    assert wire.encode_reply_py(r, "x") == wire.encode_reply_py(b, "x")   # without the C writer


def test_the_c_writer_refuses_rows_that_do_not_match_the_counts():
    b = block([4, 4])
    buf = b.tokens.reshape(-1)
    args = [None, None, b.ids, b.counts, b.epochs, b.steps, b.cursors, b.sample_len, 2, 1, 1, b""]
    good = ([buf], np.zeros(8, dtype=np.int64), np.arange(8, dtype=np.int64) * 9)
    assert _native.frame(*args, good) == wire.encode_reply_py(b, "")
    for rows, err in (((([buf], good[1][:7], good[2][:7])), "rows has 7 rows"),
                      (([buf], good[1], good[2] + 1), "out of range"),
                      (None, "rows must be"), ((buf,), "rows must be")):
        with pytest.raises((ValueError, IndexError), match=err):
            _native.frame(*args, rows)
    with pytest.raises(ValueError, match="payloads None"):   # compressed payloads come with their tokens
        _native.frame(None, [b"x", b"y"], *args[2:], good)


@pytest.mark.parametrize("counts", [[8, 8, 3], [1], [15, 16, 17], [20, 5, 2000, 7], [16] * 5, [0, 3, 0],
                                    [2048, 1, 3000]])
def test_a_mixtures_sources_follow_the_batches_in_both_writers(counts):
    """StreamReply.sources: one entry per batch (an empty batch an empty entry), written in C or
    by one numpy pass, the same bytes; protobuf parses the same lists from both writers."""
    import dataclasses

    b = block(counts, seed=len(counts))
    src = np.random.default_rng(1).integers(0, 300, size=int(np.sum(counts)), dtype=np.int64)
    b = dataclasses.replace(b, sources=src)
    bounds = b.bounds()
    want = [src[bounds[j]:bounds[j + 1]].tolist() for j in range(len(counts))]
    assert wire._sources(b) == wire._sources_np(b)   # the C entries and the numpy ones, byte for byte
    for data in (wire.encode_reply(b, "r"), wire.encode_reply_py(b, "r") + wire._sources_np(b)):
        reply = pb.StreamReply.FromString(data)
        assert [np.frombuffer(s, "<i8").tolist() for s in reply.sources] == want
        assert len(reply.batches) == len(counts) and reply.region == "r"


def test_boundaries_follow_the_batches_one_entry_each():
    """StreamReply.boundaries (issue 27): one entry per batch, its samples' counts, lengths and
    starts, whichever writer frames the reply."""
    import dataclasses

    from feeder.core.layout import Bounds

    rng = np.random.default_rng(27)
    b = block([8, 1, 5, 200], sample_len=300)
    counts = rng.integers(0, 4, size=214).astype(np.int32)
    bounds = Bounds(counts, rng.integers(1, 301, size=214).astype(np.int32),
                    rng.integers(0, 300, size=int(counts.sum())).astype(np.int32))
    b = dataclasses.replace(b, boundaries=bounds)
    for ours in (wire.encode_reply(b, "r"), wire.encode_reply_py(b, "r") + wire._boundaries(b)):
        reply = pb.StreamReply.FromString(ours)
        assert len(reply.boundaries) == 4 and reply.batches[3].n == 200
        at = 0
        for j, n in enumerate([8, 1, 5, 200]):
            assert reply.boundaries[j] == bounds.part(at, at + n).to_bytes()
            at += n
