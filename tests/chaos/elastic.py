"""Elastic scenarios (issue 43): the replicas of a live-elastic job leave, join, die inside a step
and come back with nothing, while feeders are killed, stopped and restarted under them.

One integer decides a scenario: the corpus, the job (policy, micro-batch, accumulation, replicas
at start, epochs, order, drop_last), the feeders, and the faults with the attempt they hit:

  churn    a replica dies while it reads its part of a step (its stream cut at a random moment):
           the attempt does not commit; a new replica with no state takes its place a few
           attempts later (torchft: a group restarted and healed)
  join     a new replica joins (a new group: no state from anyone)
  leave    a replica leaves for good (the world shrinks until someone joins)
  abort    every replica has its part and the step does not commit (should_commit() false)
  sigkill, sigterm, sigstop
           a feeder is killed, stopped on SIGTERM or frozen; restarted (continued) some
           hundreds of milliseconds later; its replicas fail over to another feeder of the
           region (targets 2) or wait for it (targets 1)

Replicas are ElasticFeeders in this process, each reading on its own threads as a trainer
process would (what a replica dying does to the feeder, a stream cut mid-step, is the same);
feeders are real `feeder serve` processes sharing a cache directory (the commit log). Every
attempt is checked against the oracle (tests/elastic_oracle.py, from DistributedSampler alone),
every sample's tokens against the corpus, each epoch as a whole, and the feeders' ledgers with
`feeder audit`. tests/test_elastic_torchft.py runs real torchft processes.
"""
from __future__ import annotations

import random
import signal
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ELASTIC_KINDS = ("churn", "join", "leave", "abort", "sigkill", "sigterm", "sigstop")
FEEDER_KINDS = ("sigkill", "sigterm", "sigstop")
MAX_ATTEMPTS = 400


@dataclass(frozen=True)
class Hit:
    kind: str
    attempt: int
    heal_ms: int = 0      # feeder faults: restart / SIGCONT after this long
    after: int = 0        # churn: the replacement joins this many attempts later
    cut_ms: int = 0       # churn: the dying replica's stream is cut this long into its read
    target: int = 0

    def describe(self) -> str:
        extra = f"+{self.heal_ms}ms f{self.target}" if self.kind in FEEDER_KINDS else \
            (f"~{self.cut_ms}ms back+{self.after}" if self.kind == "churn" else "")
        return f"{self.kind}@a{self.attempt}{extra}"


@dataclass(frozen=True)
class ElasticScenario:
    seed: int
    n_docs: int
    seq_len: int
    micro_batch: int
    accumulation: int
    replicas: int
    policy: str
    num_epochs: int
    drop_last: bool
    shuffle: bool
    permutation: str
    data_seed: int
    targets: int
    read_ahead: int
    message_bytes: int
    hits: tuple[Hit, ...]

    @property
    def job(self) -> str:
        return f"elastic-{self.seed}"

    def describe(self) -> str:
        return (f"elastic seed={self.seed} docs={self.n_docs} seq={self.seq_len} mb={self.micro_batch} "
                f"acc={self.accumulation} replicas={self.replicas} {self.policy} epochs={self.num_epochs} "
                f"drop_last={int(self.drop_last)} shuffle={int(self.shuffle)} {self.permutation} "
                f"targets={self.targets} ra={self.read_ahead} msg={self.message_bytes} "
                f"faults=[{' '.join(h.describe() for h in self.hits)}]")

    @staticmethod
    def from_seed(seed: int) -> "ElasticScenario":
        rng = random.Random(f"elastic-{seed}")
        s = dict(seed=seed, n_docs=rng.choice((40, 60, 100)), seq_len=rng.choice((16, 32, 64)),
                 micro_batch=rng.choice((1, 2, 4)), accumulation=rng.choice((1, 2, 3)),
                 replicas=rng.choice((1, 2, 2, 3, 3, 4)), policy=rng.choice(("constant", "shrink")),
                 num_epochs=rng.choice((1, 1, 2)), drop_last=rng.random() < 0.3, shuffle=rng.random() < 0.9,
                 permutation=rng.choice(("torch", "torch", "stateless")), data_seed=rng.randint(0, 999),
                 targets=rng.choice((1, 2, 2)), read_ahead=rng.choice((1, 2, 8)),
                 message_bytes=rng.choice((512, 4096, 1 << 20)))
        # Attempts a scenario spans, roughly (the corpus is ~115 tokens a document).
        per_step = s["micro_batch"] * s["accumulation"] * s["replicas"]
        horizon = max(3, s["n_docs"] * 115 // s["seq_len"] * s["num_epochs"] // per_step)
        hits: list[Hit] = []
        # Replica churn in every scenario; feeder faults and the rest drawn beside it.
        kinds = ["churn"] + [rng.choice(ELASTIC_KINDS) for _ in range(rng.choice((1, 2, 3)))]
        for kind in kinds:
            # (the horizon is an estimate: churn comes in its first half, so every scenario has it)
            at = rng.randint(0, max(0, (horizon // 2 if kind == "churn" else horizon) - 2))
            if kind in FEEDER_KINDS:
                hits.append(Hit(kind, at, heal_ms=rng.choice((200, 600, 1500)), target=rng.randrange(s["targets"])))
            elif kind == "churn":
                hits.append(Hit(kind, at, after=rng.randint(1, 3), cut_ms=rng.choice((0, 2, 10, 40))))
            else:
                hits.append(Hit(kind, at))
        return ElasticScenario(**s, hits=tuple(sorted(hits, key=lambda h: h.attempt)))


class ElasticRun:
    def __init__(self, sc: ElasticScenario, workdir: Path, cache: Path):
        from tests.chaos.runner import corpus

        self.sc, self.dir = sc, workdir
        self.rng = random.Random(f"elastic-run-{sc.seed}")
        self.corpus = corpus(cache, sc.n_docs)
        self.n = self.corpus.samples(sc.seq_len, "concat")
        self.errors: list[str] = []
        self.injected: Counter = Counter()
        self.samples = 0
        self.feeders: list = []
        self.replicas: list = []      # live ElasticFeeders, in replica order
        self.returning: list[int] = []   # attempts at which a churned replica's replacement joins
        self.timers: list[threading.Timer] = []
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="elastic-replica")

    # -- processes
    def setup(self) -> None:
        from tests.chaos.runner import Feeder

        (self.dir / "cache").mkdir(exist_ok=True)
        args = ["--cache-dir", str(self.dir / "cache"), "--message-bytes", str(self.sc.message_bytes),
                "--prefetch-messages", "2"]
        for t in range(self.sc.targets):
            f = Feeder(self.corpus.dataset, args, self.dir / f"ledger-{t}.jsonl", self.dir / f"feeder-{t}.log", 1)
            f.wait_ready()
            self.feeders.append(f)

    def replica(self):
        from feeder_client.elastic import ElasticFeeder

        sc = self.sc
        return ElasticFeeder([f.address for f in self.feeders], job=sc.job, seq_len=sc.seq_len,
                             micro_batch=sc.micro_batch, accumulation=sc.accumulation, replicas=sc.replicas,
                             seed=sc.data_seed, global_batch=sc.policy, num_epochs=sc.num_epochs,
                             drop_last=sc.drop_last, shuffle=sc.shuffle, permutation=sc.permutation,
                             read_ahead=sc.read_ahead, prefer="order", idle_timeout_s=3.0, keepalive_s=2.0,
                             retry_for_s=90.0, connect_timeout_s=60.0, failback_s=0.0,
                             # (each replica a trainer process of its own, as the feeders' fence knows them:
                             # here they share one, and a dead replica's late reconnect was taken for
                             # its own process's: soak seed 980068)
                             client_started_ns=time.time_ns())

    def feeder_fault(self, h: Hit) -> None:
        f = self.feeders[h.target]
        pid = f.proc.pid
        self.injected[h.kind] += 1
        if h.kind == "sigstop":
            f.proc.send_signal(signal.SIGSTOP)
            self.later(h.heal_ms, f.proc.send_signal, signal.SIGCONT)
            return
        f.proc.send_signal(signal.SIGKILL if h.kind == "sigkill" else signal.SIGTERM)
        self.later(h.heal_ms, self.restart, h.target, pid)

    def restart(self, t: int, pid: int) -> None:
        """(On a timer: a restart that fails is the scenario's failure, not a thread's silent end.)"""
        f = self.feeders[t]
        if f.proc.pid != pid:
            return
        f.wait_dead()
        for attempt in range(3):   # (its port may take a moment to be free again)
            try:
                f.start()
                return
            except RuntimeError as e:
                why = e
                time.sleep(0.5)
        self.errors.append(f"feeder {t} did not come back after its {pid} was stopped: {why}")

    def later(self, ms: int, fn, *args) -> None:
        timer = threading.Timer(ms / 1000, fn, args)
        timer.daemon = True
        timer.start()
        self.timers.append(timer)

    # -- the job
    def run(self) -> None:
        from tests.elastic_oracle import Oracle

        sc = self.sc
        self.setup()
        self.replicas = [self.replica() for _ in range(sc.replicas)]
        oracle = Oracle(n=self.n, w0=sc.replicas, mb=sc.micro_batch, acc=sc.accumulation, drop_last=sc.drop_last,
                        seed=sc.data_seed, permutation=sc.permutation, shuffle=sc.shuffle, policy=sc.policy)
        committed: dict[int, Counter] = {}
        widest = sc.replicas
        step = 0
        hits = list(sc.hits)
        # (the most steps the job can take: every step in a world of one, under shrink)
        limit = 2 * -(-self.n // (sc.micro_batch * sc.accumulation)) * sc.num_epochs + MAX_ATTEMPTS
        for attempt in range(limit):
            due = [h for h in hits if h.attempt <= attempt]
            hits = [h for h in hits if h.attempt > attempt]
            while attempt in self.returning:   # a churned replica's replacement: a new process, no state
                self.returning.remove(attempt)
                self.replicas.append(self.replica())
            victim = None
            for h in due:
                if h.kind in FEEDER_KINDS:
                    self.feeder_fault(h)
                elif h.kind == "join":
                    self.replicas.append(self.replica())
                    self.injected["join"] += 1
                elif h.kind == "leave" and len(self.replicas) > 1:
                    self.replicas.pop(self.rng.randrange(len(self.replicas))).close()
                    self.injected["leave"] += 1
                elif h.kind == "churn" and victim is None:
                    victim = h
            if victim is not None:   # (chosen once the joins and leaves of this attempt are done)
                # (shrink: the last replica's death loses where the job stands, as it would under
                # torchft, whose quorum needs a survivor to heal from: a restart from a checkpoint)
                last = len(self.replicas) < (2 if sc.policy == "shrink" else 1)
                victim = None if last else (self.rng.randrange(len(self.replicas)), victim)
            world = len(self.replicas)
            if world == 0:   # the only replica died: nobody trains until its replacement is back
                continue
            widest = max(widest, world)
            if victim is not None:   # it dies while reading its part: cut at a random moment
                i, h = victim
                doomed = self.replicas[i]
                self.later(h.cut_ms, doomed.close)
            futures = [self.pool.submit(f.step, step, r, world) for r, f in enumerate(self.replicas)]
            parts, failed = [], False
            for r, fut in enumerate(futures):
                try:
                    parts.append(fut.result(timeout=120))
                except Exception as e:   # noqa: BLE001 - the victim's read ends in an error; any other is a failure
                    if victim is not None and r == victim[0]:
                        parts.append(None)
                        failed = True
                        continue
                    self.errors.append(f"attempt {attempt} step {step}: replica {r} of {world} raised "
                                       f"{type(e).__name__}: {e}")
                    return
            alive = [(f, p) for r, (f, p) in enumerate(zip(self.replicas, parts)) if victim is None or r != victim[0]]
            if alive and all(f.finished for f, _ in alive) and not any(p for _, p in alive):
                break   # every epoch dealt
            if victim is not None:   # dead before the allreduce: the attempt fails for everyone
                self.injected["churn"] += 1
                self.replicas.pop(victim[0])
                self.returning.append(attempt + victim[1].after)
                failed = True
            ok = self.check(attempt, step, world, parts, oracle) if not failed else None
            commit = not failed and ok is not None and not any(h.kind == "abort" for h in due)
            if any(h.kind == "abort" for h in due):
                self.injected["abort"] += 1
            for f in self.replicas:   # (the victim is gone: it reports nothing)
                f.commit(step, commit)
            if commit:
                epoch, got, after = ok
                committed.setdefault(epoch, Counter()).update(got)
                if after is not None:
                    oracle.commit(after)
                step += 1
            if self.errors:
                return
        else:
            self.errors.append(f"no end after {limit} attempts")
            return
        for epoch in range(sc.num_epochs):
            why = oracle.epoch_whole(epoch, committed.get(epoch, Counter()), widest + 2)
            if why:
                self.errors.append(why)

    def check(self, attempt: int, step: int, world: int, parts: list, oracle) -> tuple | None:
        sc = self.sc
        got = Counter()
        totals = set()
        for r, p in enumerate(parts):
            for b in p:
                ids = b.sample_ids.tolist()
                rows = self.corpus.rows(ids, sc.seq_len, "concat")
                if rows is None or not (b.tokens.numpy() == rows).all():
                    self.errors.append(f"attempt {attempt} step {step}: replica {r} of {world}: tokens are not "
                                       f"the samples' {ids}")
                if b.step != step or b.parts != len(p):
                    self.errors.append(f"attempt {attempt} step {step}: replica {r}: batch says step {b.step}, "
                                       f"{b.parts} parts, got {len(p)}")
                totals.add(b.step_samples)
                got.update(ids)
        self.samples += sum(got.values())
        if sc.policy == "constant":
            epoch, want = oracle.constant(step)
            after = None
        else:
            epoch, want, after = oracle.shrink(world)
        if got != want:
            self.errors.append(f"attempt {attempt} step {step} in a world of {world}: {sum((want - got).values())} "
                               f"samples missing, {sum((got - want).values())} not the step's")
            return None
        if totals and totals != {sum(got.values())}:
            self.errors.append(f"attempt {attempt} step {step}: step_samples {sorted(totals)}, the step has "
                               f"{sum(got.values())}")
        return epoch, got, after

    def audit(self) -> None:
        from feeder.ops.audit import audit

        verdicts = audit([str(self.dir / f"ledger-{t}.jsonl") for t in range(self.sc.targets)], job=self.sc.job)
        for v in verdicts:
            if not v["exactly_once"]:
                self.errors.append(f"feeder audit: {v}")
        if not verdicts:
            self.errors.append("feeder audit: the ledgers hold no step of the job")

    def close(self) -> None:
        for t in self.timers:
            t.cancel()
        for f in self.replicas:
            f.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for f in self.feeders:
            if f.proc is not None and f.proc.poll() is None:
                f.proc.send_signal(signal.SIGCONT)
            f.close()


def run_elastic(sc: ElasticScenario, workdir: Path | None = None, cache: Path | None = None, keep: bool = False):
    """Run one elastic scenario; returns runner.Result (the work directory kept when it fails)."""
    import shutil

    from tests.chaos import _cache
    from tests.chaos.runner import Result

    t0 = time.monotonic()
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"elastic-{sc.seed}-"))
    run = ElasticRun(sc, workdir, cache or _cache())
    try:
        run.run()
        # (the commit reports are sent by each replica's thread: closed first, so they are in)
        for f in run.replicas:
            f.close()
        time.sleep(0.2)
        if not run.errors:
            run.audit()
    except Exception as e:  # noqa: BLE001 - the harness's own failure is a failed scenario, named
        import traceback

        run.errors.append(f"harness error: {type(e).__name__}: {e}")
        (workdir / "harness-error.txt").write_text(traceback.format_exc())
    finally:
        run.close()
    res = Result(scenario=sc, ok=not run.errors, errors=run.errors, faults=run.injected, samples=run.samples,
                 wall_s=time.monotonic() - t0, workdir=str(workdir))
    if res.ok and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return res
