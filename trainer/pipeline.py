"""DeepSpeed pipeline parallelism fed by the token feeder: `--pipeline P` stages × data-parallel
replicas (docs/model-parallel.md).

    deepspeed --num_gpus 4 -m feeder_trainer.pipeline --targets HOST:PORT --pipeline 2 ...

DeepSpeed's PipelineEngine reads its data iterator on the first and the last stage of each
data-parallel replica (inputs on the first, labels on the last). Both open the replica's feeder
stream as its two members (feeder_client.parallel.feeder_ranks(engine)): each gets the same
batches, which the feeder builds once; DistributedSampler's deal is over the replicas only.
Middle stages read nothing. Each checkpoint holds every replica's cursor (the first stage's,
which its last stage shares), and `--resume` continues every stream exactly.

`--local DIR` trains the same model on the same data read locally instead, a torch DataLoader
over DistributedSampler(num_replicas=replicas, rank=replica): the reference whose losses the
fed run must equal.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from feeder.service.security import ClientSecurity
from feeder_client import FeederDataset
from feeder_client.parallel import feeder_ranks

if __package__:
    from .model import Block, ModelConfig, RMSNorm, config_for, rope_tables
    from .train import agree_on_dataset, init_distributed, parse_targets
else:
    from feeder_trainer.model import Block, ModelConfig, RMSNorm, config_for, rope_tables
    from feeder_trainer.train import agree_on_dataset, init_distributed, parse_targets


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="", help="feeder addresses, comma separated")
    p.add_argument("--local", default="", help="read this dataset directory locally instead (the reference run)")
    p.add_argument("--job", default="pipeline")
    p.add_argument("--pipeline", type=int, default=2, help="pipeline stages (the rest of the world is data parallel)")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step (the pipeline's depth of work)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log-ids", default="", help="append every micro-batch's sample ids to DIR/rank{R}.jsonl")
    p.add_argument("--log-loss", default="", help="append each step's loss to this file (rank 0)")
    p.add_argument("--kill-at-step", type=int, default=0, help="fault injection: SIGKILL this process at this step")
    p.add_argument("--kill-rank", type=int, default=-1, help="... the process of this global rank")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Embed(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):
        return self.embed(tokens)


class Layer(nn.Module):
    """A decoder block with its own rotary tables (stages hold only their own layers)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.block = Block(c)
        for m in self.block.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        cos, sin = rope_tables(c.d_model // c.n_heads, c.max_seq_len, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        return self.block(x, self.cos, self.sin)


class Head(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(c.d_model)
        self.out = nn.Linear(c.d_model, c.vocab_size, bias=False)
        nn.init.normal_(self.out.weight, std=0.02)

    def forward(self, x):
        return self.out(self.norm(x))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def pipeline_module(c: ModelConfig, stages: int):
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(Embed, c), *[LayerSpec(Layer, c) for _ in range(c.n_layers)], LayerSpec(Head, c)]
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=lm_loss, partition_method="uniform")


def ds_config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.grad_accum,
            "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1, "torch_adam": True}},
            "zero_optimization": {"stage": 0}, "bf16": {"enabled": False}}


def local_batches(args, replica: int, replicas: int, start: int):
    """The reference: torch's DataLoader over DistributedSampler on the dataset read here."""
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    from feeder.core.sampler import n_samples
    from feeder.sources.open import open_source

    src = open_source(args.local)
    stream = np.empty(src.n_tokens, dtype=src.dtype)
    src.read(0, stream)
    L = args.seq_len

    class Samples(Dataset):
        def __len__(self):
            return n_samples(len(stream), L)

        def __getitem__(self, i):
            return torch.from_numpy(stream[i * L:i * L + L + 1].astype(np.int64)), i

    data = Samples()
    sampler = DistributedSampler(data, num_replicas=replicas, rank=replica, shuffle=True, seed=args.seed)
    skip, epoch = start, 0
    while True:
        sampler.set_epoch(epoch)
        for tokens, ids in DataLoader(data, batch_size=args.micro_batch, sampler=sampler):
            if skip:
                skip -= 1
                continue
            yield tokens, ids, epoch
        epoch += 1


def main(argv=None) -> int:
    import deepspeed

    args = parse_args(argv)
    rank, world = init_distributed(deepspeed, torch.cuda.is_available())
    torch.manual_seed(args.seed)
    if args.local:
        from feeder.sources.open import open_source

        vocab = open_source(args.local).vocab_size
    else:
        info, fingerprint = agree_on_dataset(parse_targets(args.targets), ClientSecurity())
        vocab = info.vocab_size
    model = pipeline_module(config_for(args.model_size, vocab, args.seq_len), args.pipeline)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                       if p.requires_grad], config=ds_config(args))
    r = feeder_ranks(engine)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"pipeline: {args.pipeline} stages x {r.world_size} data-parallel replicas; world {world}")
    step, cursor = 0, None
    if args.resume:
        path, state = engine.load_checkpoint(args.ckpt_dir)
        if path is None:
            say(f"error: no checkpoint in {args.ckpt_dir} to resume from")
            return 2
        step, cursor = state["step"], state["feeder_cursors"][r.rank]
        say(f"resumed from {path} at step {step}")
    data = batches = None
    if r.reads:
        if args.local:
            batches = local_batches(args, r.rank, r.world_size, step * args.grad_accum)
        else:
            data = FeederDataset(parse_targets(args.targets), job=args.job, seq_len=args.seq_len,
                                 micro_batch=args.micro_batch, seed=args.seed, num_epochs=0, cursor=cursor,
                                 expected_fingerprint=fingerprint, **r.kwargs())
            batches = ((b.tokens, b.sample_ids, b.epoch, b.cursor) for b in data)
    ids_log = None
    if args.log_ids and r.reads:
        Path(args.log_ids).mkdir(parents=True, exist_ok=True)
        ids_log = open(Path(args.log_ids) / f"rank{rank}.jsonl", "a", buffering=1)
    last_cursor = [cursor]

    def micro_batches():
        micro = 0
        while True:
            tokens, ids, epoch, *rest = next(batches)
            if rest:
                last_cursor[0] = rest[0]
            if ids_log:
                ids_log.write(json.dumps({"step": step, "micro": micro % args.grad_accum, "epoch": epoch,
                                          "dp": r.rank, "member": r.member, "ids": ids.tolist()}) + "\n")
            micro += 1
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    it = micro_batches() if r.reads else None
    loss_log = open(args.log_loss, "a", buffering=1) if args.log_loss and rank == 0 else None
    while step < args.steps:
        loss = engine.train_batch(data_iter=it)
        step += 1
        say(f"step {step:4d}  loss {loss.item():.6f}")
        if loss_log:
            loss_log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        if args.ckpt_dir and args.save_every and step % args.save_every == 0:
            save(engine, args.ckpt_dir, r, step, last_cursor[0], world)
        if step == args.kill_at_step and rank == args.kill_rank:
            if ids_log:
                ids_log.flush()
            os.kill(os.getpid(), signal.SIGKILL)   # as an OOM kill would: no cleanup
    if ids_log:
        ids_log.close()
    say(f"done: {step} steps")
    dist.barrier()
    return 0


def save(engine, ckpt_dir: str, r, step: int, cursor, world: int) -> None:
    """A checkpoint whose client_state holds every replica's cursor (its first stage's: the last
    stage's is the same, both members having taken the same batches)."""
    mine = (r.rank, cursor) if r.reads and r.member == 0 else None
    every = [None] * world
    dist.all_gather_object(every, mine)
    cursors = [None] * r.world_size
    for got in every:
        if got is not None:
            cursors[got[0]] = got[1]
    engine.save_checkpoint(ckpt_dir, tag=f"step{step}", client_state={"feeder_cursors": cursors, "step": step})


if __name__ == "__main__":
    sys.exit(main())
