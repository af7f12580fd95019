"""What the examples share: the command line, a tiny model, the ids log the tests read."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--targets", required=True, help="HOST:PORT[,HOST:PORT...] of the feeders")
    p.add_argument("--job", required=True)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (max_steps)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    p.add_argument("--out", default="out", help="checkpoints go here")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    t = p.add_argument_group("for tests")
    t.add_argument("--log-ids", default="", help="append each batch's rank, step and sample ids to DIR/rankR.jsonl")
    t.add_argument("--crash-at-step", type=int, default=0, help="exit 17 right after this optimizer step")
    t.add_argument("--mistake", default="", help="make a user's mistake on purpose (see each example)")
    return p


def targets(s: str) -> list[str]:
    return [t for t in s.split(",") if t]


def tiny_model():
    """A decoder LM small enough for CPU tests (trainer/model.py's, byte vocabulary)."""
    from feeder_trainer.model import DecoderLM, ModelConfig

    return DecoderLM(ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=512))


class IdsLog:
    """One JSON line per batch the loop trains on: the optimizer step it belongs to, the
    feeder's step, the sample ids. Flushed per line: a crash keeps what was trained on."""

    def __init__(self, directory: str, rank: int):
        self.f = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.f = open(os.path.join(directory, f"rank{rank}.jsonl"), "a", encoding="utf-8")

    def write(self, step: int, feeder_step: int, ids) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"step": step, "feeder_step": feeder_step, "ids": [int(i) for i in ids]}) + "\n")
            self.f.flush()
