"""The job registry: which jobs stream here, their ranks' state, and who holds each slot.

A job is its parameters (the sampling key every rank must share) and its open streams, one per
slot (rank, DataLoader worker, context-parallel size and rank, member: `slot_of`). The registry decides who may open a slot (the newest stream of
a slot wins, a replaced trainer process may not take its slot back: `fence`, `hold`) and keeps
what status and metrics show of each rank (RankState). Event-loop only: no locks, no I/O.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from feeder.core.config import StreamSpec
from feeder.core.errors import FailedPrecondition, NotFound
from feeder.core import scope
from feeder.core.sampling_key import job_key, job_mismatch
from feeder.pipeline.batcher import Block

log = logging.getLogger("feeder.stream")


class Stream(Protocol):
    """What the registry needs of an open stream (pipeline.stream.RankStream)."""

    spec: StreamSpec

    def supersede(self) -> None: ...


# Upper bounds (seconds) of the source read latency histogram.
READ_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class RankState:
    """What status and metrics show about one rank of one job."""

    rank: int
    connected: bool = False
    state: str = "streaming"     # streaming | all sent | finished (the loop took the last) | disconnected
    epoch: int = 0               # being sent
    samples_done: int = 0        # sent, of that epoch
    samples_in_epoch: int = 0
    batches_sent: int = 0
    bytes_sent: int = 0
    raw_bytes_sent: int = 0
    payload_bytes_sent: int = 0  # token bytes after compression
    tokens_sent: int = 0
    queue_depth: int = 0
    wait_s: float = 0.0
    step_s: float = 0.0
    last_error: str = ""
    peer: str = ""
    streams_opened: int = 0
    slots: set = field(default_factory=set)   # the slots (worker, member, cp rank) its streams held
    failovers: int = 0
    micro_batch: int = 1
    seq_len: int = 0
    taken_rate: float | None = None  # tokens/s the training loop takes (from its reports)
    consumed: tuple[int, int] | None = None   # (epoch, step) of the last batch the loop took
    last_sent: tuple[int, int] | None = None  # (epoch, step) of the last batch sent
    read_s: float = 0.0          # time spent reading the source for this rank's batches
    reads: int = 0
    read_buckets: list[int] = field(default_factory=lambda: [0] * (len(READ_BUCKETS) + 1))
    bad_records: int = 0         # skipped under bad_records=skip
    # The rank's client's view of its feed (its reports; docs/guarantees.md, "Slow, not dead"):
    # the target serving it, why it last moved, how often, delivered and consumed batches per
    # second, and the bytes of hedged copies it dropped.
    feed: dict = field(default_factory=dict)
    lag: dict[int, int] = field(default_factory=dict)   # a tailed source's: partition -> records behind its end (Plan.lag)
    mixture: tuple[str, ...] = ()    # a mixture's source names, in its order
    source_samples: dict[str, int] = field(default_factory=dict)   # samples sent from each
    # A model-parallel rank's open members, by (context-parallel rank, member): where each is
    # in the rank's stream and whether it reads the shared window (pipeline/members.py).
    members: dict[tuple[int, int], object] = field(default_factory=dict)
    window_builds: int = 0       # messages built once into the rank's windows for its members
    member_shared: int = 0       # messages members sent from a window
    member_solo: int = 0         # messages members built on their own (behind, or resumed elsewhere)
    rate_tokens: float = 0.0     # tokens/s, smoothed
    _rate_t: float = field(default_factory=time.monotonic)
    _rate_tokens: int = 0

    def sent(self, block: Block, wire: int) -> None:
        now = time.monotonic()
        k = len(block)
        toks = block.n_tokens
        self.read_s += block.read_s
        self.reads += k
        self.read_buckets[bisect.bisect_left(READ_BUCKETS, block.read_s / k)] += k   # each batch its share
        self.batches_sent += k
        self.bytes_sent += wire
        self.raw_bytes_sent += block.raw_bytes
        self.payload_bytes_sent += block.payload_bytes
        self.tokens_sent += toks
        if block.sources is not None and self.mixture:
            for d, c in enumerate(np.bincount(block.sources, minlength=len(self.mixture)).tolist()):
                name = self.mixture[d]
                self.source_samples[name] = self.source_samples.get(name, 0) + c
        self._rate_tokens += toks
        if now - self._rate_t >= 1.0:
            rate = self._rate_tokens / (now - self._rate_t)
            self.rate_tokens = rate if self.rate_tokens == 0 else 0.5 * self.rate_tokens + 0.5 * rate
            self._rate_t, self._rate_tokens = now, 0

    @property
    def restarts(self) -> int:
        """Streams opened after the first of each slot: a stream per DataLoader worker, member and
        context-parallel rank is none."""
        return max(0, self.streams_opened - max(1, len(self.slots)))

    @property
    def tokens_per_s(self) -> float:
        """What the rank consumes (reported) while connected; until it reports, what is sent."""
        if not self.connected:
            return 0.0
        return self.taken_rate if self.taken_rate is not None else self.rate_tokens

    @property
    def data_wait_fraction(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, samples of it) the rank's loop has taken, from its reports; (epoch being
        sent, 0) until its first report: what was sent runs ahead by the prefetch, the network's
        buffers and the client's read-ahead, and is never shown as taken."""
        if self.consumed is not None:
            epoch, step = self.consumed
            return epoch, min(self.samples_in_epoch, (step + 1) * self.micro_batch)
        return self.epoch, 0

    def took(self, position: tuple[int, int]) -> None:
        """The rank's loop reports the (epoch, step) of the last batch it took."""
        self.consumed = position
        if self.state == "all sent" and self.last_sent is not None and position >= self.last_sent:
            self.state = "finished"

    def all_sent(self) -> None:
        """The stream ran to its end: finished once the loop has taken the last batch too."""
        done = self.consumed is not None and self.last_sent is not None and self.consumed >= self.last_sent
        self.state = "finished" if done else "all sent"


@dataclass
class Job:
    job: str
    dataset: str
    key: tuple          # the parameters every rank of the job must share
    world_size: int
    ranks: dict[int, RankState] = field(default_factory=dict)
    streams: dict[tuple[int, int, int, int, int], Stream] = field(default_factory=dict)
    # A model-parallel rank's shared windows of messages, by what their members receive
    # (pipeline/members.py: share_key).
    windows: dict[tuple, object] = field(default_factory=dict)
    idle_since: float | None = None   # monotonic time its last stream closed
    # (rank, worker) -> the start time of the trainer process holding it, and those of the
    # processes it replaced here: see fence(). Kept when streams close: that is when a replaced
    # process may come back.
    holders: dict[tuple[int, int], int] = field(default_factory=dict)
    replaced: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    # Side streams (StreamSpec.hedge: a hedged read or a probe of a rank whose stream is
    # elsewhere, client/gray.py) open now: they take no slot.
    hedges: set = field(default_factory=set)


def unknown_job(job: str, known) -> NotFound:
    """The error for a job nobody streams here, naming those that are (one process's or all's)
    and that the caller may see (feeder.core.scope: another team's job names are not said)."""
    return NotFound(f"job {job!r} is not known to this feeder (known: {scope.current().names(known) or 'none'})")


class Jobs:
    """All jobs this feeder serves. Event-loop only (no locks needed).

    A job nobody has streamed for `idle_ttl_s` is forgotten (status stops showing it), so a
    feeder that runs for months does not keep every job it ever served."""

    def __init__(self, idle_ttl_s: float = 24 * 3600, clock=time.monotonic):
        self.jobs: dict[str, Job] = {}
        self.idle_ttl_s, self.clock = idle_ttl_s, clock

    def evict_idle(self) -> list[str]:
        now = self.clock()
        gone = [name for name, j in self.jobs.items()
                if not j.streams and not j.hedges and j.idle_since is not None and now - j.idle_since > self.idle_ttl_s]
        for name in gone:
            del self.jobs[name]
            log.info("job %s forgotten after %.0f s without streams", name, self.idle_ttl_s)
        return gone

    def get(self, job: str) -> Job:
        j = self.jobs.get(job)
        if j is None:
            raise unknown_job(job, self.jobs)
        return j

    def attach(self, spec: StreamSpec, stream: Stream) -> RankState:
        self.evict_idle()
        key = job_key(spec)
        j = self.jobs.get(spec.job)
        fenced = {}
        if j is not None:
            fence(j, spec)
            fenced = dict(holders=j.holders, replaced=j.replaced)
        if j is not None and j.key != key:
            if j.streams:
                # Live ranks define the job; a rank with other parameters would get other samples.
                raise job_mismatch(spec.job, j.key, key)
            j = None  # nobody is connected: the job restarts with new parameters (e.g. elastic)
        if j is None:
            j = self.jobs[spec.job] = Job(job=spec.job, key=key, world_size=spec.world_size,
                                          dataset=spec.dataset or "+".join(n for n, _ in spec.mixture),
                                          **fenced)
        if spec.hedge:
            # A second copy of batches the rank reads elsewhere: it neither replaces the rank's
            # stream of its slot nor is replaced by it, and the rank's status stays the stream's.
            j.hedges.add(stream)
            j.idle_since = None
            return RankState(rank=spec.rank, connected=True, state="hedge", micro_batch=spec.micro_batch,
                             seq_len=spec.seq_len, mixture=tuple(n for n, _ in spec.mixture))
        slot = slot_of(spec)
        agree(j, spec, slot)
        hold(j, slot, spec)
        old = j.streams.get(slot)
        if old is not None:
            # The newest stream of a rank wins: an older one is a peer that failed over or restarted.
            old.supersede()
        j.streams[slot] = stream
        j.idle_since = None
        state = j.ranks.setdefault(spec.rank, RankState(rank=spec.rank))
        state.connected, state.state = True, "streaming"
        state.streams_opened += 1
        state.slots.add(slot)
        state.micro_batch, state.seq_len = spec.micro_batch, spec.seq_len
        state.mixture = tuple(n for n, _ in spec.mixture)
        return state

    def detach(self, spec: StreamSpec, stream: Stream) -> None:
        j = self.jobs.get(spec.job)
        if j is None:
            return
        if spec.hedge:
            j.hedges.discard(stream)
            if not j.streams and not j.hedges:
                j.idle_since = self.clock()
            return
        slot = slot_of(spec)
        if j.streams.get(slot) is stream:
            del j.streams[slot]
        if not any(r == spec.rank for r, *_ in j.streams):
            j.ranks[spec.rank].connected = False
            j.ranks[spec.rank].queue_depth = 0   # its queue went with its stream
        if not j.streams and not j.hedges:
            j.idle_since = self.clock()

    @property
    def streams_open(self) -> int:
        return sum(len(j.streams) + len(j.hedges) for j in self.jobs.values())


def fence(job: Job, spec: StreamSpec) -> None:
    """Refuse a continued stream of a slot (rank, worker) from a process that was replaced there.

    The newest stream of a slot wins, which is how a restarted trainer takes its rank over. But
    a replaced process whose own stream broke for another reason (a reset, the feeder's
    SIGTERM) reconnects without knowing it was replaced; its stream would then be the newest
    and displace the live process (soak seed 200307). A reconnect is a continued stream
    (StreamSpec.continued), and a process is named by its start time (client_started_ns):
      * a first stream is never refused: its process now holds the slot (a restarted trainer,
        a pool of processes reusing a job name, a new pass), and the holder it displaced is
        recorded as replaced;
      * a continued stream from the holder is its own reconnect;
      * a continued stream from a process replaced here is refused;
      * one from a process this feeder has not seen on the slot (it streamed on another feeder
        or process of this port, or this feeder restarted) is refused if it is older than the
        holder, else it takes over: of two processes that both reconnect, the younger is the
        replacement (soak seed 600390: under `serve --processes 2` the replacement had opened
        its first stream on the other process).
    0 (an older client) is neither fenced nor recorded. Across hosts the time order needs
    clocks that agree far better than a restart takes (NTP: milliseconds)."""
    if spec.elastic or spec.hedge:
        # (A side stream takes no slot: nothing to fence.) An elastic job's rank is a replica index of one step's world: torchft hands it to
        # another group whenever the quorum changes, so it names no process. A group that held
        # replica 1, lost it to another and got it back, then failed over to a feeder that saw
        # only the middle of that, was refused here and crashed (CI, the torchft test). Which
        # group trains a step is the quorum's to say; the commit log keeps it exact.
        return
    t, slot = spec.client_started_ns, slot_of(spec)
    holder = job.holders.get(slot, 0)
    if not (spec.continued and t and holder) or t == holder:
        return
    if t in job.replaced.get(slot, ()):
        why = "it was replaced here by another process"
    elif t < holder:
        why = f"a process that started {(holder - t) / 1e9:.9f} s later holds it"
    else:
        return
    raise FailedPrecondition(
        f"stream of job {spec.job!r} rank {spec.rank} ({_slot_name(spec)}) continues a stream of a trainer "
        f"process that no longer holds this rank: {why} (a restarted trainer took the rank over), so this one "
        "may not take it back")


def agree(job: Job, spec: StreamSpec, slot: tuple) -> None:
    """Refuse a stream whose model-parallel layout differs from its rank's open streams': the
    context-parallel ranks of a rank must split samples alike (another cp_size or cp_layout
    would leave positions untrained or trained twice), and the members of one context-parallel
    rank must count themselves alike. (A stream of whole samples beside them is fine: it reads
    the rank's stream, as a logger or an evaluator may.) The stream it would replace, in its
    own slot, does not count: a restarted member may come back with another layout."""
    for other_slot, other in job.streams.items():
        o = other.spec
        if other_slot == slot or o.rank != spec.rank:
            continue
        if spec.cp_size > 1 and o.cp_size > 1 and (o.cp_size, o.cp_layout) != (spec.cp_size, spec.cp_layout):
            raise FailedPrecondition(
                f"rank {spec.rank} of job {spec.job!r} is split for context parallelism with cp_size={o.cp_size}, "
                f"cp_layout={o.cp_layout!r} by its open streams; this one asks for cp_size={spec.cp_size}, "
                f"cp_layout={spec.cp_layout!r}. Every context-parallel rank of a rank must split alike")
        if (o.cp_size, o.cp_rank) == (spec.cp_size, spec.cp_rank) and o.members != spec.members:
            raise FailedPrecondition(
                f"rank {spec.rank} of job {spec.job!r} is read by members=K={o.members} processes (its open "
                f"streams say); this one says members={spec.members}. Every member of a rank must pass the same "
                "members (and each its own member=k)")


def slot_of(spec: StreamSpec) -> tuple[int, int, int, int, int]:
    """What one stream holds: (rank, DataLoader worker, cp_size, context-parallel rank, member).
    Each member of a model-parallel rank is fenced, replaced and resumed on its own; a stream of
    whole samples (cp_size 1) is apart from context-parallel rank 0's."""
    return spec.rank, spec.worker_index, spec.cp_size, spec.cp_rank, spec.member


def _slot_name(spec: StreamSpec) -> str:
    parts = [f"worker {spec.worker_index}"]
    if spec.cp_size > 1:
        parts.append(f"context-parallel rank {spec.cp_rank}")
    if spec.members > 1:
        parts.append(f"member {spec.member}")
    return ", ".join(parts)


def hold(job: Job, slot: tuple, spec: StreamSpec) -> None:
    """Record an accepted stream's process as the slot's holder (see fence)."""
    t = spec.client_started_ns
    if not t or spec.elastic or spec.hedge:
        return
    replaced = job.replaced.setdefault(slot, set())
    old = job.holders.get(slot, 0)
    if old and old != t:
        replaced.add(old)
        if len(replaced) > 64:   # a slot's history need not grow without end
            replaced.discard(min(replaced))
    if not spec.continued:
        replaced.discard(t)   # a first stream is meant: a process may take a slot back afresh
    job.holders[slot] = t
