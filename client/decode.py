"""Reply batches -> torch tensors: the CRC check, zstd, and the widening to int64."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import google_crc32c
import numpy as np
import torch

from feeder.core import context
from feeder.core.errors import Code, FeederError
from feeder.core.layout import Bounds, cu_seqlens, position_ids, segment_starts
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
    # Streams with boundaries (FeederDataset(boundaries=True), and every packed stream): the
    # batch's entry of StreamReply.boundaries as it came, a few bytes per sample. `boundaries`
    # (feeder.layout.Bounds), position_ids, cu_seqlens and loss_mask are made of it when first
    # read, in the loop that reads them: the stream's reader thread, which every batch passes,
    # does no work per token for them. None without boundaries.
    boundary_bytes: bytes | None = None
    # A context-parallel member's (FeederDataset(cp_size=C > 1)): (seq_len, cp_size, cp_rank,
    # cp_layout). `tokens` then holds only the member's windows of each sample (feeder.core.context):
    # one window of seq_len/C + 1 tokens (contiguous) or two of seq_len/2C + 1 (zigzag), one after
    # the other; input_ids, labels, position_ids and loss_mask are at its positions of the sample.
    # None: the whole sample.
    cp: tuple[int, int, int, str] | None = None
    # An elastic stream's (feeder_client.elastic): `step` is the global step; this replica's
    # micro-batches in it (`parts`; this is the `part`-th, from 0) and the samples of the whole
    # step over every live replica (`step_samples`: divide a summed loss by it). parts 0: this
    # replica has nothing in the step (the batch holds no sample). 0 / 0 / 0 for other streams.
    parts: int = 0
    part: int = 0
    step_samples: int = 0
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def boundaries(self) -> Bounds | None:
        """Where documents start inside each sample, and where a bin's padding begins
        (feeder.layout.Bounds; what feeder_client.packing's helpers read). Raises FeederError
        (DATA_LOSS) when the bytes that came are not this batch's boundaries."""
        got = self._derived.get("boundaries")
        if got is None and self.boundary_bytes is not None:
            n, sample_len = len(self.tokens), self.seq_len + 1   # (the whole sample's, also under context parallelism)
            try:
                got = self._derived["boundaries"] = Bounds.from_bytes(self.boundary_bytes, n, sample_len)
            except ValueError as e:
                raise FeederError(f"batch epoch {self.epoch} step {self.step}: {e}", code=Code.DATA_LOSS) from None
        return got

    @property
    def seq_len(self) -> int:
        return self.cp[0] if self.cp is not None else self.tokens.shape[1] - 1

    def _made(self, name: str) -> torch.Tensor | None:
        got = self._derived.get(name)
        if got is None and self.boundary_bytes is not None:
            b, seq_len = self.boundaries, self.seq_len
            cuts = segment_starts(b, seq_len)
            made = dict(position_ids=position_ids(b, seq_len, cuts), cu_seqlens=cu_seqlens(b, seq_len, cuts),
                        loss_mask=(np.arange(1, seq_len + 1, dtype=np.int32) < b.lengths[:, None]).astype(np.float32))
            if self.cp is not None:   # this member's positions of the whole sample's
                at = self._positions()
                made["position_ids"] = np.ascontiguousarray(made["position_ids"][:, at])
                made["loss_mask"] = np.ascontiguousarray(made["loss_mask"][:, at])
            self._derived.update((k, torch.from_numpy(v)) for k, v in made.items())
            got = self._derived[name]
        return got

    def _positions(self) -> np.ndarray:
        seq_len, size, rank, layout = self.cp
        return context.positions(seq_len, size, rank, layout)

    @property
    def position_ids(self) -> torch.Tensor | None:
        """int64 [n, seq_len] over the inputs tokens[:, :-1], restarting at each document
        (Megatron's reset_position_ids); None without boundaries. A context-parallel member's:
        [n, seq_len / cp_size] at its positions, and never None (0..seq_len-1 there without
        boundaries)."""
        if self.cp is not None and self.boundary_bytes is None:
            got = self._derived.get("position_ids")
            if got is None:
                got = self._derived["position_ids"] = \
                    torch.from_numpy(self._positions()).expand(len(self.tokens), -1).contiguous()
            return got
        return self._made("position_ids")

    @property
    def cu_seqlens(self) -> torch.Tensor | None:
        """int32: FlashAttention's varlen offsets of the documents over the flattened n·seq_len
        inputs (the whole sample's, also for a context-parallel member)."""
        return self._made("cu_seqlens")

    @property
    def loss_mask(self) -> torch.Tensor | None:
        """float32 [n, seq_len]: 0 where the label tokens[:, 1:] is a bin's padding (a
        context-parallel member's: at its positions)."""
        return self._made("loss_mask")

    def _split(self) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._derived.get("split")
        if got is None:
            if self.cp is None:
                got = (self.tokens[:, :-1], self.tokens[:, 1:])
            else:
                k = 2 if self.cp[3] == "zigzag" and self.cp[1] > 1 else 1
                win = self.tokens.reshape(len(self.tokens), k, -1)
                got = (win[:, :, :-1].reshape(len(self.tokens), -1), win[:, :, 1:].reshape(len(self.tokens), -1))
            self._derived["split"] = got
        return got

    @property
    def input_ids(self) -> torch.Tensor:
        """int64 [n, seq_len] (a context-parallel member's: [n, seq_len / cp_size], the sample's
        inputs at its positions): tokens[:, :-1] of the whole sample."""
        return self._split()[0]

    @property
    def labels(self) -> torch.Tensor:
        """int64, as input_ids: the next token of each input (tokens[:, 1:] of the whole sample)."""
        return self._split()[1]


def pinned(n: int, sample_len: int) -> torch.Tensor:
    """A page-locked int64 [n, sample_len] tensor to decode into.

    torch's caching host allocator is the pool: it hands a freed block out again only once
    the copies that read it have finished. The trainer's `.to(device, non_blocking=True)` is
    then a true asynchronous copy, and no batch is copied once more to pin it (as
    DataLoader(pin_memory=True) does)."""
    return torch.empty((n, sample_len), dtype=torch.int64, pin_memory=True)


def decode(b: pb.Batch, region: str = "",
           alloc: Callable[[int, int], torch.Tensor] | None = None, sources: bytes | None = None,
           boundaries: bytes | None = None, cp: tuple[int, int, int, str] | None = None,
           elastic: bytes | None = None) -> FeederBatch:
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
    if cp is not None and b.sample_len != cp_row(*cp):
        raise FeederError(f"batch epoch {b.epoch} step {b.step} has samples of {b.sample_len} tokens, expected a "
                          f"context-parallel member's {cp_row(*cp)} (seq_len {cp[0]}, cp_size {cp[1]}, cp_layout "
                          f"{cp[3]!r}): a feeder release without context parallelism?", code=Code.FAILED_PRECONDITION)
    parts = part = step_samples = 0
    if elastic is not None:
        if len(elastic) != 24:
            raise FeederError(f"batch epoch {b.epoch} step {b.step} has {len(elastic)} bytes of step fields, "
                              "expected 24", code=Code.DATA_LOSS)
        parts, part, step_samples = (int(v) for v in np.frombuffer(elastic, dtype="<i8"))
    return FeederBatch(tokens=tokens, sample_ids=ids, epoch=b.epoch, step=b.step, cursor=b.cursor, region=region,
                       sources=src, boundary_bytes=boundaries, cp=cp, parts=parts, part=part,
                       step_samples=step_samples)


def cp_row(seq_len: int, cp_size: int, cp_rank: int, layout: str) -> int:
    """The tokens per sample a context-parallel member receives (its windows)."""
    return sum(n for _, n in context.windows(seq_len, cp_size, cp_rank, layout))
