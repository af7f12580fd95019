"""A tiny model trained under torchft (one process per replica group), fed by the feeder's live
elasticity (feeder_client.elastic) or, side by side, by torchft's own DistributedSampler.

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 1000 --bind [::]:29510 &
    python -m feeder_trainer.examples.torchft_train --group 0 --lighthouse http://127.0.0.1:29510 \\
        --data feeder --targets 127.0.0.1:7000,127.0.0.1:7001 --job j --replicas 3 --log g0.jsonl
    (the same with --group 1, --group 2, ...; a group that is killed is started again as it was)

Each step:

    optimizer.zero_grad()                 # OptimizerWrapper: manager.start_quorum()
    rank = manager.participating_rank()   # waits for the quorum; None while this group heals
    step = manager.current_step()         # read AFTER the quorum: a healed group jumps to the peers' step
    W = manager.num_participants()
    batches = feeder.step(step=step, replica=rank, replicas=W) if rank is not None else []
    loss = sum(per-sample losses) / step_samples * W   # torchft's allreduce averages over W
    loss.backward()                       # torchft DDP: the gradients' allreduce over the live groups
    committed = manager.should_commit()   # (what OptimizerWrapper.step() calls; it returns None)
    if committed: inner_optimizer.step()
    feeder.commit(step=step, committed=committed)

`--data torchft` replaces the feeder with torchft.data.DistributedSampler over range(--samples)
(the group's fixed shard, --batch samples a step), its position advanced on every attempt and
fast-forwarded to manager.current_step() after a heal, as torchft's maintainers advise
(`--ff always`: set to current_step() at every step, the best a per-group loader can do).

The log (--log, one JSON line each, appended and flushed): {"event": "start"} once; "dealt"
before the forward pass (this group's ids of the attempt, so a group killed after its gradient
went out is still accounted for); "step" after should_commit(), with "committed". Both carry
group, step, quorum (torchft's quorum id), replica (participating_rank(), None while healing),
replicas (num_participants()) and ids. `--phase FILE` holds where the loop is (forward,
backward = the allreduce, commit, between), for a harness that kills at a chosen moment.

torchft 0.2.0's DistributedDataParallel crashes a survivor whose peer dies mid-allreduce (its
comm hook asserts on a future that the failed wait never built): DDP below mends the hook.
bench/torchft_baseline.py runs groups of this script under kills; tests/test_elastic_torchft.py
judges them fed by the feeder.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--group", type=int, default=-1, help="replica group id (REPLICA_GROUP_ID)")
    p.add_argument("--zygote", action="store_true",
                   help="import everything, then fork a process per line GROUP OUTFILE read from stdin (a harness's "
                        "way to start and restart groups at once on a loaded machine; --log and --phase may hold "
                        "{group})")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", ""),
                   help="the Lighthouse's address, http://HOST:PORT (default $TORCHFT_LIGHTHOUSE)")
    p.add_argument("--data", choices=("feeder", "torchft"), default="feeder")
    p.add_argument("--steps", type=int, default=50, help="stop once this many steps have committed")
    p.add_argument("--log", required=True, help="append JSON lines here")
    p.add_argument("--phase", default="", help="write the loop's phase here (for a harness's kills)")
    p.add_argument("--min-replicas", type=int, default=2, help="the Manager's min_replica_size")
    p.add_argument("--timeout", type=float, default=10.0, help="torchft's timeout for collectives, commit, heal (s)")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="sleep this long in each forward pass and as much again between steps (so kills land mid-step)")
    p.add_argument("--ballast", type=int, default=1 << 20,
                   help="extra parameters (floats) so the gradient allreduce takes a while")
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    f = p.add_argument_group("--data feeder")
    f.add_argument("--targets", default="", help="HOST:PORT[,HOST:PORT...] of the feeders")
    f.add_argument("--job", default="torchft")
    f.add_argument("--micro-batch", type=int, default=2)
    f.add_argument("--accumulation", type=int, default=2)
    f.add_argument("--replicas", type=int, default=3, help="replica groups at the start (constant: G = mb*acc*this)")
    f.add_argument("--global-batch", choices=("constant", "shrink"), default="constant")
    f.add_argument("--dataset", default="")
    f.add_argument("--num-epochs", type=int, default=1)
    f.add_argument("--no-helper", dest="helper", action="store_false",
                   help="call feeder.step() with the manager's rank, step and world here instead of through "
                        "feeder_client.elastic.TorchftFeeder (the default)")
    t = p.add_argument_group("--data torchft")
    t.add_argument("--samples", type=int, default=6000, help="synthetic dataset: sample ids range(N)")
    t.add_argument("--batch", type=int, default=8, help="samples per group per step")
    t.add_argument("--groups", type=int, default=3, help="num_replica_groups of torchft's sampler")
    t.add_argument("--ff", choices=("heal", "always", "none"), default="heal",
                   help="heal: the loader advances every attempt and jumps to current_step() after a heal "
                        "(the maintainers' advice); always: its position is current_step() at every step; "
                        "none: train_ddp.py as written (a restarted group's loader starts again at 0)")
    return p.parse_args(argv)


class Phase:
    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if path else None

    def __call__(self, name: str) -> None:
        if self.fd is not None:
            os.pwrite(self.fd, name.ljust(16).encode(), 0)


def main(argv=None) -> int:
    args = parse(argv)
    if args.zygote:
        import torch._dynamo   # noqa: F401  (what DDP and the optimizer import on first use: 1-2 s of a start)
        import torch.nn.parallel   # noqa: F401
        import torchft   # noqa: F401

        if args.data == "feeder":
            import feeder_client.elastic   # noqa: F401
        print("ready", flush=True)
        args.group = zygote()   # returns in a forked child only
        try:
            rc = main_group(args)
        except BaseException:
            import traceback

            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc or 0)
    return main_group(args)


def zygote() -> int:
    """--zygote: this process has done the imports; each line "GROUP OUTFILE" on stdin forks a
    child that runs as that group (a new process: nothing of any group's state, only the imports),
    its output to OUTFILE; "pid GROUP PID" and, when a child ends, "exit PID CODE" (CODE: the
    exit status, or -SIGNAL) are printed on stdout. One thread, no torch work before a fork."""
    import select

    children: set[int] = set()
    while True:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:   # the harness is gone: so are we (children are killed by their group id)
            os._exit(0)
        gid, out = line.split(maxsplit=1)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            fd = os.open(out.strip(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            return int(gid)
        children.add(pid)
        print(f"pid {gid} {pid}", flush=True)


def main_group(args) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo

    if args.data == "feeder":
        from feeder_client.elastic import ElasticFeeder, TorchftFeeder
    if args.group < 0:
        raise SystemExit("--group is required (or --zygote)")
    args.log, args.phase = args.log.format(group=args.group), args.phase.format(group=args.group)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)   # every group starts from the same weights (init_sync also copies them)
    phase = Phase(args.phase)
    log = open(args.log, "a", buffering=1)

    def emit(**rec) -> None:
        log.write(json.dumps({**rec, "t": round(time.time(), 3)}) + "\n")
        log.flush()

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(args.vocab, args.dim)
            self.out = nn.Linear(args.dim, args.vocab)
            self.ballast = nn.Parameter(torch.zeros(max(1, args.ballast)))

        def forward(self, x):
            return self.out(self.emb(x)) + self.ballast[0] * 0.0

    class DDP(DistributedDataParallel):
        """torchft 0.2.0's DistributedDataParallel with its comm hook mended: when a peer dies
        mid-allreduce, torchft's hook raises AssertionError (`assert fut._fut`: the managed work's
        wait() swallowed the error, so its future chain was never built) and the SURVIVOR's
        backward() crashes; after an earlier error (manager.errored()) the work is a _DummyWork
        whose future has no `_fut` (AttributeError). Here the bucket is zeroed instead: the
        error is already reported to the manager, so should_commit() is False for the step."""

        @staticmethod
        def _comm_hook(state, bucket):
            buf = bucket.buffer()
            work = state.allreduce(buf)
            ok = work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if ok and inner is not None:
                return inner
            buf.zero_()
            done = torch.futures.Future()
            done.set_result(buf)
            return done

    model = Tiny()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    # A replica group of one process: its own TCPStore (the Manager connects to it as a client).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    manager = Manager(pg=pg, min_replica_size=args.min_replicas, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"group_{args.group}", lighthouse_addr=args.lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=args.quorum_timeout),
                      connect_timeout=timedelta(seconds=10))
    ddp = DDP(manager, model)
    optimizer = Optimizer(manager, inner)
    emit(event="start", group=args.group, pid=os.getpid(), data=args.data)

    feeder = helper = sampler_list = None
    if args.data == "feeder":
        feeder = ElasticFeeder([t for t in args.targets.split(",") if t], job=args.job, seq_len=args.seq_len,
                               micro_batch=args.micro_batch, accumulation=args.accumulation,
                               replicas=args.replicas, seed=args.seed, global_batch=args.global_batch,
                               dataset=args.dataset, num_epochs=args.num_epochs)
        helper = TorchftFeeder(feeder, manager) if args.helper else None
    else:
        sampler = DistributedSampler(range(args.samples), replica_rank=args.group, num_replica_groups=args.groups,
                                     group_rank=0, num_replicas=1, shuffle=True, seed=args.seed)
        sampler_list = list(sampler)
    pos = 0            # --data torchft: the group's loader position (in batches)
    first = True
    delay = args.delay_ms / 1000.0
    try:
        while manager.current_step() < args.steps:
            phase("quorum")
            optimizer.zero_grad()                       # start_quorum (async: runs beside the forward)
            step_before = manager.current_step()
            rank = manager.participating_rank()         # waits for the quorum
            step = manager.current_step()               # after a heal: the peers' step
            world = manager.num_participants()
            quorum = manager._quorum_id                 # (torchft keeps it private; for the logs)
            if args.data == "feeder":
                if helper is not None:
                    batches = helper.batches()
                else:
                    batches = feeder.step(step=step, replica=rank, replicas=world) if rank is not None else []
                tokens = torch.cat([b.tokens for b in batches]) if batches else None
                ids = [i for b in batches for i in b.sample_ids.tolist()]
                step_samples = batches[0].step_samples if batches else 0
                extra = {"parts": batches[0].parts if batches else 0, "step_samples": step_samples,
                         "feeder_steps": sorted({b.step for b in batches})}
            else:
                if (first and args.ff == "heal") or args.ff == "always":
                    pos = step                          # fast-forward to the step (after the heal)
                ids = sampler_list[pos * args.batch:(pos + 1) * args.batch]
                pos += 1
                base = torch.tensor(ids, dtype=torch.int64).unsqueeze(1) * 7
                tokens = (base + torch.arange(args.seq_len + 1)) % args.vocab if ids else None
                extra = {"pos": pos - 1}
            if first:
                extra["step_before_quorum"] = step_before
            emit(event="dealt", group=args.group, step=step, quorum=quorum, replica=rank, replicas=world,
                 ids=ids, **extra)
            phase("forward")
            if delay:
                time.sleep(delay)
            if tokens is not None and len(tokens):
                x, y = tokens[:, :-1], tokens[:, 1:]
                logits = ddp(x)
                per = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1), reduction="none")
                per = per.view(len(x), -1).mean(1)
                if args.data == "feeder":
                    # the step's summed loss over its step_samples; * W undoes the allreduce's average
                    loss = per.sum() * (world / step_samples)
                else:
                    loss = per.mean()
            else:   # nothing for this group in this step (healing, or fewer micro-batches than groups)
                loss = ddp(torch.zeros(0, args.seq_len, dtype=torch.int64)).sum() * 0.0
            phase("backward")
            loss.backward()                             # the allreduce, in DDP's comm hook
            phase("commit")
            committed = manager.should_commit()         # what OptimizerWrapper.step() asks
            if committed:
                inner.step()
            if feeder is not None:
                if helper is not None:
                    helper.commit(committed)
                elif rank is not None:
                    feeder.commit(step=step, committed=committed)
            emit(event="step", group=args.group, step=step, quorum=quorum, replica=rank, replicas=world,
                 committed=bool(committed), ids=ids, loss=float(loss.detach()), errored=manager.errored() is not None,
                 after=manager.current_step(), **({"first": True} if first else {}))
            first = False
            phase("between")
            if delay:
                time.sleep(delay)
            if feeder is not None and feeder.finished:
                break
    finally:
        phase("done")
    emit(event="end", group=args.group, step=manager.current_step())
    t = time.monotonic()
    if feeder is not None:
        feeder.close()   # (the commit reports still queued go out first)
    manager.shutdown(wait=False)
    emit(event="closed", group=args.group, seconds=round(time.monotonic() - t, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
