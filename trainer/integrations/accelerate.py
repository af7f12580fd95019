"""Accelerate: one rank's feeder stream through `accelerator.prepare`, exactly.

    loader = prepare_feeder(accelerator, DistributedFeederDataset(targets, job=..., seq_len=..., micro_batch=...))
    for batch in loader:                  # this rank's DistributedSampler micro-batches, on accelerator.device
        with accelerator.accumulate(model): ...
    accelerator.save_state(dir)           # every rank's cursor in custom_checkpoint_N.pkl
    accelerator.load_state(dir)           # the next pass continues after the saved step

Why the loader is not prepared: no DataLoader setting of Accelerate leaves a per-rank iterable
alone when there is more than one process. prepare_data_loader wraps an IterableDataset either
in DataLoaderDispatcher (the default, dispatch_batches=None -> True for an IterableDataset:
rank 0's stream is read and cut among all ranks, the others' streams are never read) or, with
dispatch_batches=False, in IterableDatasetShard (each rank keeps every world_size-th item of its
own stream, split_batches or not). Both are wrong for a stream that is already the rank's.
So prepare_feeder returns a FeederLoader, which is no DataLoader: `accelerator.prepare` passes
it through untouched (also when it is given with the model and optimizer), and it puts the
batches on accelerator.device itself. A DataLoader of a DistributedFeederDataset that does get
prepared is refused at its first batch (FeederIntegrationError says what to do instead).

The cursor: registered with accelerator.register_for_checkpointing. Accelerate writes custom
state from the main process only, so FeederLoader.state_dict gathers every rank's cursor
(save_state calls it on every rank) and load_state_dict takes this rank's.

Gradient accumulation: `accelerator.accumulate` counts the batches the loop takes (one feeder
micro-batch each), so with gradient_accumulation_steps=k an optimizer step is k feeder steps;
save at an optimizer-step boundary and resume continues at the next feeder step.
"""
from __future__ import annotations

from typing import Any, Callable

from feeder_client.parallel import from_accelerate
from feeder_client import FeederBatch, FeederDataset

from .common import DistributedFeederDataset, FeederIntegrationError, FeederLoader

__all__ = ["prepare_feeder", "DistributedFeederDataset", "FeederLoader", "FeederIntegrationError"]


def prepare_feeder(accelerator, dataset: FeederDataset, *, transform: Callable[[FeederBatch], Any] | None = None,
                   num_workers: int = 0, device_placement: bool = True, **dataloader_kw) -> FeederLoader:
    """A FeederLoader of `dataset` for this rank, on accelerator.device, its cursor in
    accelerator.save_state / load_state.

    Args:
        accelerator: the accelerate.Accelerator (its process group is the rank/world checked).
        dataset: a FeederDataset; rank/world_size must be the process's (leave them out with
            DistributedFeederDataset).
        transform: FeederBatch -> the step's input (default: the FeederBatch).
        num_workers, **dataloader_kw: for the DataLoader underneath (batch_size is None).
        device_placement: move batches to accelerator.device (the prepared loader's default).

    Raises:
        FeederIntegrationError: rank/world_size not the accelerator's.
    """
    spec = dataset.spec
    want = from_accelerate(accelerator)   # the data-parallel rank of its ParallelismConfig, else the process
    if (spec.rank, spec.world_size) != (want.rank, want.world_size):
        raise FeederIntegrationError(
            f"feeder dataset rank={spec.rank} world_size={spec.world_size} but this Accelerate process is "
            f"data-parallel rank {want.rank} of {want.world_size}; leave rank and world_size out "
            f"(DistributedFeederDataset(..., parallel=accelerator)) to take them from the accelerator")
    loader = FeederLoader(dataset, transform=transform, device=accelerator.device if device_placement else None,
                          num_workers=num_workers, **dataloader_kw)
    accelerator.register_for_checkpointing(loader)
    return loader
