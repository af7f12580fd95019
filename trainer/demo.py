"""`make demo`: the main job on an embedded default, no arguments (`make demo-packing`: the same
with document-aware samples: best-fit bins of whole documents, and Megatron's three flags from
the boundaries the feeder serves; it prints the padding fraction and the loss).

Builds two real text corpora available offline (this Python's standard library sources, and
its documentation text), runs `feeder prep` on each, starts a feeder serving both by name,
trains the model with DeepSpeed on 2 ranks for a few hundred steps on a 70/30 mixture of
them, shows the loss falling (per source too), the samples trained on per source against the
weights, and the feed's throughput, stops everything.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from feeder.ops.corpus import build_corpus, build_docs_corpus
from feeder.core.net import free_port

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "demo"


# `--packing`: what the training asks for besides the mixture (docs/packing.md).
PACKING_FLAGS = ["--packing", "best_fit", "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def pipeline(bin_dir: Path, address: str) -> int:
    """Pipeline parallelism (docs/model-parallel.md): a DeepSpeed PipelineModule in 2 stages x 2
    data-parallel replicas, 4 processes, the first and the last stage of each replica reading its
    stream as its two members (the feeder builds each batch once for both)."""
    print("== 5/5 pipeline parallelism: DeepSpeed PipelineModule, 2 stages x 2 data-parallel replicas (4 processes); "
          "both stages of a replica read its stream as its members", flush=True)
    cmd = [str(bin_dir / "deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()),
           str(Path(__file__).resolve().parent / "pipeline.py"), "--targets", address, "--job", "demo-pipeline",
           "--pipeline", "2", "--steps", os.environ.get("DEMO_PIPELINE_STEPS", "30"), "--seq-len", "128",
           "--micro-batch", "4", "--grad-accum", "2", "--log-ids", str(WORK / "pipeline-ids")]
    shutil.rmtree(WORK / "pipeline-ids", ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=WORK)
    losses = []
    for out in proc.stdout:
        if re.match(r"^(pipeline|done|error)", out) or re.match(r"^step +\d*[05] ", out):
            print("   " + out.rstrip(), flush=True)
        if out.startswith("step"):
            losses.append(float(out.split("loss")[1].split()[0]))
    rc = proc.wait()
    if rc != 0:
        print(f"pipeline training failed with exit code {rc}", file=sys.stderr)
        return rc
    # Both stages of each replica took the same micro-batches: the feeder gave them the same stream.
    logs = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted((WORK / "pipeline-ids").glob("*"))]
    by = {}
    for log in logs:
        for r in log:
            by.setdefault(r["dp"], {}).setdefault(r["member"], []).append(r["ids"])
    same = all(len(m) == 2 and m[0] == m[1] for m in by.values())
    print(f"   pipeline took {time.monotonic() - t0:.0f}s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; both stages of "
          f"each replica got the same {len(next(iter(by.values()))[0])} micro-batches: {same}", flush=True)
    shutil.rmtree(WORK / "pipeline-ids", ignore_errors=True)
    return 0 if same and losses[-1] < losses[0] else 1


def build_corpora(feeder: list[str]) -> list[str]:
    """Steps 1 and 2: the two corpora, each prepared into shards; their names."""
    print(f"== 1/5 corpora: Python {sys.version.split()[0]} standard library sources (code), and its docs and "
          "docstrings (docs)",
          flush=True)
    corpora = {"code": lambda out: build_corpus(out, limit=8 << 20, suffixes=(".py",)),
               "docs": lambda out: build_docs_corpus(out, limit=4 << 20)}
    for name, build in corpora.items():
        n = build(WORK / f"{name}.jsonl")
        print(f"   {name}: {n / 1e6:.1f} MB of text in {WORK / (name + '.jsonl')}", flush=True)
    print("== 2/5 feeder prep (byte tokenizer), one dataset per corpus", flush=True)
    for name in corpora:
        subprocess.run([*feeder, "prep", str(WORK / f"{name}.jsonl"), "--out", str(WORK / f"shards-{name}"),
                        "--force", "--shard-tokens", str(4 << 20)], check=True)
    return list(corpora)


def main(argv: list[str] | None = None) -> int:
    packing = "--packing" in (sys.argv[1:] if argv is None else argv)
    WORK.mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    feeder = [sys.executable, "-m", "feeder.cli"]
    corpora = build_corpora(feeder)
    print("== 3/5 feeder serve --source code=... --source docs=...", flush=True)
    server = subprocess.Popen([*feeder, "serve", *[a for name in corpora for a in
                                                   ("--source", f"{name}={WORK / ('shards-' + name)}")],
                               "--listen", "127.0.0.1:0", "--region", "demo"],
                              stdout=subprocess.PIPE, stderr=open(WORK / "feeder.log", "w"), text=True)
    try:
        line = server.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        if not m:
            print(f"feeder did not start; see {WORK / 'feeder.log'}", file=sys.stderr)
            return 1
        address = m.group(1)
        print(f"   {line.strip()}", flush=True)
        print("== 4/5 DeepSpeed training, 2 ranks (nccl on GPU, gloo on CPU), fed only by the feeder, on the "
              "mixture code=0.7,docs=0.3 (loss per source: mean (samples) in the window)", flush=True)
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               str(Path(__file__).resolve().parent / "train.py"), "--targets", address, "--job", "demo", "--steps",
               os.environ.get("DEMO_STEPS", "300"), "--seq-len", "128", "--micro-batch", "8", "--log-every", "25",
               "--ckpt-dir", str(WORK / "checkpoints"), "--save-every", "150",
               "--mixture", "code=0.7,docs=0.3", *(PACKING_FLAGS if packing else [])]
        if packing:
            print("   with best-fit bins of whole documents (" + " ".join(PACKING_FLAGS) + ")", flush=True)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=WORK)
        losses, per_source = [], {}
        for out in proc.stdout:
            # DeepSpeed's own INFO/WARNING chatter goes to the log; our lines to the screen
            if re.match(r"^(model|step|done|resumed|error)", out):
                print("   " + out.rstrip(), flush=True)
                if out.startswith("step"):
                    losses.append(float(out.split("loss")[1].split()[0]))
                    for name, n in re.findall(r"(code|docs) [\d.]+ \((\d+)\)", out):
                        per_source[name] = per_source.get(name, 0) + int(n)
        rc = proc.wait()
        if rc != 0:
            print(f"training failed with exit code {rc}", file=sys.stderr)
            return rc
        print(f"   training took {time.monotonic() - t0:.0f}s", flush=True)
        subprocess.run([*feeder, "status", "--target", address], check=False)
        if packing:
            from feeder.ops.status import fetch

            padding = {m.group(1): float(m.group(2)) for line in fetch(address).packings
                       if (m := re.match(r"(\w+) seq_len \d+: .* ([\d.]+)% padding", line))}
            print("   padding fraction of the bins: " + ", ".join(f"{k} {v:.2f}%" for k, v in padding.items()),
                  flush=True)
        total = sum(per_source.values())
        if total:
            print("   samples trained on, per source: " + ", ".join(
                f"{name} {n:,} ({100 * n / total:.1f}%)" for name, n in per_source.items())
                + " for weights code 0.7, docs 0.3", flush=True)
        if not packing:
            rc = pipeline(bin_dir, address)
            if rc:
                return rc
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    if len(losses) < 2 or losses[-1] >= losses[0]:
        print(f"loss did not fall: {losses}", file=sys.stderr)
        return 1
    print(f"demo ok{' (best-fit packing)' if packing else ''}: loss fell from {losses[0]:.3f} to {losses[-1]:.3f}; "
          f"feeder stopped cleanly "
          f"(exit {server.returncode})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
