"""The Hugging Face Trainer fed by the token feeder, exactly: FeederTrainer.

    trainer = FeederTrainer(model=model, args=TrainingArguments(max_steps=..., gradient_accumulation_steps=k, ...),
                            train_dataset=DistributedFeederDataset(targets, job=..., seq_len=..., micro_batch=...))
    trainer.train(resume_from_checkpoint=True)

What it changes in transformers.Trainer, and why:
* get_train_dataloader returns a FeederLoader, not a prepared DataLoader: Trainer would wrap
  the dataset in DataLoader(batch_size=per_device_train_batch_size) (re-batching the feeder's
  micro-batches) and give it to accelerator.prepare (which dispatches rank 0's batches, or
  re-shards each rank's stream: see integrations/accelerate.py). One feeder micro-batch is one
  Trainer batch: per_device_train_batch_size is not used; micro_batch is the dataset's.
  dataloader_num_workers, dataloader_persistent_workers and dataloader_prefetch_factor apply.
* every rank's cursor goes into each checkpoint folder (feeder_state.pt, next to the RNG and
  optimizer state), gathered to the process that saves.
* on train(resume_from_checkpoint=...), the stream continues from that checkpoint's cursor, and
  args.ignore_data_skip is set so the Trainer does not skip batches by pulling them.
* gradient accumulation: the Trainer takes gradient_accumulation_steps batches per optimizer step
  and no more (get_batch_samples), so optimizer step s trains on feeder steps s*k .. s*k+k-1 and
  max_steps is max_steps*k feeder steps; a checkpoint at step s resumes at feeder step s*k.

A plain Trainer given a DistributedFeederDataset fails at its first batch with a message that
says to use FeederTrainer (the dataset sees the re-batching DataLoader it is read by).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from feeder_client import FeederBatch, FeederDataset

from feeder_client.parallel import from_device_mesh, mesh_ranks

from .common import DistributedFeederDataset, FeederIntegrationError, FeederLoader, batch_dict, rank_and_world

__all__ = ["FeederTrainer", "DistributedFeederDataset", "FeederIntegrationError", "STATE_FILE"]
STATE_FILE = "feeder_state.pt"


class FeederTrainer(Trainer):
    """transformers.Trainer over a FeederDataset: per-rank streams, cursors in checkpoints.

    Args:
        train_dataset: a FeederDataset of this rank (DistributedFeederDataset: rank/world from
            the process group).
        feeder_transform: FeederBatch -> the model's inputs (default: input_ids and labels both
            the batch's tokens; a causal LM shifts the labels itself).
        Everything else: transformers.Trainer's. args.max_steps must be set (the stream has no length).

    Raises:
        FeederIntegrationError: train_dataset not a FeederDataset; rank/world_size not the
            process group's; a checkpoint without the feeder's state, or of another job.
    """

    def __init__(self, *args, train_dataset: FeederDataset | None = None,
                 feeder_transform: Callable[[FeederBatch], Any] = batch_dict, **kw):
        if not isinstance(train_dataset, FeederDataset):
            raise FeederIntegrationError(f"FeederTrainer needs train_dataset=FeederDataset(...), got "
                                         f"{type(train_dataset).__name__}")
        super().__init__(*args, train_dataset=train_dataset, **kw)
        # The stream resumes from the checkpoint's cursor: skipping would pull and drop batches.
        self.args.ignore_data_skip = True
        a = self.args
        extra = {}
        if a.dataloader_num_workers > 0:
            extra = dict(persistent_workers=a.dataloader_persistent_workers,
                         prefetch_factor=a.dataloader_prefetch_factor)
        self.feeder_loader = FeederLoader(train_dataset, transform=feeder_transform,
                                          num_workers=a.dataloader_num_workers, **extra)

    def get_train_dataloader(self) -> FeederLoader:
        spec = self.feeder_loader.dataset.spec
        # The Trainer's Accelerator knows its parallelism (tensor / context parallel dimensions):
        # the feeder's rank is the data-parallel one.
        mesh = getattr(getattr(self, "accelerator", None), "torch_device_mesh", None)
        if mesh is not None:
            want = from_device_mesh(mesh)
            rank_and_world(spec.rank, spec.world_size, mesh)
        else:
            rank_and_world(spec.rank, spec.world_size)   # the process group exists by now
            want = mesh_ranks(dp=(self.args.process_index, self.args.world_size))
        if (spec.rank, spec.world_size) != (want.rank, want.world_size):
            raise FeederIntegrationError(
                f"feeder dataset rank={spec.rank} world_size={spec.world_size} but the Trainer runs as "
                f"data-parallel rank {want.rank} of {want.world_size}")
        return self.feeder_loader

    def _save_checkpoint(self, model, trial) -> None:
        # Before the Trainer's own files, so that a folder the Trainer counts as a checkpoint
        # has the cursor. state_dict is collective: every rank gets here (as in the Trainer).
        state = self.feeder_loader.state_dict()
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(state, os.path.join(folder, STATE_FILE))
        super()._save_checkpoint(model, trial)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kw):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise FeederIntegrationError(f"no checkpoint to resume from in {self.args.output_dir}")
        if resume_from_checkpoint:
            path = os.path.join(resume_from_checkpoint, STATE_FILE)
            if not os.path.isfile(path):
                raise FeederIntegrationError(
                    f"{resume_from_checkpoint} has no {STATE_FILE}: it was not saved by FeederTrainer, so the stream "
                    f"cannot continue where it stopped")
            self.feeder_loader.load_state_dict(torch.load(path, weights_only=False))
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, *args, **kw)
