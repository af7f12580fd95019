"""The client's decoding of a reply's batches into tensors: widened in one pass, into the
tensor an allocator gives (page-locked on CUDA machines), and refused when the batch is not
what it says it is."""
from __future__ import annotations

import google_crc32c
import numpy as np
import pytest
import torch
import zstandard

from feeder_client.stream import ClientConfig, decode
from feeder.core.config import StreamSpec
from feeder.core.errors import Code, FeederError
from feeder.v1 import feeder_pb2 as pb

DT = {np.uint16: pb.DTYPE_UINT16, np.uint32: pb.DTYPE_UINT32}


def batch(dtype=np.uint16, n=5, sample_len=17, compression="none", seed=0) -> tuple[pb.Batch, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, np.iinfo(dtype).max, size=(n, sample_len), dtype=dtype, endpoint=True)
    raw = tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    payload = zstandard.ZstdCompressor(level=3).compress(raw) if compression == "zstd" else raw
    b = pb.Batch(epoch=2, step=9, n=n, sample_len=sample_len, dtype=DT[dtype],
                 compression=pb.COMPRESSION_ZSTD if compression == "zstd" else pb.COMPRESSION_NONE,
                 tokens=payload, sample_ids=np.arange(100, 100 + n, dtype="<i8").tobytes(), cursor=b"c" * 40,
                 raw_size=len(raw), crc32c=google_crc32c.value(raw))
    return b, tokens


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_batch_decodes_to_its_tokens_widened_to_int64_with_and_without_an_allocator(dtype, compression):
    b, tokens = batch(dtype, compression=compression)
    given = []

    def alloc(n, sample_len):
        t = torch.full((n, sample_len), -1, dtype=torch.int64)
        given.append(t)
        return t

    for out in (decode(b, "eu"), decode(b, "eu", alloc)):
        assert out.tokens.dtype == torch.int64 and out.tokens.shape == tokens.shape
        np.testing.assert_array_equal(out.tokens.numpy(), tokens.astype(np.int64))
        assert out.sample_ids.tolist() == list(range(100, 105))
        assert (out.epoch, out.step, out.cursor, out.region) == (2, 9, b"c" * 40, "eu")
    # straight into the allocator's tensor, not copied into another one after
    assert len(given) == 1 and out.tokens.data_ptr() == given[0].data_ptr()


def test_a_batch_that_is_not_what_it_says_is_data_loss_and_never_delivered():
    b, _ = batch()
    wrong_crc, wrong_n, wrong_dtype = pb.Batch(), pb.Batch(), pb.Batch()
    for m in (wrong_crc, wrong_n, wrong_dtype):
        m.CopyFrom(b)
    wrong_crc.crc32c ^= 1
    wrong_n.n = 4   # checksum fine, shape not
    wrong_dtype.dtype = 99
    for bad, why in ((wrong_crc, "crc32c"), (wrong_n, "expected 4 samples x 17 tokens x 2 bytes"),
                     (wrong_dtype, "unknown dtype 99")):
        with pytest.raises(FeederError, match=why) as e:
            decode(bad, "", lambda n, s: pytest.fail("allocated for a batch that is refused"))
        assert e.value.code == Code.DATA_LOSS


def test_pin_memory_pins_where_there_is_cuda_and_is_refused_clearly_where_there_is_none():
    spec = StreamSpec(job="j", rank=0, world_size=1, seq_len=16, micro_batch=5)
    if torch.cuda.is_available():
        from feeder_client.stream import pinned

        ClientConfig(targets=("h:1",), spec=spec, pin_memory=True)
        b, tokens = batch(sample_len=17)
        out = decode(b, "", pinned)
        assert out.tokens.is_pinned()
        np.testing.assert_array_equal(out.tokens.numpy(), tokens.astype(np.int64))
    else:
        with pytest.raises(FeederError, match="pin_memory=True needs CUDA") as e:
            ClientConfig(targets=("h:1",), spec=spec, pin_memory=True)
        assert e.value.code == Code.INVALID_ARGUMENT
    ClientConfig(targets=("h:1",), spec=spec, pin_memory=False)   # never refused
