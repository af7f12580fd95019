"""Lightning fed by the token feeder, exactly: `torchrun --nproc_per_node 2 lightning_train.py
--targets HOST:PORT --job J [--grad-accum 2 --workers 2 --save-every 4 --resume]`.

The three lines that differ from a Lightning script with its own DataModule are marked "feeder:".
"""
from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from feeder_trainer.examples.common import IdsLog, parser, targets, tiny_model
from feeder_trainer.integrations.common import DistributedFeederDataset
from feeder_trainer.integrations.lightning import FeederDataModule


class LM(pl.LightningModule):
    def __init__(self, log: IdsLog):
        super().__init__()
        self.model, self.ids = tiny_model(), log

    def training_step(self, batch, batch_idx):
        self.ids.write(self.global_step, int(batch["feeder_step"]), batch["sample_ids"].tolist())
        return self.model(batch["tokens"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class IterLM(LM):   # the mistake: training_step(dataloader_iter) skips the hook that records the cursor
    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        return self.model(batch["tokens"])


class CrashAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            os._exit(17)


class Rebatched(pl.LightningDataModule):   # the mistake: the dataset in a DataLoader that batches again
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def train_dataloader(self):
        return DataLoader(DistributedFeederDataset(**self.kw), batch_size=8)


def main(argv=None) -> int:
    args = parser(__doc__).parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    kw = dict(targets=targets(args.targets), job=args.job, seq_len=args.seq_len, micro_batch=args.micro_batch,
              seed=args.seed, num_epochs=1)
    if args.mistake == "rebatch":
        data = Rebatched(**kw)
    else:
        # feeder: the DataModule (rank and world_size from the process group, made in setup)
        data = FeederDataModule(num_workers=args.workers, **({"rank": 0} if args.mistake == "rank" else {}),
                                transform=lambda b: {"tokens": b.tokens, "sample_ids": b.sample_ids,
                                                     "feeder_step": torch.tensor(b.step)}, **kw)
    callbacks = [ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_every, save_top_k=-1, save_last=True)
                 ] if args.save_every else []
    if args.crash_at_step:
        callbacks.append(CrashAt(args.crash_at_step))
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy="ddp",
                         max_steps=args.steps, accumulate_grad_batches=args.grad_accum, callbacks=callbacks,
                         enable_checkpointing=bool(args.save_every), logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    # feeder: ckpt_path restores every rank's cursor (FeederDataModule.load_state_dict)
    model = (IterLM if args.mistake == "iter" else LM)(IdsLog(args.log_ids, rank))
    trainer.fit(model, datamodule=data,
                ckpt_path=os.path.join(args.out, "last.ckpt") if args.resume else None)
    if trainer.global_rank == 0:
        print(f"done: {trainer.global_step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
