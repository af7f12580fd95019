"""The runner: a scenario against real `feeder serve` processes and real rank processes.

Feeders are subprocesses on fixed ports (a killed one comes back on its port), each with
`--ledger`; proxies (bench/wanproxy.py) sit between ranks and feeders when the scenario
resets or blackholes links. Ranks are processes forked from a forkserver that preloaded
tests.chaos.rank. The runner's loop waits on the ranks' pipes and exits and on its timers:
a rank that reaches a fault's position pauses, the runner injects the fault and lets it go;
heals (restart, SIGCONT, clearing a toxic) are timers. Then the oracle judges what the ranks
wrote and what the feeders' ledgers say.
"""
from __future__ import annotations

import heapq
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests.chaos.freeze import freeze, thaw
from tests.chaos.scenario import FEEDER_FAULTS, Fault, Scenario
from tests.helpers import byte_stream, make_docs, packed_bins, prep_docs

SCENARIO_BUDGET_S = 240.0    # a scenario still running after this is a hang: a failure (generous: soaks run many at once on 2 cores)
SLOW_KBPS = 2                # a `slow` feeder's link: a trickle, far below what any rank takes
RANK_RETRY_FOR_S = 90.0      # a rank with nowhere to go for this long raises UNAVAILABLE (a restart under heavy load can take tens of seconds)


# ---- corpora ---------------------------------------------------------------------------

@dataclass
class Corpus:
    dataset: Path
    stream: np.ndarray
    docs: list

    def samples(self, seq_len: int, packing: str) -> int:
        """Samples of an epoch: concat windows, or best-fit bins."""
        from feeder.core.sampler import n_samples

        return len(self.bins(seq_len)) if packing == "best_fit" else n_samples(len(self.stream), seq_len)

    def bins(self, seq_len: int) -> np.ndarray:
        key = ("bins", seq_len)
        if key not in self.__dict__:
            self.__dict__[key] = packed_bins(self.docs, seq_len)
        return self.__dict__[key]

    def rows(self, ids: list[int], seq_len: int, packing: str) -> np.ndarray:
        """The samples' tokens [len(ids), seq_len + 1] (None where an id is not a sample of it)."""
        if packing == "best_fit":
            bins = self.bins(seq_len)
            return bins[ids] if all(0 <= i < len(bins) for i in ids) else None
        L = seq_len
        rows = [self.stream[i * L:i * L + L + 1] for i in ids]
        return np.stack(rows) if all(len(r) == L + 1 for r in rows) else None


_CORPORA: dict[tuple[str, int], Corpus] = {}


def corpus(root: Path, n_docs: int) -> Corpus:
    """One prepped dataset per size, shared by every scenario of this process (small chunks and
    shards, so samples cross both and a corrupt chunk is one of many)."""
    key = (str(root), n_docs)
    if key not in _CORPORA:
        d = root / f"corpus-{n_docs}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        docs = make_docs(n_docs, seed=n_docs, max_words=40)
        _CORPORA[key] = Corpus(prep_docs(d, docs, shard_tokens=3000, chunk_tokens=600), byte_stream(docs), docs)
    return _CORPORA[key]


KAFKA_PARTITIONS = 3
_TOPICS: dict[tuple[str, int], Corpus] = {}


def kafka_corpus(root: Path, n_docs: int) -> Corpus:
    """The corpus of n_docs documents published to a bounded Kafka topic (one per size and
    process, named afresh so no earlier run's epoch is agreed for its jobs): `dataset` is its
    URL, `stream` the packed stream of its epoch, documents in (partition, offset) order."""
    import uuid

    key = (str(root), n_docs)
    if key not in _TOPICS:
        from tests.helpers import write_jsonl

        docs = make_docs(n_docs, seed=n_docs, max_words=40)
        bootstrap = f"127.0.0.1:{os.environ.get('FEEDER_KAFKA_PORT', 9092)}"
        topic = f"chaos-{n_docs}-{uuid.uuid4().hex[:8]}"
        root.mkdir(parents=True, exist_ok=True)
        src = write_jsonl(root / f"{topic}.jsonl", docs)
        r = subprocess.run([sys.executable, "-m", "feeder.cli", "publish", str(src), "--to",
                            f"kafka://{bootstrap}/{topic}", "--partitions", str(KAFKA_PARTITIONS), "--workers", "1"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"publishing the Kafka corpus failed (is the broker up? make kafka): {r.stderr}")
        P = KAFKA_PARTITIONS   # publish writes document i to partition i mod P
        ordered = [docs[i] for p in range(P) for i in range(p, n_docs, P)]
        _TOPICS[key] = Corpus(f"kafka://{bootstrap}/{topic}", byte_stream(ordered), ordered)
    return _TOPICS[key]


def damage_cache(cache: Path, rng: random.Random) -> int:
    """One byte flipped in one file of every entry of a cache directory (packings, Kafka
    snapshots, orders), as a process that opens them next reads them: each damaged file is a copy
    renamed over the original, so processes that already map it keep what they verified (a
    change under a live mapping is what the scrub is for, not this fault). How many entries."""
    entries = [p for kind in ("packing", "kafka") if (cache / kind).is_dir()
               for p in (cache / kind).iterdir() if p.is_dir() and not p.name.startswith(".")]
    orders = [p for p in (cache / "orders").glob("randperm-*") if not p.name.endswith((".lock", ".progress"))] \
        if (cache / "orders").is_dir() else []
    done = 0
    for entry in [*entries, *orders]:
        files = [entry] if entry.is_file() else sorted(p for p in entry.iterdir() if p.is_file())
        if not files:
            continue
        victim = rng.choice(files)
        try:
            data = bytearray(victim.read_bytes())
        except OSError:   # (removed meanwhile: a feeder rebuilding it)
            continue
        if not data:
            continue
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        tmp = victim.with_name(f".{victim.name}.damaging")
        tmp.write_bytes(data)
        try:
            os.replace(tmp, victim)
            done += 1
        except OSError:
            tmp.unlink(missing_ok=True)
    return done


def corrupt_copy(dataset: Path, out: Path, rng: random.Random) -> str:
    """A replica with one token byte flipped in one chunk (same manifest, same fingerprint):
    the feeder finds it by the chunk's sha256 and answers DATA_LOSS for it."""
    import pyarrow as pa

    shutil.copytree(dataset, out)
    manifest = json.loads((out / "manifest.json").read_text())
    shard = rng.choice(manifest["shards"])
    path = out / shard["path"]
    with pa.memory_map(str(path), "r") as mm:
        reader = pa.ipc.open_file(mm)
        ci = rng.randrange(reader.num_record_batches)
        values = reader.get_batch(ci).column(0).values
        buf = values.buffers()[1]
        mm.seek(0)
        whole = mm.read_buffer()   # the whole mapping: addresses in it are file offsets
        offset = buf.address - whole.address + values.offset * values.type.byte_width
        k = rng.randrange(len(values))
        at = offset + k * values.type.byte_width
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return f"{shard['path']} chunk {ci} token {k}"


# ---- feeders and links -------------------------------------------------------------------

class Feeder:
    """A `feeder serve` subprocess on a fixed port; its log lines go to a file."""

    def __init__(self, source: Path, args: list[str], ledger: Path, log: Path, processes: int):
        self.source, self.args, self.ledger, self.log_path = source, args, ledger, log
        self.processes = processes
        # Its first start binds any free port and says which (wait_ready); a restart binds that
        # one again, where the ranks know it. (A port picked free beforehand could be taken by
        # another scenario's process before the feeder bound it: soak seed 4720381.)
        self.address = "127.0.0.1:0"
        self.proc: subprocess.Popen | None = None
        self.stopped_pid: int | None = None
        self.log = open(log, "a")
        self.launch()

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        argv = [sys.executable, "-m", "feeder.cli", "serve", "--source", str(self.source), "--listen",
                self.address, "--grace", "1", "--ledger", str(self.ledger), *self.args]
        if self.processes > 1:
            argv += ["--processes", str(self.processes)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        line = ""
        while "listening on" not in line:
            line = self.proc.stdout.readline()
            if not line and (self.proc.poll() is not None or time.monotonic() > deadline):
                raise RuntimeError(f"feeder did not start (see {self.log_path})")
            self.log.write(line)
        self.address = line.split("listening on ")[1].split()[0]   # (the port it bound, on its first start)
        # Keep reading its stdout, so a chatty feeder never blocks on a full pipe.
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()

    def _drain(self, proc) -> None:
        for line in proc.stdout:
            try:
                self.log.write(line)
            except ValueError:
                return

    def victim(self, rng: random.Random) -> int:
        """The pid a fault hits: the feeder, or one of its processes under --processes."""
        if self.processes > 1:
            import psutil

            kids = psutil.Process(self.proc.pid).children()
            if kids:
                return rng.choice(kids).pid
        return self.proc.pid

    def wait_dead(self, timeout: float = 30) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        """SIGKILL: the ledger is written line by line, so nothing is lost, and a drain would
        only cost its grace period. Processes under --processes follow their supervisor
        (PR_SET_PDEATHSIG) and are waited for, so their ledgers are final for the audit."""
        import psutil

        if self.stopped_pid:
            _signal(self.stopped_pid, signal.SIGCONT)
        if self.proc and self.proc.poll() is None:
            try:
                kids = psutil.Process(self.proc.pid).children()
            except psutil.Error:
                kids = []
            self.proc.kill()
            self.proc.wait(10)
            for k in kids:
                _signal(k.pid, signal.SIGCONT)
            psutil.wait_procs(kids, timeout=10)
        self.log.close()


def kill_group(pid: int) -> None:
    """SIGKILL a rank's process group: the rank, its DataLoader workers and their forkserver."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


_PROXIES = None


def proxies():
    """One proxy server for the process (toxiproxy when built, else the user-space one),
    stopped when the process exits (a toxiproxy server outlived every test run before)."""
    global _PROXIES
    if _PROXIES is None:
        import atexit

        from feeder_bench.wanproxy import start_proxies

        _PROXIES = start_proxies()
        atexit.register(_PROXIES.close)
    return _PROXIES


def drop_proxy(p) -> None:
    try:
        if hasattr(p, "api"):
            try:
                p.api.drop(p.name)
            except OSError:   # its API hangs: the next scenario gets a server that answers
                p.api.restart()
        else:
            p.clear()
            p.loop.call_soon_threadsafe(p.server.close)
    except Exception:  # noqa: BLE001 - cleanup only
        pass


def connected_ranks(address: str, job: str) -> int:
    """Ranks of `job` with an open stream on the feeder at `address` (its Status)."""
    import grpc

    from feeder.v1 import feeder_pb2 as pb
    from feeder.v1 import feeder_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            reply = pb_grpc.FeederStub(ch).Status(pb.StatusRequest(job=job), timeout=3)
        except grpc.RpcError:
            return 0
    return sum(1 for j in reply.jobs for r in j.ranks if r.connected)


def open_streams_before_intruder(log: Path, skip: int, job: str, rank: int, world: int) -> int:
    """Streams of `job` open on a feeder (its log's open and close lines, in the event loop's
    order) just before the intruder's: the first fresh (not resumed) open of rank/world logged
    after line `skip`. -1 when that line cannot be found (judged as live)."""
    lines = log.read_text(errors="replace").splitlines()
    opened = f"stream opened job={job} "
    closed = f"stream closed job={job} "
    live = 0
    for n, line in enumerate(lines):
        if opened in line:
            if n >= skip and f"rank={rank}/{world} " in line and "(resumed)" not in line:
                return live
            live += 1
        elif closed in line:
            live -= 1
    return -1


def fenced_out(end: dict | None) -> bool:
    """Whether a rank's process ended refused by the fence: another process holds its slot."""
    return bool(end) and end.get("end") == "error" and end.get("code") == "FAILED_PRECONDITION" \
        and "no longer holds this rank" in end.get("msg", "")


# ---- ranks -------------------------------------------------------------------------------

_CTX = None


def rank_context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["tests.chaos.rank"])
    return _CTX


@dataclass
class Incarnation:
    """One process of one rank: from start_pos (batches before its cursor) on."""
    slot: int
    phase: int
    world: int
    start_pos: int
    cursor: str
    reshard: bool
    out: Path
    proc: object = None
    conn: object = None
    role: str = "main"            # main | superseded (a newer process of the rank took over)
    killed: bool = False          # by the runner (trainer restart)
    exited: bool = False
    lines: list = field(default_factory=list)
    ckpts: list = field(default_factory=list)   # (pos, cursor)
    repasses: int = 0
    end: dict | None = None
    exitcode: int | None = None
    release: object = None        # superseded process to let go once this one streams
    taken_over: bool = False      # a disagreeing intruder restarted the job where nobody streamed it (intrude)
    members: dict | None = None   # the model-parallel members' verdict (tests/chaos/rank.py Shadows)

    def parse(self) -> None:
        self.lines, self.ckpts, self.end, self.repasses = [], [], None, 0
        if not self.out.exists():
            return
        for raw in self.out.read_text().splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:   # a line cut by SIGKILL
                continue
            if "ckpt" in rec:
                self.ckpts.append((rec["ckpt"], rec["c"]))
            elif "repass" in rec:
                self.repasses += 1
            elif "end" in rec:
                self.end = rec
            elif "members" in rec:
                self.members = rec
            else:
                self.lines.append(rec)

    def last_checkpoint(self) -> tuple[int, str, bool]:
        """(position, cursor, reshard) a restart resumes from: the last checkpoint written, or
        where this process itself started."""
        self.parse()
        if self.ckpts:
            pos, cur = self.ckpts[-1]
            return pos, cur, False
        return self.start_pos, self.cursor, self.reshard


@dataclass
class Result:
    scenario: Scenario
    ok: bool
    errors: list
    faults: Counter
    samples: int
    wall_s: float
    workdir: str


class ScenarioRun:
    def __init__(self, sc: Scenario, workdir: Path, cache: Path):
        self.sc, self.dir = sc, workdir
        self.rng = random.Random(f"run-{sc.seed}")
        # (sc.kafka names the sources on a topic: the corpus, 0, when there is no mixture)
        self.corpus = (kafka_corpus if not sc.mixture and 0 in sc.kafka else corpus)(cache, sc.n_docs)
        self.n = self.corpus.samples(sc.seq_len, sc.packing)
        # A mixture: a corpus per source, and an epoch of all their samples (the default epoch_samples)
        self.sources = [(kafka_corpus if i in sc.kafka else corpus)(cache, d) for i, (_, _, d) in enumerate(sc.mixture)]
        if sc.mixture:
            self.n = sc.epoch_samples or sum(c.samples(sc.seq_len, sc.packing) for c in self.sources)
        self.errors: list[str] = []
        self.injected: Counter = Counter()
        self.timers: list = []
        self.seq = 0
        self.incs: list[Incarnation] = []
        self.done_faults: set[int] = set()
        self.feeders: list[Feeder] = []
        self.links: list = []
        self.intruders: list[str] = []
        self.reshard = next((f for f in sc.faults if f.kind == "reshard"), None)
        self.phase = 1
        self.stopped: dict[int, int] = {}   # feeder index -> stopped pid
        self.frozen: set[int] = set()       # those stopped by freeze() (stuck), not SIGSTOP
        # A scheduled mixture (issue 46): its schedule as the ranks give it, and each live change
        # `feeder mix` reported taken ((version, progress it took effect at, its table)).
        self.schedule = self.schedule_table(sc.schedule) if sc.schedule else None
        self.mixes: list[tuple[int, int, list]] = []
        self.mix_threads: list[threading.Thread] = []

    def schedule_table(self, segs, span: float | None = None, base: int | None = None) -> list[dict]:
        """The scenario's segments ((share of the run's progress, weights, ramp target)) as
        mixture_schedule takes them, resolved against this run: its progress starts at
        start_epoch * N and spans about what its ranks take."""
        sc = self.sc
        if span is None:
            span = max(1, self.total(sc.world) * sc.micro_batch * sc.world)
        base = sc.start_epoch * self.n if base is None else base
        names = [m[0] for m in sc.mixture]
        out, prev = [], 0
        for frac, w, to in segs:
            seg = {"weights": dict(zip(names, w))}
            if frac:
                until = max(prev + 1, base + int(frac * span))
                seg["until"], prev = until, until
                if to:
                    seg["to"] = dict(zip(names, to))
            out.append(seg)
        return out

    # -- plan arithmetic
    def batches_per_epoch(self, world: int) -> int:
        from feeder.core.sampler import per_rank

        per = per_rank(self.n, world, self.sc.drop_last)
        return -(-per // self.sc.micro_batch)

    def total(self, world: int) -> int:
        sc = self.sc
        return sc.take if sc.num_epochs == 0 else self.batches_per_epoch(world) * sc.num_epochs

    def fault_pos(self, f: Fault) -> int:
        """A fault's moment, clamped into the run (the generator only estimated its length)."""
        horizon = self.total(self.sc.world)
        return max(1, min(f.at_batch, horizon - 1)) if f.at_batch else 0

    def stop_at(self) -> int:
        return self.fault_pos(self.reshard) if self.reshard else 0

    # -- timers
    def after(self, delay_s: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (time.monotonic() + delay_s, self.seq, fn, args))

    # -- ranks
    def rank_faults(self, phase: int, world: int) -> list[tuple[int, Fault]]:
        """(index, fault) of the batch-moment faults that phase's ranks trigger."""
        s = self.stop_at()
        out = []
        for i, f in enumerate(self.sc.faults):
            p = self.fault_pos(f)
            if not p or f.kind == "reshard" or i in self.done_faults:
                continue
            if s and ((phase == 1 and p > s) or (phase == 2 and p <= s)):
                continue
            out.append((i, f))
        return out

    def start_rank(self, slot: int, phase: int, world: int, start_pos: int, cursor: str, reshard: bool,
                   extra_pause: int = 0) -> Incarnation:
        sc = self.sc
        k = sum(1 for i in self.incs if i.slot == slot and i.phase == phase)
        inc = Incarnation(slot=slot, phase=phase, world=world, start_pos=start_pos, cursor=cursor, reshard=reshard,
                          out=self.dir / f"rank{slot}.p{phase}.{k}.jsonl")
        mine = [(i, f) for i, f in self.rank_faults(phase, world) if f.rank % world == slot]
        pauses = sorted({self.fault_pos(f) for _, f in mine if f.kind != "repass"} | ({extra_pause} - {0}))
        repasses = sorted({self.fault_pos(f) for _, f in mine if f.kind == "repass"})
        superseded_at = [self.fault_pos(f) for _, f in mine if f.kind == "supersede"]
        if superseded_at and not extra_pause and start_pos < min(superseded_at):
            # A process that will be superseded starts no new pass after that point: a new pass
            # opens a newer stream, and the newest stream of a rank wins, so a zombie that
            # starts one displaces the live process (soak seed 200017): that is the rule, not a
            # fault of the feeder, and no trainer restarts its loop once replaced.
            repasses = [p for p in repasses if p <= min(superseded_at)]
        total = self.total(world)
        stop = self.stop_at() if phase == 1 and self.reshard else (total if sc.num_epochs == 0 else 0)
        targets = [ln.listen for ln in self.links] if self.links else [fd.address for fd in self.feeders]
        if sc.spread:
            r = slot % len(targets)
            targets = targets[r:] + targets[:r]
        cfg = dict(out=str(inc.out), start_pos=start_pos, targets=targets, job=sc.job, rank=slot, world=world,
                   seq_len=sc.seq_len, micro_batch=sc.micro_batch, seed=sc.data_seed, shuffle=sc.shuffle,
                   drop_last=sc.drop_last, epoch=sc.start_epoch, num_epochs=sc.num_epochs, cursor=cursor,
                   reshard=reshard, read_ahead=sc.read_ahead, compression=sc.compression, retry_for_s=RANK_RETRY_FOR_S,
                   failback_s=sc.failback_s, workers=sc.workers, persistent=sc.persistent, context=sc.context,
                   pauses=pauses, repasses=repasses, stop_at=stop, step_ms=sc.step_ms, ckpt_every=sc.ckpt_every,
                   mixture=[(name, w) for name, w, _ in sc.mixture], permutation=sc.permutation,
                   epoch_samples=sc.epoch_samples, packing=sc.packing, members=sc.members, cp_size=sc.cp_size,
                   cp_layout=sc.cp_layout, hedge=sc.hedge, schedule=self.schedule)
        from tests.chaos.rank import rank_main

        ctx = rank_context()
        ours, theirs = ctx.Pipe()
        # not daemonic: a rank has DataLoader workers of its own
        inc.proc = ctx.Process(target=rank_main, args=(cfg, theirs))
        inc.proc.start()
        theirs.close()
        inc.conn = ours
        self.incs.append(inc)
        return inc

    def main_inc(self, slot: int, phase: int) -> Incarnation | None:
        for inc in reversed(self.incs):
            if inc.slot == slot and inc.phase == phase and inc.role == "main":
                return inc
        return None

    # -- faults
    def inject_feeder(self, f: Fault) -> None:
        t = f.target % len(self.feeders)
        fd = self.feeders[t]
        if f.kind in ("sigkill", "sigterm"):
            if fd.proc.poll() is not None or t in self.stopped:
                return   # already down (another fault): nothing to hit
            pid = fd.victim(self.rng) if f.kind == "sigkill" else fd.proc.pid
            _signal(pid, signal.SIGKILL if f.kind == "sigkill" else signal.SIGTERM)
            if pid == fd.proc.pid:   # the whole feeder goes: it comes back on its port
                self.after(f.heal_ms / 1000, self.restart_feeder, t)
            # else one of --processes N died: its supervisor starts it again
        elif f.kind == "sigstop":
            if t in self.stopped or fd.proc.poll() is not None:
                return
            pid = fd.victim(self.rng)
            _signal(pid, signal.SIGSTOP)
            self.stopped[t] = fd.stopped_pid = pid
            self.after(f.heal_ms / 1000, self.cont_feeder, t)
        elif f.kind in ("reset", "blackhole"):
            link = self.links[t]
            self.toxic(link.reset if f.kind == "reset" else link.blackhole)
            self.after(f.heal_ms / 1000, self.unclog, link)
        elif f.kind == "slow":   # answers, at a trickle: far below what a rank takes
            link = self.links[t]
            self.toxic(lambda: link.bandwidth(SLOW_KBPS))
            self.after(f.heal_ms / 1000, self.unclog, link)
        elif f.kind == "stuck":   # its event loop stopped while gRPC answers pings (freeze.py)
            if t in self.stopped or fd.proc.poll() is not None:
                return
            pid = fd.victim(self.rng)
            if not freeze(pid):
                return
            self.stopped[t] = fd.stopped_pid = pid
            self.frozen.add(pid)
            self.after(f.heal_ms / 1000, self.cont_feeder, t)
        elif f.kind == "cache-damage":
            # What a host crash leaves a region: its shared cache damaged, and every feeder on it
            # started again, so that each entry is met by a process that has not verified it yet.
            self.injected["cache_entries_damaged"] += damage_cache(self.dir / "cache", self.rng)
            for i, other in enumerate(self.feeders):
                if other.proc.poll() is None and i not in self.stopped:
                    _signal(other.proc.pid, signal.SIGKILL)
                    self.after(f.heal_ms / 1000, self.restart_feeder, i)
        self.injected[f.kind] += 1

    def unclog(self, link, tries: int = 3) -> None:
        """The link as the scenario has it: no toxic but its bandwidth. Toxiproxy's API can stall
        while a link's other end is SIGSTOPped (removing a toxic waits for its pipe): try again
        a little later rather than hold up the run."""
        try:
            link.clear()
            if self.sc.link_kbps:
                link.bandwidth(self.sc.link_kbps)
        except OSError:   # URLError, TimeoutError
            if hasattr(link, "api"):   # what toxiproxy still has (a timed-out DELETE may have gone through)
                try:
                    link.toxics = [t["name"] for t in link.api._call("GET", f"/proxies/{link.name}/toxics")]
                except OSError:
                    pass
            if tries:
                self.after(0.5, self.unclog, link, tries - 1)
            else:
                self.restart_proxies()

    def toxic(self, add) -> None:
        """Add a toxic; if the proxy server's API hangs, restart it (without toxics) and add it again."""
        try:
            add()
        except OSError:
            if not hasattr(self.links[0], "api"):
                raise
            self.restart_proxies()
            add()

    def restart_proxies(self) -> None:
        """Toxiproxy's API hung for good (soak seeds 200172-200188: every later scenario of that
        process failed with a harness TimeoutError). A new server, the same proxies on the same
        ports, each link as the scenario has it: its connections drop, which a rank rides out as
        it does a reset, so it is counted as one."""
        proxies().restart()
        self.injected["proxy_restart"] += 1
        for link in self.links:
            link.toxics = []
            if self.sc.link_kbps:
                link.bandwidth(self.sc.link_kbps)

    def restart_feeder(self, t: int) -> None:
        fd = self.feeders[t]
        fd.wait_dead()
        fd.start()

    def cont_feeder(self, t: int) -> None:
        pid = self.stopped.pop(t, None)
        if pid in self.frozen:
            self.frozen.discard(pid)
            thaw(pid)
            self.feeders[t].stopped_pid = None
        elif pid:
            _signal(pid, signal.SIGCONT)
            self.feeders[t].stopped_pid = None

    def on_pause(self, inc: Incarnation, pos: int) -> None:
        if inc.release is not None and pos == inc.start_pos + 1:
            # The newer process streams: let the superseded one go on (it must now stop with an error).
            old, inc.release = inc.release, None
            self.go(old)
        if inc.role != "main":
            self.go(inc)
            return
        fire = [(i, f) for i, f in self.rank_faults(inc.phase, inc.world)
                if self.fault_pos(f) == pos and f.rank % inc.world == inc.slot and f.kind != "repass"]
        # The intruder first: it needs the job live, which a fault fired at the same moment
        # (a reset) may not leave it (soak seed 300065).
        fire.sort(key=lambda x: x[1].kind != "disagree")
        release = True
        for i, f in fire:
            self.done_faults.add(i)
            if f.kind in FEEDER_FAULTS:
                if f.hold_ms:   # the rank idles: its window and the feeder's queue fill up first
                    time.sleep(f.hold_ms / 1000)
                self.inject_feeder(f)
            elif f.kind == "restart":
                self.injected["restart"] += 1
                self.after(self.rng.uniform(0, 0.05), self.kill_rank, inc)
            elif f.kind == "supersede":
                self.injected["supersede"] += 1
                inc.role = "superseded"
                ck_pos, ck_cur, ck_reshard = inc.last_checkpoint()
                newer = self.start_rank(inc.slot, inc.phase, inc.world, ck_pos, ck_cur, ck_reshard,
                                        extra_pause=ck_pos + 1)
                newer.release = inc
                release = False   # held until the newer one has its first batch (or ends)
            elif f.kind == "disagree":
                self.intrude(inc, f)
            elif f.kind == "mix":
                t = threading.Thread(target=self.mix_change, args=(f,), daemon=True)
                t.start()
                self.mix_threads.append(t)
        if release:
            self.go(inc)

    def mix_change(self, f: Fault) -> None:
        """An operator's live change (`feeder mix --relative` on every feeder), tried again until
        every feeder took it (one may be down or stopped by a fault meanwhile): each version a
        run reports taken, on some feeders or all, is recorded for the oracle."""
        import re

        span = max(1, self.total(self.sc.world) * self.sc.micro_batch * self.sc.world)
        table = self.schedule_table(tuple(json.loads(f.detail)), span=span // 2, base=0)
        path = self.dir / "mix.toml"
        lines = []
        for seg in table:
            lines.append("[[segment]]")
            for key in ("until", "weights", "to"):
                if key in seg:
                    v = seg[key]
                    lines.append(f"{key} = " + ("{" + ", ".join(f"{k} = {x!r}" for k, x in v.items()) + "}"
                                                 if isinstance(v, dict) else str(v)))
        path.write_text("\n".join(lines) + "\n")
        self.injected["mix"] += 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            targets = [a for fd in self.feeders for a in ("--target", fd.address)]
            p = subprocess.run([sys.executable, "-m", "feeder.cli", "mix", self.sc.job, "--schedule", str(path),
                                "--relative", *targets], capture_output=True, text=True, timeout=60)
            out = p.stdout + p.stderr
            for v, at in re.findall(r"schedule version (\d+) from progress ([\d,]+)", out):
                got = (int(v), int(at.replace(",", "")), table)
                if all(m[0] != got[0] for m in self.mixes):
                    self.mixes.append(got)
            (self.dir / "mix.log").open("a").write(out)
            if p.returncode == 0:
                return
            if "serves job" in out and not self.mixes and all(i.exited for i in list(self.incs)):
                # No feeder knows the job and its ranks are done (their streams all ended before a
                # restarted feeder saw them): nothing was changed, and the oracle expects nothing.
                return
            time.sleep(0.5)
        if "serves job" in out and not self.mixes:
            return   # (likewise: never taken anywhere, no change)
        self.errors.append(f"feeder mix did not succeed on every feeder within 60 s: {out[-300:]}")

    def go(self, inc: Incarnation) -> None:
        try:
            inc.conn.send("go")
        except (OSError, ValueError):
            pass

    def kill_rank(self, inc: Incarnation) -> None:
        inc.killed = True
        kill_group(inc.proc.pid)
        # on_exit starts it again from its last checkpoint

    def intrude(self, inc: Incarnation, f: Fault) -> None:
        """A client of the same job and rank that disagrees on one parameter, on a feeder where
        the job is live: it must be refused with FAILED_PRECONDITION (and disturb nobody)."""
        from feeder_client import FeederDataset
        from feeder.core.errors import Code, FeederError

        if self.sc.processes > 1:
            return   # the job's checks hold per process; which one it lands on is the kernel's choice
        if any(fn in (self.unclog, self.cont_feeder, self.restart_feeder) for _, _, fn, _ in self.timers):
            # A link or feeder fault is still in effect: the job's streams may drop between the
            # check below and the intruder's open, and a job nobody streams may restart with
            # other parameters (the elastic rule), so "refused" could not be judged (seed 300065).
            return
        live = [fd for fd in self.feeders if fd.proc.poll() is None and fd.stopped_pid is None
                and connected_ranks(fd.address, self.sc.job)]
        if not live:
            return
        sc = self.sc
        kw = dict(job=sc.job, rank=inc.slot, world_size=inc.world, seq_len=sc.seq_len, micro_batch=sc.micro_batch,
                  seed=sc.data_seed, shuffle=sc.shuffle, drop_last=sc.drop_last, epoch=sc.start_epoch,
                  num_epochs=sc.num_epochs)
        kw[f.detail] = kw[f.detail] + 1
        ds = FeederDataset([live[0].address], **kw, retry_for_s=5, idle_timeout_s=5, read_ahead=1,
                           failback_s=0, report_every_s=60, pin_memory=False)
        self.injected["disagree"] += 1
        log = self.dir / f"feeder-{self.feeders.index(live[0])}.log"
        skip = len(log.read_text(errors="replace").splitlines())
        try:
            next(iter(ds))
            if open_streams_before_intruder(log, skip, sc.job, inc.slot, inc.world):
                self.intruders.append(f"a rank disagreeing on {f.detail} ({kw[f.detail]}) was served by "
                                      f"{live[0].address} while the job was live there")
            else:
                # The job's last stream there had ended (the whole rest sent, seed 400489) or moved
                # to another feeder just before the intruder came: nobody streamed it, so it
                # restarted with the intruder's parameters, and the intruder, the newest process
                # of the rank's slot, took it over (pipeline/jobs.fence). The rank's process is
                # then refused there as replaced, should its stream come back, as a trainer whose
                # rank another process took; an operator restarts it from its checkpoint, and so
                # does on_exit (seed 4640073: the intruder's whole-sample slot is member 0's).
                inc.taken_over = True
        except FeederError as e:
            if e.code != Code.FAILED_PRECONDITION:
                self.intruders.append(f"a rank disagreeing on {f.detail} got {e.code.name}, expected "
                                      f"FAILED_PRECONDITION: {e}")
        finally:
            if ds.client is not None:
                ds.client.close()

    def on_exit(self, inc: Incarnation) -> None:
        inc.exited = True
        inc.proc.join(5)
        kill_group(inc.proc.pid)   # workers it left behind
        inc.exitcode = inc.proc.exitcode
        inc.conn.close()
        inc.parse()
        if inc.taken_over and inc.role == "main" and fenced_out(inc.end):
            inc.killed = True   # (see intrude: restarted from its last checkpoint, checked by position)
        if inc.release is not None:        # the newer one ended before its first batch
            self.go(inc.release)
            inc.release = None
        if inc.killed and inc.role == "main":
            pos, cur, reshard = inc.last_checkpoint()
            inc.role = "restarted"
            self.start_rank(inc.slot, inc.phase, inc.world, pos, cur, reshard)
        if self.phase == 1 and self.reshard and not any(not i.exited for i in self.incs):
            self.start_phase_two()

    def start_phase_two(self) -> None:
        self.phase = 2
        first = self.main_inc(0, 1)
        s = self.stop_at()
        # Any of rank 0's processes may have written it: one killed (restart) after its
        # checkpoint at the stop leaves a successor that starts there and takes nothing (seed 300157).
        ck = [c for i in self.incs if i.slot == 0 and i.phase == 1 for p, c in i.ckpts if p == s]
        if not ck:
            self.errors.append(f"reshard: rank 0 did not reach step {s} (its end: {first.end if first else None})")
            return
        # Every old rank's stream must be gone before ranks with another world size attach.
        deadline = time.monotonic() + 15
        while any(connected_ranks(fd.address, self.sc.job) for fd in self.feeders if fd.stopped_pid is None) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        self.injected["reshard"] += 1
        new = int(self.reshard.detail)
        for r in range(new):
            self.start_rank(r, 2, new, s, ck[0], True)

    # -- the whole run
    def setup(self) -> None:
        sc = self.sc
        corrupt_t = None
        if any(f.kind == "corrupt" for f in sc.faults):
            corrupt_t = next(f.target for f in sc.faults if f.kind == "corrupt") % sc.targets
            if sc.spread is False:
                corrupt_t = 0   # the replica every rank tries first
        args = ["--message-bytes", str(sc.message_bytes), "--prefetch-messages", str(sc.prefetch_messages),
                "--threads", "2"]
        if sc.kafka or sc.schedule or any(f.kind == "cache-damage" for f in sc.faults):
            # the feeders of the scenario are one region: a Kafka epoch's snapshot is built once;
            # and the cache a cache-damage fault damages is the scenario's own
            args += ["--cache-dir", str(self.dir / "cache")]
        for t in range(sc.targets):
            src = self.corpus.dataset if not sc.mixture else self.sources[0].dataset
            if t == corrupt_t:   # (a mixture's first source)
                where = corrupt_copy(src, self.dir / f"corrupt-{t}", self.rng)
                (self.dir / "corrupt.txt").write_text(where + "\n")
                src = self.dir / f"corrupt-{t}"
                self.injected["corrupt"] += 1
            more = []
            if sc.mixture:   # every source by name, the first (maybe corrupt) one given as `src`
                src = f"{sc.mixture[0][0]}={src}"
                more = [a for (name, _, _), c in zip(sc.mixture[1:], self.sources[1:])
                        for a in ("--source", f"{name}={c.dataset}")]
            self.feeders.append(Feeder(src, [*more, *args], self.dir / f"ledger-{t}.jsonl",
                                       self.dir / f"feeder-{t}.log", sc.processes))
        for fd in self.feeders:   # launched together, waited for together: their starts overlap
            fd.wait_ready()
        if sc.link_kbps or any(f.kind in ("reset", "blackhole", "slow") for f in sc.faults):
            try:
                self.links = [proxies().proxy(fd.address) for fd in self.feeders]
            except OSError:   # a server whose API hangs (see restart_proxies)
                proxies().restart()
                self.links = [proxies().proxy(fd.address) for fd in self.feeders]
            for link in self.links:
                self.unclog(link)

    def ledgers(self) -> list[str]:
        out = []
        for t in range(len(self.feeders)):
            base = self.dir / f"ledger-{t}.jsonl"
            out += [str(p) for p in [base, *(Path(f"{base}.{i}") for i in range(self.sc.processes))] if p.exists()]
        return out

    def run(self) -> list[str]:
        try:
            return self._run()
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Whatever happened: no rank, feeder or proxy of this scenario outlives it."""
        for i in self.incs:
            if i.proc is not None:
                kill_group(i.proc.pid)
                i.proc.join(5)
        for t in list(self.stopped):
            self.cont_feeder(t)
        for fd in self.feeders:
            fd.close()
        for link in self.links:
            drop_proxy(link)
        self.links = []

    def _run(self) -> list[str]:
        sc = self.sc
        self.setup()
        t0 = time.monotonic()
        for f in sc.faults:
            if f.kind in FEEDER_FAULTS and not f.at_batch:
                self.after(f.at_ms / 1000, self.inject_feeder, f)
        for r in range(sc.world):
            self.start_rank(r, 1, sc.world, 0, "", False)
        while True:
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, fn, args = heapq.heappop(self.timers)
                fn(*args)
            live = [i for i in self.incs if not i.exited]
            if not live:
                break
            if now - t0 > SCENARIO_BUDGET_S:
                self.errors.append(f"hang: ranks still running after {SCENARIO_BUDGET_S:.0f}s: " + ", ".join(
                    f"rank {i.slot} (phase {i.phase}, {i.role}) at position {i.start_pos + len(i.lines)}"
                    for i in live for _ in [i.parse()]))
                for i in live:
                    kill_group(i.proc.pid)
                    i.proc.join(5)
                    i.exited, i.exitcode = True, i.proc.exitcode
                    i.parse()
                break
            wait = min(0.2, max(0.0, self.timers[0][0] - now)) if self.timers else 0.2
            by_obj = {}
            for i in live:
                by_obj[i.conn] = ("msg", i)
                by_obj[i.proc.sentinel] = ("exit", i)
            for obj in mpc.wait(list(by_obj), timeout=wait):
                what, inc = by_obj[obj]
                if what == "msg" and not inc.exited:
                    try:
                        msg = inc.conn.recv()
                    except (EOFError, OSError):
                        continue
                    self.on_pause(inc, msg[1])
            for inc in live:
                if inc.proc.exitcode is not None and not inc.exited:
                    self.on_exit(inc)
        # Heal what is still broken, so the ledgers are whole, then stop the feeders.
        for t in list(self.stopped):
            self.cont_feeder(t)
        while self.timers:
            _, _, fn, args = heapq.heappop(self.timers)
            if fn != self.inject_feeder:   # a fault whose moment came after the end is not injected
                fn(*args)
        for t in self.mix_threads:   # a live change still being tried, now that every feeder is back and
            t.join(65)               # answers: its outcome is the oracle's (seeds 4610023: a feeder still
                                     # frozen; 4630028: one still to be restarted after a SIGTERM)
        self.cleanup()
        if any(i.repasses for i in self.incs):
            self.injected["repass"] += sum(i.repasses for i in self.incs)
        self.errors += self.intruders
        return self.errors
