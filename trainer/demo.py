"""`make demo`: the main job on an embedded default, no arguments.

Builds a real text corpus available offline (this Python's standard library sources and
docs), runs `feeder prep`, starts a feeder, trains the model with DeepSpeed on 2 ranks for a
few hundred steps, shows the loss falling and the feed's throughput, stops everything.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from feeder.corpus import build_corpus
from feeder.net import free_port

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "demo"


def main() -> int:
    WORK.mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    feeder = [sys.executable, "-m", "feeder.cli"]
    corpus = WORK / "stdlib.jsonl"
    print(f"== 1/4 corpus: Python {sys.version.split()[0]} standard library sources and docs", flush=True)
    n = build_corpus(corpus)
    print(f"   {n / 1e6:.1f} MB of text in {corpus}", flush=True)
    print("== 2/4 feeder prep (byte tokenizer)", flush=True)
    subprocess.run([*feeder, "prep", str(corpus), "--out", str(WORK / "shards"), "--force",
                    "--shard-tokens", str(4 << 20)], check=True)
    print("== 3/4 feeder serve", flush=True)
    server = subprocess.Popen([*feeder, "serve", "--source", str(WORK / "shards"), "--listen", "127.0.0.1:0",
                               "--region", "demo"], stdout=subprocess.PIPE, stderr=open(WORK / "feeder.log", "w"),
                              text=True)
    try:
        line = server.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        if not m:
            print(f"feeder did not start; see {WORK / 'feeder.log'}", file=sys.stderr)
            return 1
        address = m.group(1)
        print(f"   {line.strip()}", flush=True)
        print("== 4/4 DeepSpeed training, 2 ranks (nccl on GPU, gloo on CPU), fed only by the feeder", flush=True)
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               str(Path(__file__).resolve().parent / "train.py"), "--targets", address, "--job", "demo", "--steps",
               os.environ.get("DEMO_STEPS", "300"), "--seq-len", "128", "--micro-batch", "8", "--log-every", "25",
               "--ckpt-dir", str(WORK / "checkpoints"), "--save-every", "150"]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=WORK)
        losses = []
        for out in proc.stdout:
            # DeepSpeed's own INFO/WARNING chatter goes to the log; our lines to the screen
            if re.match(r"^(model|step|done|resumed|error)", out):
                print("   " + out.rstrip(), flush=True)
                if out.startswith("step"):
                    losses.append(float(out.split("loss")[1].split()[0]))
        rc = proc.wait()
        if rc != 0:
            print(f"training failed with exit code {rc}", file=sys.stderr)
            return rc
        print(f"   training took {time.monotonic() - t0:.0f}s", flush=True)
        subprocess.run([*feeder, "status", "--target", address], check=False)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
    if len(losses) < 2 or losses[-1] >= losses[0]:
        print(f"loss did not fall: {losses}", file=sys.stderr)
        return 1
    print(f"demo ok: loss fell from {losses[0]:.3f} to {losses[-1]:.3f}; feeder stopped cleanly "
          f"(exit {server.returncode})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
