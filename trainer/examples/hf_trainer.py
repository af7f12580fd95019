"""The Hugging Face Trainer fed by the token feeder, exactly: `torchrun --nproc_per_node 2 hf_trainer.py
--targets HOST:PORT --job J [--grad-accum 2 --workers 2 --save-every 4 --resume]`.

The three lines that differ from a Trainer script with a datasets.Dataset are marked "feeder:".
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from feeder_trainer.examples.common import IdsLog, parser, targets
from feeder_trainer.integrations.common import batch_dict
from feeder_trainer.integrations.hf import DistributedFeederDataset, FeederTrainer


class CrashAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            os._exit(17)


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--deepspeed", default="", help="a DeepSpeed config (JSON) for the Trainer")
    args = p.parse_args(argv)
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, gradient_accumulation_steps=args.grad_accum,
                                 dataloader_num_workers=args.workers, save_strategy="steps" if args.save_every else "no",
                                 save_steps=args.save_every or 1, learning_rate=1e-3, logging_steps=1, report_to="none",
                                 use_cpu=True, ddp_backend="gloo", seed=args.seed, disable_tqdm=True,
                                 deepspeed=args.deepspeed or None)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=args.seq_len + 1, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=256, eos_token_id=256))
    # feeder: rank and world_size come from the process group (torchrun's RANK/WORLD_SIZE)
    dataset = DistributedFeederDataset(targets(args.targets), job=args.job, seq_len=args.seq_len,
                                       micro_batch=args.micro_batch, seed=args.seed, num_epochs=1,
                                       **({"rank": 0} if args.mistake == "rank" else {}))
    log = IdsLog(args.log_ids, training.process_index)
    trainer = None

    def inputs(batch):      # the model's inputs, and the ids log for the tests
        log.write(trainer.state.global_step, batch.step, batch.sample_ids.tolist())
        return batch_dict(batch)

    callbacks = [CrashAt(args.crash_at_step)] if args.crash_at_step else []
    if args.mistake == "plain":   # the dataset given to a plain Trainer: refused at the first batch
        trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=callbacks)
    else:
        # feeder: FeederTrainer in place of Trainer (per-rank stream, cursors in every checkpoint)
        trainer = FeederTrainer(model=model, args=training, train_dataset=dataset, feeder_transform=inputs,
                                callbacks=callbacks)
    # feeder: resume_from_checkpoint continues the stream from the checkpoint's cursors
    out = trainer.train(resume_from_checkpoint=True if args.resume else None)
    if training.process_index == 0:
        print(f"done: {trainer.state.global_step} steps, loss {out.training_loss:.4f}")
    # The Trainer leaves its process group up. Torn down by the interpreter's exit instead, the
    # gloo/DeepSpeed CPU comm threads sometimes outlived it: "terminate called without an active
    # exception", SIGABRT after a finished run (seen once in a fresh-clone `make test`).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
