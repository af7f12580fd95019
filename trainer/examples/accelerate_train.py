"""Accelerate fed by the token feeder, exactly: `torchrun --nproc_per_node 2 accelerate_train.py
--targets HOST:PORT --job J [--grad-accum 2 --workers 2 --save-every 4 --resume]` (or accelerate launch).

The three lines that differ from an Accelerate script with a DataLoader are marked "feeder:".
"""
from __future__ import annotations

import glob
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from feeder_trainer.examples.common import IdsLog, parser, targets, tiny_model
from feeder_trainer.integrations.accelerate import DistributedFeederDataset, prepare_feeder


class Progress:
    """The optimizer step, saved with the rest by accelerator.save_state."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main(argv=None) -> int:
    args = parser(__doc__).parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    # feeder: rank and world_size come from the process group
    dataset = DistributedFeederDataset(targets(args.targets), job=args.job, seq_len=args.seq_len,
                                       micro_batch=args.micro_batch, seed=args.seed, num_epochs=1)
    if args.mistake == "dispatch":     # what a user tries first: Accelerate dispatches rank 0's batches
        loader = accelerator.prepare(DataLoader(dataset, batch_size=None, num_workers=args.workers))
    elif args.mistake == "shard":      # dispatch_batches=False: Accelerate re-shards each rank's stream
        from accelerate.data_loader import prepare_data_loader

        loader = prepare_data_loader(DataLoader(dataset, batch_size=1, collate_fn=lambda b: b[0]),
                                     dispatch_batches=False)
    elif args.mistake == "rank":       # rank/world not the process group's
        dataset = DistributedFeederDataset(targets(args.targets), job=args.job, seq_len=args.seq_len,
                                           micro_batch=args.micro_batch, rank=0, world_size=accelerator.num_processes)
        loader = prepare_feeder(accelerator, dataset)
    else:
        # feeder: a per-rank loader (not a prepared DataLoader); its cursor joins save_state/load_state
        loader = prepare_feeder(accelerator, dataset, num_workers=args.workers)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        # feeder: load_state restores every rank's cursor; the stream goes on from the saved step
        accelerator.load_state(max(glob.glob(os.path.join(args.out, "step_*")), key=lambda d: int(d.rsplit("_", 1)[1])))
        accelerator.print(f"resumed at step {progress.step}")
    log = IdsLog(args.log_ids, accelerator.process_index)
    batches = iter(loader)
    while progress.step < args.steps:
        for _ in range(args.grad_accum):
            batch = next(batches)
            log.write(progress.step, batch.step, batch.sample_ids.tolist())
            with accelerator.accumulate(model):
                loss = model(batch.tokens)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        progress.step += 1
        if args.save_every and progress.step % args.save_every == 0:
            accelerator.save_state(os.path.join(args.out, f"step_{progress.step}"))
        if progress.step == args.crash_at_step:
            os._exit(17)
    accelerator.print(f"done: {progress.step} steps, loss {loss.item():.4f}")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
