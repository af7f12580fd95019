"""torchft's own data path under replica-group kills, measured: a Lighthouse (min_replicas=2),
3 replica groups of one process each (trainer/examples/torchft_train.py, ProcessGroupGloo on
CPU), one group SIGKILLed at random moments (mid-forward, mid-allreduce, at the commit, between
steps) several times, each restarted at once and healed by torchft from a peer. Each group logs
what it trained; this counts, over the committed steps:

  never trained   samples an uninterrupted run trains in those steps that no committed step trained
  trained twice   samples in more than one committed step
  short steps     committed steps whose global batch was short (fewer groups than at the start)

    python -m feeder_bench.torchft_baseline                   # torchft.data.DistributedSampler
    python -m feeder_bench.torchft_baseline --ff always       # its position = current_step() every step
    python -m feeder_bench.torchft_baseline --json out.json

The harness (Cluster: the Lighthouse, the groups, the kills; committed_steps: what each committed
step trained, from the logs) is also what tests/test_elastic_torchft.py drives with the feeder.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "trainer" / "examples" / "torchft_train.py"
PHASES = ("forward", "backward", "commit", "between")


def read_lines(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The complete JSON lines of path from byte offset on, and the offset after the last one."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:   # a line cut by SIGKILL mid-write (never seen: each is one write)
            continue
    return out, offset + end


def kill(proc) -> None:
    """SIGKILL a group's process (a Popen or a Forked; each leads its own process group)."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc is not None:
        proc.wait(30)


class Forked:
    """A group process the zygote forked: poll, wait and returncode as a Popen's."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.z, self.pid, self.returncode = zygote, pid, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.z.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float = 30):
        until = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > until:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.005)
        return self.returncode


class Zygote:
    """trainer --zygote: imports once, then forks each group process on request."""

    def __init__(self, c: "Cluster"):
        import queue
        import threading

        self.exits: dict[int, int] = {}
        self.pids: queue.Queue = queue.Queue()
        out = open(c.dir / "zygote.out", "w")
        argv = [sys.executable, str(TRAIN), "--zygote", "--lighthouse", c.address, "--log",
                str(c.dir / "group{group}.jsonl"), "--phase", str(c.dir / "group{group}.phase"), *c.trainer_args]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, cwd=str(ROOT),
                                     text=True, env=dict(os.environ, PYTHONFAULTHANDLER="1"), start_new_session=True)
        out.close()
        self.c = c
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            w = line.split()
            if w[:1] == ["pid"]:
                self.pids.put(int(w[2]))
            elif w[:1] == ["exit"]:
                self.exits[int(w[1])] = int(w[2])

    def spawn(self, gid: int, out: Path) -> Forked:
        self.c.launched += 1
        self.proc.stdin.write(f"{gid} {out}\n")
        self.proc.stdin.flush()
        return Forked(self, self.pids.get(timeout=180))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            kill(self.proc)


class Group:
    """One replica group: a trainer process, restarted under the same group id after a kill."""

    def __init__(self, gid: int, cluster: "Cluster"):
        self.gid, self.c = gid, cluster
        self.log = cluster.dir / f"group{gid}.jsonl"
        self.phase_path = cluster.dir / f"group{gid}.phase"
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.participated = False     # this incarnation took part in a committed step
        self.ended = False
        self.offset = 0

    def start(self) -> None:
        """A new process for this group: forked by the cluster's zygote (past its imports),
        or a fresh interpreter."""
        self.incarnation += 1
        self.participated = False
        try:
            self.phase_path.unlink()
        except FileNotFoundError:
            pass
        self.killed = False           # by the harness (any other end of the process is a failure)
        self.reported = False
        self.proc = self.c.new_process(self.gid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def phase(self) -> str:
        try:
            return self.phase_path.read_bytes().decode(errors="replace").strip()
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        self.killed = True
        kill(self.proc)

    def poll_log(self) -> list[dict]:
        got, self.offset = read_lines(self.log, self.offset)
        for r in got:
            if r["event"] == "step" and r["committed"] and r["replica"] is not None:
                self.participated = True
            if r["event"] == "end":
                self.ended = True
        return got


class Cluster:
    """A Lighthouse in this process and replica groups as processes, killed on a schedule."""

    def __init__(self, workdir: Path, trainer_args: list[str], *, groups: int = 3, min_replicas: int = 2,
                 join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 1000, seed: int = 0, fork: bool = True):
        os.environ.setdefault("RUST_LOG", "warn")   # (read once, when torchft is first imported in a process)
        from torchft.coordination import LighthouseServer

        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trainer_args = list(trainer_args)
        self.min_replicas = min_replicas
        self.rng = random.Random(seed)
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                           heartbeat_timeout_ms=heartbeat_timeout_ms)
        port = self.lighthouse.address().rsplit(":", 1)[1]
        self.address = f"http://127.0.0.1:{port}"
        self.fork = fork              # fork group processes from a zygote (False: a fresh interpreter each)
        self.zygote: Zygote | None = None
        self.launched = 0
        self.groups = [Group(g, self) for g in range(groups)]
        self.records: list[dict] = []
        self.step = -1                # the highest committed step seen in any log
        self.events: list[dict] = []  # kills, restarts, joins, feeder kills, with when they happened
        self.t0 = time.monotonic()

    def _launch(self, gid: int | None) -> subprocess.Popen:
        self.launched += 1
        out = open(self.dir / f"process{self.launched}.out", "w")
        argv = [sys.executable, str(TRAIN), "--lighthouse", self.address, "--log", str(self.dir / "group{group}.jsonl"),
                "--phase", str(self.dir / "group{group}.phase"), *self.trainer_args]
        argv += ["--standby"] if gid is None else ["--group", str(gid)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if gid is None else subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=str(ROOT), text=True,
                                env=dict(os.environ, PYTHONFAULTHANDLER="1"), start_new_session=True)
        out.close()
        return proc

    def new_process(self, gid: int):
        """A new process to run as group gid: forked by the zygote (a process that has imported
        torch, torchft and the client once: a restart then costs no interpreter start, which on
        a loaded 2-core machine is 10 s and more), or a fresh interpreter without one."""
        if not self.fork:
            return self._launch(gid)
        if self.zygote is None:
            self.zygote = Zygote(self)
        return self.zygote.spawn(gid, self.dir / f"process{self.launched + 1}.{gid}.out")

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def poll(self) -> None:
        for g in self.groups:
            for r in g.poll_log():
                self.records.append(r)
                if r["event"] == "step" and r["committed"] and r["replica"] is not None:
                    self.step = max(self.step, r["step"])

    def _eligible(self) -> list[Group]:
        """Groups that may be killed now: up and past their heal, with at least min_replicas
        such groups left beside them (so training goes on while it is down)."""
        up = [g for g in self.groups if g.alive() and g.participated and not g.ended]
        return up if len(up) - 1 >= self.min_replicas else []

    def run(self, *, steps: int, kills: int, join_at: int | None = None, hooks: dict[int, callable] | None = None,
            limit_s: float = 600, restart_s: tuple[float, float] = (0.2, 1.0)) -> dict:
        """Start the groups and train `steps` steps, SIGKILLing a random group `kills` times at
        random committed steps (each at a chosen phase of its loop) and restarting it after a
        random pause; a new group joins at committed step `join_at`; hooks[step]() runs once
        when that step has committed (a feeder kill). Returns a summary; the logs stay in
        self.records."""
        hooks = dict(hooks or {})
        lo, hi = max(2, steps // 12), max(3, steps * 7 // 10)
        span = (hi - lo) / max(1, kills)
        targets = sorted(int(lo + span * k + self.rng.random() * span) for k in range(kills))
        phase0 = self.rng.randrange(len(PHASES))
        restarts: list[tuple[float, Group]] = []
        for g in self.groups:
            g.start()
        deadline = time.monotonic() + limit_s
        done = 0
        timed_out = False
        ended_at = 0.0
        while True:
            self.poll()
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            for t, g in list(restarts):
                if now >= t:
                    restarts.remove((t, g))
                    g.start()
                    self.events.append({"at": self.now(), "step": self.step, "restart": g.gid})
            for s in sorted(hooks):
                if self.step >= s:
                    self.events.append({"at": self.now(), "step": self.step, "hook": s})
                    hooks.pop(s)()
            if join_at is not None and self.step >= join_at:
                g = Group(len(self.groups), self)
                self.groups.append(g)
                g.start()
                self.events.append({"at": self.now(), "step": self.step, "join": g.gid})
                join_at = None
            if done < kills and self.step >= targets[done] and self.step < steps - 3:
                cand = self._eligible()
                if cand:
                    victim = self.rng.choice(cand)
                    want = PHASES[(phase0 + done) % len(PHASES)]
                    until = time.monotonic() + 3.0
                    while victim.phase() != want and time.monotonic() < until and victim.alive():
                        time.sleep(0.0005)
                    got = victim.phase()
                    victim.kill()
                    self.poll()
                    self.events.append({"at": self.now(), "step": self.step, "kill": victim.gid,
                                        "incarnation": victim.incarnation, "phase": got, "wanted": want})
                    restarts.append((time.monotonic() + self.rng.uniform(*restart_s), victim))
                    done += 1
            for g in self.groups:
                if g.proc is not None and not g.alive() and not g.killed and not g.reported and g.proc.returncode:
                    g.reported = True   # died on its own (a crash): reported, not restarted
                    self.events.append({"at": self.now(), "step": self.step, "died": g.gid, "rc": g.proc.returncode,
                                        "incarnation": g.incarnation})
            live = [g for g in self.groups if g.alive()]
            if not live and not restarts:
                break
            if any(g.ended for g in self.groups):
                # the run is over: a restart still pending is dropped; the groups get 10 s to close
                # (one that came back at the very end and cannot reach min_replicas is then stopped)
                restarts.clear()
                ended_at = ended_at or now
                for g in live:
                    if not g.ended and not g.participated:
                        # restarted too late to rejoin: stopped before it and another such group
                        # could make a quorum of their own and train again from step 0
                        self.events.append({"at": self.now(), "step": self.step, "stopped": g.gid,
                                            "ended": False})
                        g.kill()
                live = [g for g in self.groups if g.alive()]
                if not live or now - ended_at > 10:
                    for g in live:
                        self.events.append({"at": self.now(), "step": self.step, "stopped": g.gid,
                                            "ended": g.ended})
                    break
            time.sleep(0.01)
        for g in self.groups:
            g.kill()
        if self.zygote is not None:
            self.zygote.close()
        self.poll()
        self.lighthouse.shutdown()
        return {"committed_to": self.step, "kills": [e for e in self.events if "kill" in e],
                "died": [e for e in self.events if "died" in e],
                "events": self.events, "timed_out": timed_out, "seconds": self.now(),
                "exit_codes": {g.gid: g.proc.returncode for g in self.groups if g.proc is not None}}


def attempts(records: list[dict]) -> list[dict]:
    """Each group incarnation's attempts: its "dealt" line with the "step" line that followed
    it (None when the process died in between)."""
    out, open_ = [], {}
    for r in records:   # (each group's lines are in order; incarnations of a group follow each other)
        g = r["group"]
        if r["event"] in ("start", "end"):
            open_.pop(g, None)
        elif r["event"] == "dealt":
            a = {"dealt": r, "result": None}
            open_[g] = a
            out.append(a)
        elif r["event"] == "step" and g in open_:
            open_.pop(g)["result"] = r
    return out


def committed_steps(records: list[dict]) -> tuple[dict[int, dict], list[str]]:
    """What each committed step trained: {step: {"quorum", "replicas", "parts": [(group,
    replica, ids, dealt line)]}}, and the anomalies found (two quorums committing one step, a
    committed step whose contributors are not replicas 0..W-1). A step's contributors are the
    participating attempts of its committing quorum whose group committed it or died after
    being dealt (its gradient may have gone out: the others committed, so it did)."""
    by_group: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by_group[r["group"]].append(r)
    atts = [a for g in sorted(by_group) for a in attempts(by_group[g])]
    quorums: dict[int, set] = defaultdict(set)
    for a in atts:
        res = a["result"]
        if res is not None and res["committed"] and res["replica"] is not None:
            quorums[res["step"]].add(res["quorum"])
    steps, problems = {}, []
    for s in sorted(quorums):
        if len(quorums[s]) != 1:
            problems.append(f"step {s} committed by quorums {sorted(quorums[s])}")
        q = max(quorums[s])
        parts = []
        for a in atts:
            d, res = a["dealt"], a["result"]
            if d["step"] != s or d["quorum"] != q or d["replica"] is None:
                continue
            if res is not None and not res["committed"]:
                continue
            parts.append((d["group"], d["replica"], d["ids"], d))
        worlds = {p[3]["replicas"] for p in parts}
        ranks = sorted(p[1] for p in parts)
        if len(worlds) != 1 or ranks != list(range(next(iter(worlds), 0))):
            problems.append(f"step {s} (quorum {q}): replicas {ranks} of worlds {sorted(worlds)}")
        steps[s] = {"quorum": q, "replicas": max(worlds, default=0), "parts": parts}
    return steps, problems


def sampler_figures(records: list[dict], *, samples: int, batch: int, groups: int, seed: int) -> dict:
    """torchft.data.DistributedSampler's run, counted against an uninterrupted one."""
    from torchft.data import DistributedSampler

    shards = [list(DistributedSampler(range(samples), replica_rank=g, num_replica_groups=groups, group_rank=0,
                                      num_replicas=1, shuffle=True, seed=seed)) for g in range(groups)]
    steps, problems = committed_steps(records)
    n = len(steps)
    trained = Counter(i for s in steps.values() for p in s["parts"] for i in p[2])
    expected = {i for g in range(groups) for i in shards[g][:n * batch]}
    never = expected - set(trained)
    twice = {i: c for i, c in trained.items() if c > 1}
    short = [s for s, v in steps.items() if sum(len(p[2]) for p in v["parts"]) < groups * batch]
    return {"committed_steps": n, "contiguous": sorted(steps) == list(range(n)),
            "expected_samples": len(expected), "trained_samples": sum(trained.values()),
            "never_trained": len(never), "never_trained_pct": round(100 * len(never) / max(1, len(expected)), 2),
            "trained_twice": len(twice), "extra_trainings": sum(c - 1 for c in twice.values()),
            "beyond_horizon": len(set(trained) - expected), "short_steps": len(short),
            "short_step_batches": dict(Counter(sum(len(p[2]) for p in steps[s]["parts"]) for s in short)),
            "problems": problems}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="samples per group per step")
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the kill schedule's and the sampler's seed")
    p.add_argument("--delay-ms", type=float, default=20.0, help="the trainer's sleep in forward and between steps")
    p.add_argument("--ff", choices=("heal", "always", "none"), default="heal")
    p.add_argument("--no-fork", action="store_true",
                   help="start each group process in a fresh interpreter (seconds of imports) rather than forked "
                        "from a process that has done them")
    p.add_argument("--dir", default="", help="keep the logs here (default: a temporary directory)")
    p.add_argument("--json", default="", help="write the figures here")
    a = p.parse_args(argv)
    import tempfile

    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="torchft-baseline-"))
    for old in work.glob("group*"):
        old.unlink()
    c = Cluster(work, ["--data", "torchft", "--steps", str(a.steps), "--batch", str(a.batch), "--samples",
                       str(a.samples), "--groups", str(a.groups), "--seed", str(a.seed), "--delay-ms",
                       str(a.delay_ms), "--ff", a.ff], groups=a.groups, seed=a.seed, fork=not a.no_fork)
    run = c.run(steps=a.steps, kills=a.kills, limit_s=600)
    fig = sampler_figures(c.records, samples=a.samples, batch=a.batch, groups=a.groups, seed=a.seed)
    out = {"args": vars(a), "figures": fig, "run": {k: v for k, v in run.items() if k != "events"},
           "events": run["events"], "logs": str(work)}
    print(json.dumps({"figures": fig, "kills": run["kills"], "seconds": run["seconds"],
                      "timed_out": run["timed_out"]}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
