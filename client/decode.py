"""Reply batches -> torch tensors: the CRC check, zstd, and the widening to int64."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import google_crc32c
import numpy as np
import torch

from feeder.errors import Code, FeederError
from feeder.layout import Bounds, cu_seqlens, position_ids
from feeder.v1 import feeder_pb2 as pb

DTYPES = {pb.DTYPE_UINT16: np.dtype("<u2"), pb.DTYPE_UINT32: np.dtype("<u4")}
_LOCAL = threading.local()


def _zstd():
    """zstandard's decompressor (~30% faster than pyarrow's codec on 32 KB batches here);
    one per thread, as a ZstdDecompressor must not be shared between threads."""
    d = getattr(_LOCAL, "zstd", None)
    if d is None:
        import zstandard

        d = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return d


@dataclass(frozen=True, slots=True)
class FeederBatch:
    """One micro-batch as the training loop gets it."""

    tokens: torch.Tensor      # int64 [n, seq_len + 1]
    sample_ids: torch.Tensor  # int64 [n]
    epoch: int
    step: int
    cursor: bytes             # pass as cursor= to resume right after this batch
    region: str = ""
    # A mixture's: int64 [n], the index in the mixture of each sample's source (sample_ids are
    # then ids within that source). None without a mixture.
    sources: torch.Tensor | None = None
    # Streams with boundaries (FeederDataset(boundaries=True), and every packed stream):
    # position_ids int64 [n, seq_len] over the inputs tokens[:, :-1], restarting at each
    # document (Megatron's reset_position_ids); cu_seqlens int32, FlashAttention's varlen
    # offsets of the documents over the flattened n·seq_len inputs; loss_mask float32
    # [n, seq_len], 0 where the label tokens[:, 1:] is a bin's padding; `boundaries` the compact
    # form (feeder.layout.Bounds: the document starts inside each sample), for the helpers of
    # feeder_client.packing. None without boundaries.
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    boundaries: Bounds | None = None


def pinned(n: int, sample_len: int) -> torch.Tensor:
    """A page-locked int64 [n, sample_len] tensor to decode into.

    torch's caching host allocator is the pool: it hands a freed block out again only once
    the copies that read it have finished. The trainer's `.to(device, non_blocking=True)` is
    then a true asynchronous copy, and no batch is copied once more to pin it (as
    DataLoader(pin_memory=True) does)."""
    return torch.empty((n, sample_len), dtype=torch.int64, pin_memory=True)


def decode(b: pb.Batch, region: str = "",
           alloc: Callable[[int, int], torch.Tensor] | None = None, sources: bytes | None = None,
           boundaries: bytes | None = None) -> FeederBatch:
    """One batch's tensors; FeederError(DATA_LOSS) when the batch is corrupt.

    The tokens are widened from the reply into their int64 tensor in one pass: into a fresh
    array, or into the one `alloc(n, sample_len)` gives (`pinned`)."""
    dtype = DTYPES.get(b.dtype)
    if dtype is None:
        raise FeederError(f"batch has unknown dtype {b.dtype}", code=Code.DATA_LOSS)
    if b.compression == pb.COMPRESSION_ZSTD:
        raw = _zstd().decompress(b.tokens, max_output_size=b.raw_size)
    else:
        raw = b.tokens
    if google_crc32c.value(raw) != b.crc32c:
        raise FeederError(f"batch epoch {b.epoch} step {b.step} failed its crc32c check", code=Code.DATA_LOSS)
    if len(raw) != b.n * b.sample_len * dtype.itemsize:
        raise FeederError(f"batch epoch {b.epoch} step {b.step} has {len(raw)} bytes of tokens, expected "
                          f"{b.n} samples x {b.sample_len} tokens x {dtype.itemsize} bytes", code=Code.DATA_LOSS)
    src = np.frombuffer(raw, dtype=dtype).reshape(b.n, b.sample_len)
    if alloc is None:   # numpy's astype: half the cost of a fresh torch.empty, whose pages fault in
        tokens = torch.from_numpy(src.astype(np.int64))
    else:
        tokens = alloc(b.n, b.sample_len)
        np.copyto(tokens.numpy(), src)
    ids = torch.from_numpy(np.frombuffer(b.sample_ids, dtype="<i8").astype(np.int64))
    src = None
    if sources is not None:
        if len(sources) != 8 * b.n:
            raise FeederError(f"batch epoch {b.epoch} step {b.step} names the sources of {len(sources) // 8} "
                              f"samples, expected {b.n}", code=Code.DATA_LOSS)
        src = torch.from_numpy(np.frombuffer(sources, dtype="<i8").astype(np.int64))
    extra = {}
    if boundaries is not None:
        try:
            bounds = Bounds.from_bytes(boundaries, b.n, b.sample_len)
        except ValueError as e:
            raise FeederError(f"batch epoch {b.epoch} step {b.step}: {e}", code=Code.DATA_LOSS) from None
        seq_len = b.sample_len - 1
        pad = np.arange(1, b.sample_len) >= bounds.lengths[:, None]
        extra = dict(boundaries=bounds, position_ids=torch.from_numpy(position_ids(bounds, seq_len)),
                     cu_seqlens=torch.from_numpy(cu_seqlens(bounds, seq_len)),
                     loss_mask=torch.from_numpy((~pad).astype(np.float32)))
    return FeederBatch(tokens=tokens, sample_ids=ids, epoch=b.epoch, step=b.step, cursor=b.cursor, region=region,
                       sources=src, **extra)
