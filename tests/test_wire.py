"""The hand-written StreamReply bytes parse into exactly the message protobuf builds."""
from __future__ import annotations

import pytest

from feeder.pipeline.batcher import EncodedBatch
from feeder.service.servicer import to_proto
from feeder.service.wire import encode_reply, varint
from feeder.v1 import feeder_pb2 as pb


def batch(**kw):
    base = dict(epoch=3, step=2**40 + 7, n=8, sample_len=2049, dtype="uint16", compression="zstd",
                tokens=bytes(range(256)) * 300, sample_ids=b"\x01" * 64, cursor=b"c" * 150, raw_size=2**33 + 1,
                crc32c=2**32 - 1)
    base.update(kw)
    return EncodedBatch(**base)


@pytest.mark.parametrize("batches,region", [
    ([batch()], "eu-west"),
    ([batch(), batch(epoch=0, step=0, compression="none", dtype="uint32", crc32c=0, raw_size=0)], ""),
    ([batch(tokens=b"", sample_ids=b"", cursor=b"", n=0)], "r"),
    ([batch(step=k, tokens=bytes([k % 256]) * (k * 37)) for k in range(200)], "ümlaut-region"),
])
def test_wire_bytes_equal_protobufs_message(batches, region):
    ours = encode_reply(batches, region)
    want = pb.StreamReply(batches=[to_proto(b) for b in batches], region=region)
    assert pb.StreamReply.FromString(ours) == want
    assert len(ours) == want.ByteSize()


def test_varint():
    for v in (0, 1, 127, 128, 300, 2**32 - 1, 2**63):
        from google.protobuf.internal.encoder import _VarintBytes

        assert varint(v) == _VarintBytes(v)
