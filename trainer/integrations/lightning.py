"""Lightning fed by the token feeder, exactly: FeederDataModule.

    dm = FeederDataModule(targets, job=..., seq_len=..., micro_batch=..., num_workers=2)
    trainer = L.Trainer(max_steps=..., accumulate_grad_batches=k, strategy="ddp", ...)
    trainer.fit(model, datamodule=dm, ckpt_path="last")      # exact: the stream goes on from the cursors

How, and why:
* The dataset is made in setup(), where the process group exists (Lightning starts it in
  fit, after the DataModule was made), with rank and world size from it; given ones must match.
* train_dataloader is a FeederLoader (DataLoader(batch_size=None) underneath, workers exact):
  Lightning leaves an IterableDataset's DataLoader unsampled, and an iterable that is no
  DataLoader is not re-made. It is deliberately not Lightning-"stateful" (no state_dict), so the
  fit loop does not save a second, rank-0-only copy of the position.
* Lightning's fetcher reads one batch ahead of the one being trained, so the last batch the
  loader yielded is not the last one trained. Each batch carries its cursor (key
  "feeder_cursor"); FeederDataModule.on_before_batch_transfer, which Lightning calls as it starts
  the batch's step, takes it off and records it: the checkpoint holds the cursor of the last
  batch trained on. (Lightning prefers the DataModule's hook to a LightningModule's of the same
  name, with a warning; a training_step(dataloader_iter) bypasses the hook, so batches it takes
  must go through `self.trainer.datamodule.on_before_batch_transfer(batch, 0)`; state_dict
  refuses to save a position it never saw.)
* state_dict / load_state_dict: Lightning calls state_dict on every rank and writes rank 0's,
  so every rank's cursor is gathered into it; load_state_dict (Trainer.fit(ckpt_path=...)) takes
  this rank's. A restored mid-epoch run is not fast-forwarded by Lightning for an iterable, so
  no batch is pulled to be skipped.
* accumulate_grad_batches=k: Lightning counts batches (restored with the checkpoint), so an
  optimizer step is k feeder steps and max_steps is in optimizer steps, as in the other two.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl

from feeder_client import FeederBatch

from feeder_client.packing import model_inputs

from .common import DistributedFeederDataset, FeederIntegrationError, FeederLoader

__all__ = ["FeederDataModule", "FeederIntegrationError", "CURSOR_KEY"]
CURSOR_KEY = "feeder_cursor"


def default_transform(batch: FeederBatch) -> dict:
    """tokens int64 [n, seq_len + 1] (inputs + shifted labels, as trainer/model.py takes them) and sample_ids;
    with boundaries, also position_ids, loss_mask and the block-diagonal attention mask
    (feeder_client.packing), which trainer/model.py takes too."""
    out = {"tokens": batch.tokens, "sample_ids": batch.sample_ids}
    if batch.boundaries is not None:
        out.update(model_inputs(batch))
    return out


class _Batches:
    """The FeederLoader as Lightning sees it: dict batches with the cursor in them, no state_dict."""

    def __init__(self, loader: FeederLoader, transform: Callable[[FeederBatch], dict]):
        self.loader, self.transform = loader, transform

    def __iter__(self) -> Iterator[dict]:
        for batch in self.loader:
            out = self.transform(batch)
            if not isinstance(out, dict):
                raise FeederIntegrationError(f"FeederDataModule's transform must return a dict, got {type(out).__name__}")
            yield {**out, CURSOR_KEY: batch.cursor}


class FeederDataModule(pl.LightningDataModule):
    """A LightningDataModule of this rank's feeder stream, exact through Trainer.fit(ckpt_path=...).

    Args:
        targets, **dataset_kw: FeederDataset's (job, seq_len, micro_batch, seed, ...); rank and
            world_size default to the process group's.
        transform: FeederBatch -> the dict training_step gets (default: tokens and sample_ids).
        num_workers, **: the DataLoader's, through `dataloader_kw`.

    Raises:
        FeederIntegrationError: in setup, rank/world_size not the process group's.
    """

    def __init__(self, targets, *, transform: Callable[[FeederBatch], dict] = default_transform, num_workers: int = 0,
                 dataloader_kw: dict | None = None, **dataset_kw):
        super().__init__()
        self.targets, self.dataset_kw = targets, dataset_kw
        self.transform, self.num_workers, self.dataloader_kw = transform, num_workers, dataloader_kw or {}
        self.loader: FeederLoader | None = None
        self._pending: dict | None = None      # a state loaded before setup
        self._trained: bytes | None = None     # the cursor of the last batch trained on
        self._seen = False

    def setup(self, stage: str) -> None:
        if self.loader is not None:
            return
        # A ModelParallelStrategy's device mesh says which data-parallel rank (and member) this is.
        strategy = getattr(getattr(self, "trainer", None), "strategy", None)
        mesh = getattr(strategy, "device_mesh", None) if strategy is not None else None
        kw = dict(self.dataset_kw)
        if mesh is not None and "parallel" not in kw:
            kw["parallel"] = mesh
        dataset = DistributedFeederDataset(self.targets, **kw)
        self.loader = FeederLoader(dataset, num_workers=self.num_workers, **self.dataloader_kw)
        self._trained = dataset.cursor
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def train_dataloader(self) -> _Batches:
        # A new pass continues after the last batch trained on, not after the fetcher's read-ahead.
        self.loader.cursor = self._trained
        return _Batches(self.loader, self.transform)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, dict) and CURSOR_KEY in batch:
            batch = dict(batch)
            self._trained, self._seen = batch.pop(CURSOR_KEY), True
        return batch

    def state_dict(self) -> dict:
        if self.loader is None:
            return {}
        if self.loader.last_step >= 0 and not self._seen:
            raise FeederIntegrationError(
                "FeederDataModule never saw a batch start training (Lightning skips on_before_batch_transfer for "
                "a training_step(dataloader_iter)): pass each batch through self.trainer.datamodule."
                "on_before_batch_transfer(batch, 0), or the checkpoint would hold the fetcher's read-ahead position")
        self.loader.cursor = self._trained   # collective: gathers every rank's
        return {"feeder": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "feeder" not in state:
            return
        if self.loader is None:
            self._pending = state
            return
        self.loader.load_state_dict(state["feeder"])
        self._trained = self.loader.cursor
