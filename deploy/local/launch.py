#!/usr/bin/env python3
"""Several regions on one host, for development: each region gets its own replica of the
dataset under ROOT/<region>/dataset and its own `feeder serve --config deploy/local/<region>.toml`.

    python deploy/local/launch.py --dataset DIR            # regions us-east, eu-west, ap-south
    python deploy/local/launch.py --dataset DIR --port-base 17100 --regions us-east,eu-west

Prints one JSON line once every region answers ({"regions": {name: HOST:PORT}, "pids": {...}}),
then waits; Ctrl-C or SIGTERM stops every region (SIGTERM each, so they drain). Without
--dataset it builds a small one from this Python's standard library sources.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REGIONS = ("us-east", "eu-west", "ap-south")


def replicate(src: Path, dst: Path) -> None:
    """A region's replica: hard links where the filesystem allows (cheap), else copies.
    The fingerprint hashes content, not paths, so every replica has the same one."""
    if dst.exists():
        shutil.rmtree(dst)

    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link)


def demo_dataset(root: Path) -> Path:
    out = root / "source-dataset"
    if (out / "manifest.json").exists():
        return out
    sys.path.insert(0, str(REPO))
    from feeder.ops.corpus import build_corpus

    corpus = root / "stdlib.jsonl"
    build_corpus(corpus, 2 << 20)
    subprocess.run([sys.executable, "-m", "feeder.cli", "prep", str(corpus), "--out", str(out), "--force",
                    "--quiet"], check=True, cwd=REPO)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", help="a `feeder prep` output directory (default: build a small one)")
    p.add_argument("--root", default=str(REPO / ".local-regions"), help="where replicas and logs live")
    p.add_argument("--regions", default=",".join(REGIONS), help="comma-separated; each needs deploy/local/NAME.toml")
    p.add_argument("--port-base", type=int, default=0,
                   help="listen on 127.0.0.1:BASE+i instead of the ports in the region files")
    p.add_argument("--extra", default="", help="more `feeder serve` flags for every region, space-separated")
    args = p.parse_args(argv)

    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    dataset = Path(args.dataset).resolve() if args.dataset else demo_dataset(root)
    if not (dataset / "manifest.json").exists():
        print(f"launch: {dataset} has no manifest.json (make one with `feeder prep`)", file=sys.stderr)
        return 2
    env = {**os.environ, "FEEDER_LOCAL": str(root)}
    procs: dict[str, subprocess.Popen] = {}
    addresses: dict[str, str] = {}
    names = args.regions.split(",")
    for i, name in enumerate(names):
        config = HERE / f"{name}.toml"
        if not config.exists():
            print(f"launch: no region file {config}", file=sys.stderr)
            return 2
        replicate(dataset, root / name / "dataset")
        cmd = [sys.executable, "-m", "feeder.cli", "serve", "--config", str(config), *args.extra.split()]
        if args.port_base:
            cmd += ["--listen", f"127.0.0.1:{args.port_base + i}", "--peers", ",".join(
                f"{other}=127.0.0.1:{args.port_base + j}" for j, other in enumerate(names) if other != name)]
        log = open(root / name / "feeder.log", "ab")
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    for name, proc in procs.items():
        line = proc.stdout.readline()
        if "listening on" not in line:
            print(f"launch: region {name} did not start (see {root / name / 'feeder.log'})", file=sys.stderr)
            for q in procs.values():
                q.terminate()
            return 1
        addresses[name] = line.rsplit(" ", 1)[1].strip()
    print(json.dumps({"regions": addresses, "pids": {n: q.pid for n, q in procs.items()}, "root": str(root)}),
          flush=True)

    def stop(*_):
        for q in procs.values():
            if q.poll() is None:
                q.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for q in procs.values():
        q.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
