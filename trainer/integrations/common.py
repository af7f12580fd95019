"""What every framework integration shares: the rank's dataset and its loader with a cursor.

DistributedFeederDataset is a FeederDataset whose rank and world size default to the process
group's (or torchrun's RANK/WORLD_SIZE before it exists), and which refuses, with a message
that says what to do, the three ways a framework silently breaks a per-rank stream: rank/world
other than the process group's, a DataLoader that re-batches it (batch_size not None), and
Accelerate sharding it again (IterableDatasetShard) or dispatching rank 0's batches to all
(DataLoaderDispatcher).

FeederLoader is the per-rank loader the integrations hand to the framework in place of a
prepared DataLoader: DataLoader(dataset, batch_size=None, num_workers=...) underneath (workers
stay exact, see FeederDataset), each batch turned into what the model takes, and the cursor
of the last batch the loop took, saved for all ranks at once (frameworks write their
checkpoint's extra state from rank 0 only).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from feeder_client import FeederBatch, FeederDataset
from feeder_client.packing import hf_inputs
from feeder_client.parallel import feeder_ranks

STATE_VERSION = 1


class FeederIntegrationError(ValueError):
    """A feeder dataset used in a way that would give ranks the wrong samples."""


def megatron_state():
    """megatron.core.parallel_state when Megatron's model parallelism is initialized, else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    try:
        return ps if ps is not None and ps.model_parallel_is_initialized() else None
    except Exception:   # an older or half-initialized Megatron: not ours to read
        return None


def rank_and_world(rank: int | None = None, world_size: int | None = None, parallel=None) -> tuple[int, int]:
    """The rank and world size to stream for: the data-parallel ones of `parallel` (a framework's
    mesh: feeder_client.parallel.feeder_ranks; Megatron's parallel_state when initialized), else
    the process group's when it exists, else torchrun's (and accelerate launch's, Lightning's,
    DeepSpeed's) RANK / WORLD_SIZE, else 0 / 1.

    Given values must match: a rank streaming another rank's samples, or with another world
    size, would train on duplicates and leave gaps, silently.

    Raises:
        FeederIntegrationError: rank or world_size not the process group's (or the env's, or
            the mesh's data-parallel ones).
    """
    parallel = parallel if parallel is not None else megatron_state()
    if parallel is not None:
        r = feeder_ranks(parallel)
        have, source = (r.rank, r.world_size), f"the data-parallel dimension of {type(parallel).__name__}"
    elif dist.is_available() and dist.is_initialized():
        have, source = (dist.get_rank(), dist.get_world_size()), "the torch.distributed process group"
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        have, source = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])), "RANK/WORLD_SIZE in the environment"
    else:
        have, source = (0, 1), ""
    if not source:
        return (0 if rank is None else rank, 1 if world_size is None else world_size)
    for name, given, real in (("rank", rank, have[0]), ("world_size", world_size, have[1])):
        if given is not None and given != real:
            raise FeederIntegrationError(
                f"feeder dataset {name}={given} but {source} says {name}={real}: each rank must stream its own "
                f"share of the world it trains in; leave rank and world_size out to take them from the process group")
    return have


# Frames of a DataLoader or framework that would re-cut a FeederDataset's batches: (module
# prefix, class name) -> what to do instead.
_WRAPPERS = {
    ("accelerate.", "IterableDatasetShard"): "accelerate.prepare re-shards an IterableDataset across processes, so "
    "each rank would keep only every world_size-th of its own batches",
    ("accelerate.", "DataLoaderDispatcher"): "accelerate.prepare dispatches rank 0's batches to every rank by default "
    "for an IterableDataset (dispatch_batches), so the other ranks' streams would be lost",
}
_FIX = ("; do not pass a DataLoader of a feeder dataset to accelerator.prepare: use "
        "feeder_trainer.integrations.accelerate.prepare_feeder(accelerator, dataset), FeederTrainer or FeederDataModule")


def check_iterated_alone(max_depth: int = 40) -> None:
    """Raise if the caller's stack shows the dataset being re-batched, re-sharded or dispatched.

    Called from inside the dataset's generator: its callers are the DataLoader's fetcher (in
    the main process or a worker) and whatever wraps that. Only the frames' `self` is looked at.
    """
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return
        obj = frame.f_locals.get("self")
        if obj is not None:
            cls = type(obj)
            for (module, name), why in _WRAPPERS.items():
                if cls.__name__ == name and cls.__module__.startswith(module):
                    raise FeederIntegrationError(f"a feeder dataset must not be wrapped by {name}: {why}{_FIX}")
            # torch's fetcher for an IterableDataset: auto_collation means DataLoader(batch_size=k)
            # gathers k of the feeder's micro-batches into one, which no model takes.
            if cls.__name__ == "_IterableDatasetFetcher" and getattr(obj, "auto_collation", False):
                raise FeederIntegrationError(
                    "a feeder dataset yields whole micro-batches: wrap it in DataLoader(dataset, batch_size=None) "
                    "(or FeederLoader), not a DataLoader that batches again (a Trainer given the dataset without "
                    "FeederTrainer does this)" + _FIX)
        frame = frame.f_back


class DistributedFeederDataset(FeederDataset):
    """FeederDataset with rank/world_size from the process group, that refuses to be re-cut.

    Takes FeederDataset's arguments; rank and world_size may be left out (see rank_and_world).
    `parallel`: the framework's parallel layout (a DeviceMesh, an Accelerator with a
    ParallelismConfig, a Lightning ModelParallelStrategy, a DeepSpeed engine; Megatron's
    parallel_state is found by itself once initialized): rank and world_size are then its
    data-parallel ones, and member, members, cp_rank, cp_size, cp_layout its (docs/model-parallel.md).
    """

    def __init__(self, *args, rank: int | None = None, world_size: int | None = None, parallel=None, **kw):
        self._given = (rank, world_size)
        self.parallel = parallel if parallel is not None else megatron_state()
        rank, world_size = rank_and_world(rank, world_size, self.parallel)
        if self.parallel is not None:   # model parallel: which member of the rank this process is
            r = feeder_ranks(self.parallel)
            for k in ("member", "members", "cp_rank", "cp_size", "cp_layout"):
                kw.setdefault(k, getattr(r, k))
        super().__init__(*args, rank=rank, world_size=world_size, **kw)

    def check_process_group(self) -> None:
        """Raise FeederIntegrationError when the process group (made after this dataset, as
        Lightning and plain scripts do) disagrees with the rank/world this dataset streams."""
        rank_and_world(self.spec.rank, self.spec.world_size, self.parallel)

    def __iter__(self) -> Iterator[FeederBatch]:
        check_iterated_alone()
        yield from super().__iter__()


def batch_dict(batch: FeederBatch) -> dict[str, Any]:
    """The Hugging Face causal-LM inputs: input_ids and labels both the seq_len + 1 tokens
    (the model shifts the labels itself, so the seq_len predictions are exactly the sample's).
    With boundaries (boundaries=True, packing="best_fit"), also position_ids restarting at each
    document, and labels -100 where one would be predicted across documents or is padding
    (feeder_client.packing.hf_inputs): transformers then keeps each document's attention to
    itself (FlashAttention's varlen path, or SDPA's mask from the positions; transformers reads
    packed positions only without a KV cache, hence use_cache=False)."""
    if batch.boundaries is not None:
        return {**hf_inputs(batch, whole=True), "use_cache": False}
    return {"input_ids": batch.tokens, "labels": batch.tokens}


class FeederLoader:
    """One rank's loader over a FeederDataset: DataLoader(dataset, batch_size=None, num_workers)
    underneath, `transform` applied to each FeederBatch, and the cursor of the last batch taken.

    A new pass (iter) continues after the last batch taken from this loader (DataLoader
    workers' read-ahead is thrown away, not skipped over). `state_dict()` is collective under
    torch.distributed: it gathers every rank's cursor, because the frameworks write the
    checkpoint's extra state from rank 0 only; `load_state_dict` picks this rank's.

    Args:
        dataset: a FeederDataset (DistributedFeederDataset for the checks).
        transform: FeederBatch -> what the training step takes (default: the batch itself).
        device: move the batch's tensors here (tensors and dicts/lists/tuples of them).
        num_workers, **dataloader_kw: the DataLoader's (batch_size is always None).
    """

    def __init__(self, dataset: FeederDataset, transform: Callable[[FeederBatch], Any] | None = None,
                 device: torch.device | str | None = None, num_workers: int = 0, **dataloader_kw):
        for key in ("batch_size", "sampler", "batch_sampler", "shuffle", "collate_fn"):
            if dataloader_kw.get(key) is not None:
                raise FeederIntegrationError(f"FeederLoader: {key} is the feeder's (its batches are already the "
                                             f"rank's DistributedSampler micro-batches), do not pass it")
        self.dataset = dataset
        self.transform = transform
        self.device = torch.device(device) if device is not None else None
        self.num_workers = num_workers
        self.dataloader_kw = dataloader_kw
        self.cursor = dataset.cursor
        self.last_step = -1          # the feeder step of the last batch taken (-1: none yet)

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.dataset, DistributedFeederDataset):
            self.dataset.check_process_group()
        # Every pass starts after the last batch the loop took (not after what workers read ahead).
        # Only when that is not where the dataset stands already: load_state_dict leaves a file in
        # /dev/shm for workers, which a process ended by os._exit or SIGKILL does not remove.
        if self.cursor != self.dataset.cursor:
            self.dataset.load_state_dict({"version": 1, "cursor": self.cursor})
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers, **self.dataloader_kw)
        for batch in loader:
            self.cursor, self.last_step = batch.cursor, batch.step
            out = self.transform(batch) if self.transform is not None else batch
            yield out if self.device is None else to_device(out, self.device)

    def state_dict(self) -> dict:
        """{"version", "job", "world_size", "cursors": {rank: cursor}}: every rank's when a process
        group exists (collective then: every rank must call it, as every framework's save does),
        else this rank's alone."""
        spec = self.dataset.spec
        cursors = {spec.rank: self.cursor}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (spec.rank, self.cursor))
            cursors = dict(gathered)
        return {"version": STATE_VERSION, "job": spec.job, "world_size": spec.world_size, "cursors": cursors}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batch this rank had taken when `state` was saved.

        Raises:
            FeederIntegrationError: a state of another version, job or world size (a different
                world size needs a FeederDataset with reshard=True and the rank's cursor), or
                without this rank's cursor.
        """
        spec = self.dataset.spec
        if state.get("version") != STATE_VERSION:
            raise FeederIntegrationError(f"feeder loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        if (state["job"], state["world_size"]) != (spec.job, spec.world_size):
            raise FeederIntegrationError(
                f"the checkpoint's feeder state is job {state['job']!r} over {state['world_size']} ranks, this run "
                f"streams job {spec.job!r} over {spec.world_size}")
        if spec.rank not in state["cursors"]:
            raise FeederIntegrationError(f"the checkpoint's feeder state has no cursor for rank {spec.rank} (it holds "
                                         f"ranks {sorted(state['cursors'])}: saved without a process group?)")
        self.cursor = state["cursors"][spec.rank]
        self.dataset.load_state_dict({"version": 1, "cursor": self.cursor})


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if isinstance(obj, FeederBatch):
        out = dataclasses.replace(obj, tokens=obj.tokens.to(device, non_blocking=True))
        if obj.boundary_bytes is not None:   # what is made of them, made here and moved with the tokens
            out._derived.update({k: getattr(obj, k).to(device, non_blocking=True)
                                 for k in ("position_ids", "cu_seqlens", "loss_mask")})
        return out
    return obj
