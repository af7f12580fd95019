"""Reference DeepSpeed training fed by the token feeder.

    deepspeed --num_gpus 2 trainer/train.py --targets HOST:PORT[,HOST:PORT...] --job NAME ...

nccl on GPU, gloo on CPU. Reads only from the feeder; logs loss, tokens/s and the share
of step time spent waiting for data; saves every rank's feeder cursor inside each
DeepSpeed checkpoint (client_state), and `--resume` continues the data stream exactly
where the checkpoint left it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from feeder.service.security import ClientSecurity
from feeder_client import FeederDataset, feeder_info
from feeder_client.packing import megatron_inputs

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", required=True, help="feeder addresses, comma separated: HOST:PORT or "
                   "REGION=HOST:PORT (one per region; each rank streams from the nearest and fails over)")
    p.add_argument("--prefer", default="rtt", choices=["rtt", "order"],
                   help="rtt: nearest region first, by measured round trip; order: as given")
    p.add_argument("--slow-wait", type=float, default=0.05,
                   help="move off a feeder that leaves the loop waiting more than this fraction of its time "
                        "(0: only on errors and silence; docs/guarantees.md, Slow, not dead)")
    p.add_argument("--hedge", action="store_true",
                   help="while the read-ahead runs low, read the next batches from a second feeder too and take "
                        "the first copy (costs bandwidth, saves waits)")
    p.add_argument("--tls-ca", default="", help="CA of the feeders' certificates (TLS)")
    p.add_argument("--tls-cert", default="", help="this job's client certificate (feeders with mutual TLS)")
    p.add_argument("--tls-key", default="")
    p.add_argument("--token-file", default="", help="the job's bearer token (feeders with --tokens-file)")
    p.add_argument("--job", default="train")
    p.add_argument("--model-size", default="tiny", help="tiny | small | base | 1b")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to reach (counting resumed ones)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=0, help="epochs of data to stream (0: as many as needed)")
    p.add_argument("--ds-config", default=str(HERE / "ds_config.json"))
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--log-ids", default="", help="append every consumed batch's sample ids to DIR/rank{R}.jsonl")
    p.add_argument("--compression", default="zstd", choices=["zstd", "none"])
    p.add_argument("--mixture", default="", help="draw from the feeders' named sources by weight: "
                   "NAME=WEIGHT,... (e.g. web=0.7,code=0.3); logs the loss per source")
    p.add_argument("--mixture-schedule", default="", metavar="FILE.toml",
                   help="draw from the feeders' named sources with weights that change with training progress "
                   "([[segment]] tables: docs/mixtures.md, \"Schedules\"); logs the loss per source. An operator "
                   "may change it while the job runs (feeder mix)")
    p.add_argument("--max-read-ahead", type=int, default=64, help="batches a rank may hold ahead of its loop (the "
                   "client's adaptive read-ahead grows up to this; it also bounds gRPC's window)")
    p.add_argument("--remix", action="store_true", help="with --resume: continue under a --mixture other than "
                   "the checkpoint's (the epoch's rest re-dealt under the new weights)")
    # Document-aware samples (docs/packing.md): Megatron-LM's three flags, from the boundaries the
    # feeder serves (each asks for them), and best-fit packing of whole documents.
    p.add_argument("--packing", default="concat", choices=["concat", "best_fit"],
                   help="concat: windows of the documents concatenated; best_fit: bins of whole documents, padded")
    p.add_argument("--reset-position-ids", action="store_true", help="positions restart at each document")
    p.add_argument("--reset-attention-mask", action="store_true", help="attention stays inside each document")
    p.add_argument("--eod-mask-loss", action="store_true", help="no loss where the input is the EOD (EOS) token")
    p.add_argument("--crash-at-step", type=int, default=0, help="fault injection: rank 0 dies at this step")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the launcher
    return p.parse_args(argv)


def ds_config(args, on_gpu: bool) -> dict:
    cfg = json.loads(Path(args.ds_config).read_text())
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg["gradient_accumulation_steps"] = args.grad_accum
    cfg["optimizer"]["params"]["lr"] = args.lr
    cfg["bf16"] = {"enabled": bool(on_gpu and torch.cuda.is_bf16_supported())}
    return cfg


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer_"   # DeepSpeed's shm.cpp: {prefix}{uid}_{addr}_{port}_{rank}


def release_shm_names(rank: int) -> int:
    """Unlink this rank's segment of DeepSpeed's CPU shared-memory all-reduce; returns how many.

    On a CPU host DeepSpeed builds that op and, when every rank is local, gives each rank a
    66 MiB POSIX segment that it never unlinks: each run of 2 ranks left 132 MiB of RAM
    behind, and 150 runs filled 20 GiB of a 24 GiB host, where a later test run stalled.
    DeepSpeed's initialize maps every peer's segment before it returns, so after a barrier the
    names are no longer needed: unlinked now, the kernel frees the memory when the ranks exit,
    however they exit (a crash included)."""
    name = f"{SHM_PREFIX}{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_{os.environ.get('MASTER_PORT', '')}_{rank}"
    try:
        os.unlink(SHM_DIR / name)
        return 1
    except FileNotFoundError:   # a GPU host, ranks on several hosts, or no shm op
        return 0


def clear_orphaned_shm(min_age_s: float = 60.0) -> tuple[int, int]:
    """Remove this user's DeepSpeed segments that earlier runs left (those of trainers without
    release_shm_names): ones no process maps and older than min_age_s, so a segment a starting
    job has just created is never taken. Returns (segments, bytes) freed."""
    mine = list(SHM_DIR.glob(f"{SHM_PREFIX}{os.getuid()}_*"))
    if not mine:
        return 0, 0
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(re.findall(rf"/dev/shm/({SHM_PREFIX}\S+)", maps.read_text()))
        except OSError:   # gone meanwhile, or not ours to read (then its segments are not ours)
            continue
    count = freed = 0
    for seg in mine:
        try:
            st = seg.stat()
            if seg.name in mapped or time.time() - st.st_mtime < min_age_s:
                continue
            seg.unlink()
        except FileNotFoundError:
            continue
        count, freed = count + 1, freed + st.st_size
    return count, freed


def init_distributed(deepspeed, on_gpu: bool) -> tuple[int, int]:
    """Join the process group (nccl on GPU, gloo on CPU), first freeing the shared-memory
    segments earlier runs left (local rank 0 only) and after it this rank's own segment name;
    returns (rank, world size)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        n, freed = clear_orphaned_shm()
        if n:
            print(f"freed {n} shared-memory segments ({freed >> 20} MiB) that earlier DeepSpeed runs left in "
                  f"{SHM_DIR}", flush=True)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has mapped its peers' shm segments: their names can go
    release_shm_names(rank)
    return rank, world


def parse_targets(spec: str) -> dict[str, str] | list[str]:
    """--targets: REGION=HOST:PORT,... as a dict of regions, else HOST:PORT,... as a list."""
    entries = [t for t in spec.split(",") if t]
    return dict(e.split("=", 1) for e in entries) if all("=" in e for e in entries) else entries


def agree_on_dataset(targets, security: ClientSecurity):
    """The feeders' Info, and the dataset fingerprint every rank will expect: rank 0's."""
    info = feeder_info(list(targets.values()) if isinstance(targets, dict) else targets, security=security)
    # Every rank must expect the same dataset: for a Kafka topic, Info names the epoch a job
    # starting now would read, and the topic may grow between two ranks' calls. Rank 0's wins.
    fingerprint = [info.fingerprint]
    dist.broadcast_object_list(fingerprint, src=0)
    return info, fingerprint[0]


def resume_point(args, engine, world: int, rank: int, say):
    """(cursor, reshard, step) to start from: the latest checkpoint's with --resume, else the
    start; None when --resume finds no checkpoint."""
    if not args.resume:
        return None, False, 0
    path, state = engine.load_checkpoint(args.ckpt_dir)
    if path is None:
        say(f"error: no checkpoint in {args.ckpt_dir} to resume from")
        return None
    cursors, step = state["feeder_cursors"], state["step"]
    # Same world: each rank continues its own stream. Another world: re-deal the epoch's rest.
    reshard = len(cursors) != world
    cursor = cursors[0] if reshard else cursors[rank]
    say(f"resumed from {path} at step {step} ({'re-dealt from world ' + str(len(cursors)) if reshard else 'same world'})")
    return cursor, reshard, step


def mixture_names(args) -> list[str]:
    """The sources of --mixture or --mixture-schedule, in order (a batch's `sources` index them)."""
    if getattr(args, "mixture_schedule", ""):
        from feeder.core import schedule as sc
        from feeder.core.config import load_toml

        return list(sc.parse(load_toml(args.mixture_schedule), seq_len=args.seq_len).names)
    return list(parse_mixture(args.mixture))


def parse_mixture(spec: str) -> dict[str, float]:
    """--mixture NAME=WEIGHT,... as {name: weight}, in order; {} without."""
    out = {}
    for part in (p for p in spec.split(",") if p):
        name, sep, weight = part.partition("=")
        try:
            out[name] = float(weight) if sep and name else None
        except ValueError:
            out[name] = None
        if out[name] is None:
            raise SystemExit(f"--mixture must be NAME=WEIGHT,..., got {spec!r}")
    return out


def make_dataset(args, targets, rank: int, world: int, cursor, reshard: bool, fingerprint: str):
    """This rank's FeederDataset from the flags (shuffled, seeded, from `cursor` when resuming)."""
    mixture = parse_mixture(args.mixture)
    schedule = args.mixture_schedule or None
    # A mixture's sources are bound by their fingerprints in every cursor; the Info fingerprint
    # every rank agrees on is the default dataset's, which a mixture need not read.
    return FeederDataset(targets, job=args.job, rank=rank, world_size=world, seq_len=args.seq_len,
                         mixture=mixture or None, remix=args.remix, mixture_schedule=schedule,
                         micro_batch=args.micro_batch, seed=args.seed, shuffle=True, epoch=0,
                         num_epochs=args.epochs, cursor=cursor, reshard=reshard,
                         expected_fingerprint="" if mixture or schedule else fingerprint,
                         compression=args.compression,
                         prefer=args.prefer, packing=args.packing, boundaries=wants_boundaries(args),
                         tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                         token_file=args.token_file, slow_wait=args.slow_wait, hedge=args.hedge,
                         max_read_ahead=args.max_read_ahead, read_ahead=min(8, args.max_read_ahead))


def wants_boundaries(args) -> bool:
    return args.packing != "concat" or args.reset_position_ids or args.reset_attention_mask or args.eod_mask_loss


@dataclass
class Run:
    """What the training loop works with: the flags, this rank's place, engine, data, log."""
    args: argparse.Namespace
    rank: int
    world: int
    engine: Any
    data: Any            # FeederDataset
    batches: Iterator
    say: Callable[..., None]
    ids_log: Any = None  # DIR/rank{R}.jsonl with --log-ids
    eos_id: int = -1     # the dataset's (Megatron's EOD, for --eod-mask-loss)


def meter() -> dict:
    """Accumulators of one logging window (or of the whole run)."""
    return {"t": time.monotonic(), "wait": 0.0, "tokens": 0, "loss": 0.0, "n": 0, "src_loss": {}, "src_n": {}}


def save_checkpoint(run: Run, step: int) -> None:
    """A DeepSpeed checkpoint whose client_state holds every rank's feeder cursor."""
    cursors = [None] * run.world
    dist.all_gather_object(cursors, run.data.state_dict()["cursor"])  # DeepSpeed keeps rank 0's client_state
    run.engine.save_checkpoint(run.args.ckpt_dir, tag=f"step{step}", client_state={"feeder_cursors": cursors,
                                                                                  "step": step})


def one_step(run: Run, step: int, window: dict, total: dict) -> bool:
    """One optimizer step of --grad-accum micro-batches; False when the data ended first."""
    for micro in range(run.args.grad_accum):
        t0 = time.monotonic()
        batch = next(run.batches, None)
        waited = time.monotonic() - t0
        if batch is None:
            return False
        tokens = batch.tokens.to(run.engine.device, non_blocking=True)
        kw = {}
        if batch.boundaries is not None:   # Megatron's masks from the served boundaries
            a = run.args
            m = megatron_inputs(batch, eod_token=run.eos_id, reset_position_ids=a.reset_position_ids,
                                reset_attention_mask=a.reset_attention_mask, eod_mask_loss=a.eod_mask_loss)
            kw = {k: m[k].to(run.engine.device, non_blocking=True) for k in ("position_ids", "loss_mask")}
            if a.reset_attention_mask:
                kw["attention_mask"] = m["attention_mask"].to(run.engine.device, non_blocking=True)
        if batch.sources is None:
            loss = run.engine(tokens, **kw)
        else:   # a mixture: each sample's loss, summed per source for the log
            loss, each = run.engine(tokens, per_sample=True, **kw)
            each = each.detach().float().cpu()
            for d in batch.sources.unique().tolist():
                sel = batch.sources == d
                window["src_loss"][d] = window["src_loss"].get(d, 0.0) + each[sel].sum().item()
                window["src_n"][d] = window["src_n"].get(d, 0) + int(sel.sum())
        run.engine.backward(loss)
        run.engine.step()
        n_tok = tokens.shape[0] * (tokens.shape[1] - 1)
        for acc in (window, total):
            acc["wait"] += waited
            acc["tokens"] += n_tok
        window["loss"] += loss.item()
        window["n"] += 1
        if run.ids_log:
            rec = {"step": step, "micro": micro, "epoch": batch.epoch, "ids": batch.sample_ids.tolist()}
            if batch.sources is not None:
                rec["sources"] = batch.sources.tolist()
            run.ids_log.write(json.dumps(rec) + "\n")
    return True


def log_window(run: Run, step: int, window: dict) -> float:
    """Print the window's loss, tokens/s and data-wait share over all ranks; its mean loss."""
    stats = torch.tensor([window["loss"], window["n"], window["tokens"], window["wait"]], dtype=torch.float64)
    dist.all_reduce(stats)
    dt = time.monotonic() - window["t"]
    mean_loss = stats[0].item() / max(1, stats[1].item())
    per_source = ""
    names = mixture_names(run.args)
    if names:   # every rank sums every source's loss and count, so all take part in the reduce
        src = torch.tensor([[window["src_loss"].get(d, 0.0), window["src_n"].get(d, 0)] for d in range(len(names))],
                           dtype=torch.float64)
        dist.all_reduce(src)
        per_source = "  " + " ".join(f"{n} {src[d, 0].item() / max(1.0, src[d, 1].item()):.4f} "
                                     f"({int(src[d, 1].item())})" for d, n in enumerate(names))
    run.say(f"step {step:5d}  loss {mean_loss:.4f}  tokens/s {stats[2].item() / dt:,.0f}  "
            f"data-wait {100 * stats[3].item() / run.world / dt:.2f}%{per_source}")
    return mean_loss


def train_steps(run: Run, step: int) -> tuple[int, float | None, float | None, dict]:
    """Steps from `step` to --steps or the end of the data, logging, checkpointing and (fault
    injection) crashing as the flags say; (last step, first and last logged loss, totals)."""
    args = run.args
    first_loss = last_loss = None
    window, total = meter(), meter()
    while step < args.steps:
        if not one_step(run, step, window, total):
            break
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            last_loss = log_window(run, step, window)
            first_loss = last_loss if first_loss is None else first_loss
            window = meter()
        if args.ckpt_dir and args.save_every and step % args.save_every == 0:
            save_checkpoint(run, step)
        if run.rank == 0 and step == args.crash_at_step:
            if run.ids_log:
                run.ids_log.flush()
            os._exit(17)  # no cleanup, like a segfault or an OOM kill
    return step, first_loss, last_loss, total


def report(run: Run, step: int, first_loss, last_loss, total: dict) -> None:
    """The run's last line: steps, loss first -> last, tokens/s, data-wait share, region."""
    dt = time.monotonic() - total["t"]
    t = torch.tensor([total["tokens"], total["wait"]], dtype=torch.float64)
    dist.all_reduce(t)
    run.say(f"done: {step} steps, loss {first_loss:.4f} -> {last_loss:.4f}, {t[0].item() / dt:,.0f} tokens/s, "
            f"data-wait {100 * t[1].item() / run.world / dt:.2f}% of step time, fed from region {run.data.region}"
            if first_loss is not None else f"done: {step} steps")


def main(argv=None) -> int:
    """Train from the flags (see parse_args); 0, or 2 when --resume finds no checkpoint."""
    import deepspeed

    if __package__:
        from .model import DecoderLM, config_for
    else:  # run as a file (`deepspeed trainer/train.py`): no package, so by its installed name
        from feeder_trainer.model import DecoderLM, config_for

    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    rank, world = init_distributed(deepspeed, on_gpu)
    torch.manual_seed(args.seed)
    targets = parse_targets(args.targets)
    security = ClientSecurity(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token_file=args.token_file)
    info, fingerprint = agree_on_dataset(targets, security)
    model = DecoderLM(config_for(args.model_size, info.vocab_size, args.seq_len))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(args, on_gpu))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say(f"model {args.model_size}: {model.n_params() / 1e6:.2f}M parameters, vocab {info.vocab_size}, "
        f"world {world}, device {engine.device}, dataset {info.fingerprint[:12]} from region {info.region}")
    start = resume_point(args, engine, world, rank, say)
    if start is None:
        return 2
    cursor, reshard, step = start
    data = make_dataset(args, targets, rank, world, cursor, reshard, fingerprint)
    run = Run(args, rank, world, engine, data, iter(data), say, eos_id=info.eos_id)
    if args.log_ids:
        Path(args.log_ids).mkdir(parents=True, exist_ok=True)
        run.ids_log = open(Path(args.log_ids) / f"rank{rank}.jsonl", "a", buffering=1)  # lines survive a crash
    step, first_loss, last_loss, total = train_steps(run, step)
    if run.ids_log:
        run.ids_log.close()
    report(run, step, first_loss, last_loss, total)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
