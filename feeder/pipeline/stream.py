"""Open streams: the job registry, per-rank state, and the bounded prefetch queue.

Each stream has one producer task that builds whole messages (a Block of batches, up to
`message_bytes` of raw tokens, framed into reply bytes) on the shared thread pool and puts
them in a queue bounded both in messages and bytes. However slowly the peer reads, a stream
holds at most that budget.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import numpy as np

from feeder.config import ServeConfig, StreamSpec
from feeder.errors import FailedPrecondition, FeederError, NotFound
from feeder.cursor import CursorWriter
from feeder.pipeline.batcher import Block, block_from_runs
from feeder.planning import PENDING, Pending, PlannedRun
from feeder.sampling_key import job_key, job_mismatch
from feeder.sources import Plan

log = logging.getLogger("feeder.stream")
MAX_BATCHES_PER_MESSAGE = 256
# While a plan waits on something being built (Plan.waiting), the producer looks again every
# WAITING_POLL_S and tells the rank every WAITING_EVERY_S (well inside its idle timeout).
WAITING = object()
WAITING_POLL_S = 0.2
WAITING_EVERY_S = 1.0

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
    kafka_lag: dict[int, int] = field(default_factory=dict)   # partition -> records behind the end
    mixture: tuple[str, ...] = ()    # a mixture's source names, in its order
    source_samples: dict[str, int] = field(default_factory=dict)   # samples sent from each
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
    streams: dict[tuple[int, int], "RankStream"] = field(default_factory=dict)
    idle_since: float | None = None   # monotonic time its last stream closed
    # (rank, worker) -> the start time of the trainer process holding it, and those of the
    # processes it replaced here: see fence(). Kept when streams close: that is when a replaced
    # process may come back.
    holders: dict[tuple[int, int], int] = field(default_factory=dict)
    replaced: dict[tuple[int, int], set[int]] = field(default_factory=dict)


def unknown_job(job: str, known) -> NotFound:
    """The error for a job nobody streams here, naming those that are (one process's or all's)."""
    return NotFound(f"job {job!r} is not known to this feeder (known: {sorted(known) or 'none'})")


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
                if not j.streams and j.idle_since is not None and now - j.idle_since > self.idle_ttl_s]
        for name in gone:
            del self.jobs[name]
            log.info("job %s forgotten after %.0f s without streams", name, self.idle_ttl_s)
        return gone

    def get(self, job: str) -> Job:
        j = self.jobs.get(job)
        if j is None:
            raise unknown_job(job, self.jobs)
        return j

    def attach(self, spec: StreamSpec, stream: "RankStream") -> RankState:
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
        slot = (spec.rank, spec.worker_index)
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
        state.micro_batch, state.seq_len = spec.micro_batch, spec.seq_len
        state.mixture = tuple(n for n, _ in spec.mixture)
        return state

    def detach(self, spec: StreamSpec, stream: "RankStream") -> None:
        j = self.jobs.get(spec.job)
        if j is None:
            return
        slot = (spec.rank, spec.worker_index)
        if j.streams.get(slot) is stream:
            del j.streams[slot]
        if not any(r == spec.rank for r, _ in j.streams):
            j.ranks[spec.rank].connected = False
            j.ranks[spec.rank].queue_depth = 0   # its queue went with its stream
        if not j.streams:
            j.idle_since = self.clock()

    @property
    def streams_open(self) -> int:
        return sum(len(j.streams) for j in self.jobs.values())


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
    t, slot = spec.client_started_ns, (spec.rank, spec.worker_index)
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
        f"stream of job {spec.job!r} rank {spec.rank} (worker {spec.worker_index}) continues a stream of a trainer "
        f"process that no longer holds this rank: {why} (a restarted trainer took the rank over), so this one "
        "may not take it back")


def hold(job: Job, slot: tuple[int, int], spec: StreamSpec) -> None:
    """Record an accepted stream's process as the slot's holder (see fence)."""
    t = spec.client_started_ns
    if not t:
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


class RankStream:
    def __init__(self, spec: StreamSpec, plan: Plan, cfg: ServeConfig, pool: ThreadPoolExecutor,
                 serialize: Callable[[Block], bytes]):
        self.spec, self.plan, self.cfg = spec, plan, cfg
        # A plan that blocks on its source (tailing Kafka) brings a thread of its own, so it
        # never holds the shared pool's threads away from other streams.
        self.pool = plan.executor or pool
        self.serialize = serialize   # a message's wire bytes, built here on the pool threads
        self.state: RankState | None = None
        # The prefetch queue: messages built ahead, bounded in count and bytes.
        self._items: deque = deque()
        self._bytes = 0
        self._changed = asyncio.Event()
        self._end: BaseException | None = None   # set once: what ends the stream after the queue drains
        self._finished = False
        self._deferred: FeederError | None = None
        self._producer: asyncio.Task | None = None
        self._cap = 1                # batches allowed in the next message (doubles up to the maximum)
        self._raw_batch_bytes = spec.micro_batch * (spec.seq_len + 1) * plan.dtype.itemsize
        # The stream is taken in runs: planned, read and framed a block at a time. A DataLoader
        # worker's share is every num_workers-th batch, each a run of its own.
        self._runs = self._selected() if spec.num_workers > 1 else plan.runs(MAX_BATCHES_PER_MESSAGE)
        self._rest: PlannedRun | None = None   # the part of a run the last message had no room for
        self._cursors = CursorWriter(plan.cursor_template(), cfg.cursor_secret)

    def supersede(self) -> None:
        """A newer stream of the same rank took over: end this one with a clear reason."""
        self.end(FailedPrecondition(f"stream of job {self.spec.job!r} rank {self.spec.rank} was replaced by a "
                                    "newer stream of the same rank"))

    def end(self, error: FeederError) -> None:
        """Drop what is queued and end the stream with `error` (its cursor lets the peer resume).

        The error wins even over a producer that already finished: the messages it queued are
        dropped here, so ending with OK would tell the peer a truncated stream was complete."""
        if self._producer is not None:
            self._producer.cancel()
        self._items.clear()
        self._bytes = 0
        self._finish(error)
        self._end = error

    def _finish(self, error: BaseException | None) -> None:
        if not self._finished:
            self._finished, self._end = True, error
            self.plan.close()   # a plan blocked on its source (Kafka follow) lets its thread go
        self._changed.set()

    def _selected(self) -> Iterator[PlannedRun | Pending]:
        """A DataLoader worker's share: batch k (counting from the cursor) is worker k mod W's.
        The count starts at the phase the worker asked for, not at 0: a worker reopening from
        its own last batch's cursor is one past its own index."""
        k, w, i = self.spec.worker_phase, self.spec.num_workers, self.spec.worker_index
        for run in self.plan.runs(MAX_BATCHES_PER_MESSAGE):
            if run is PENDING:
                yield run
                continue
            for j in range((i - k) % w, len(run), w):
                yield run.one(j)
            k += len(run)

    def _take(self, want: int) -> list[PlannedRun]:
        """Up to `want` batches, as runs; fewer when the plan ends or has nothing ready (PENDING)."""
        out, got = [], 0
        while got < want:
            try:
                run, self._rest = self._rest or next(self._runs, None), None
            except FeederError as e:  # a plan that reads (Kafka: a bad record under bad_records=fail)
                if not out:
                    raise
                self._deferred = e   # the good batches before it go out first
                break
            if run is None:
                break
            if run is PENDING:  # nothing ready (a tailed topic, an order being built): send what is taken
                if out or self._finished or self.plan.waiting:
                    break
                continue
            if len(run) > want - got:
                run, self._rest = run.split(want - got)
            out.append(run)
            got += len(run)
        return out

    def _block(self, runs: list[PlannedRun]) -> Block:
        s = self.spec
        return block_from_runs(self.plan, runs, seq_len=s.seq_len, compression=s.compression,
                               level=s.compression_level, cursors=self._cursors)

    def _singles(self, runs: list[PlannedRun]) -> Iterator[list[PlannedRun]]:
        """The runs as one-batch pieces, in order."""
        for run in runs:
            for j in range(len(run)):
                yield [run.one(j)]

    def _build_message(self) -> tuple[Block, bytes] | None:
        """Runs on a pool thread: the next message's batches, read, encoded and framed."""
        if self._deferred is not None:
            raise self._deferred
        # Slow start: message k holds at most 2**k batches (the first one batch: time to first
        # batch), so over a thin or long link the rank's second batch does not wait behind a
        # megabyte; then messages fill up to message_bytes of tokens, but never with so many
        # small batches that one message takes long to build.
        want = max(1, min(self._cap, -(-self.cfg.message_bytes // self._raw_batch_bytes)))
        items = self._take(want)
        if not items:
            return WAITING if self.plan.waiting else None
        try:
            block = self._block(items)
        except FeederError as e:  # from the source (corrupt shard, bad Kafka record, ...)
            # Send the good batches before the bad one first, then end with the error.
            good = []
            for one in self._singles(items):
                try:
                    self._block(one)
                except FeederError:
                    break
                good += one
            if not good:
                raise
            self._deferred = e
            block = self._block(good)
        self._cap = min(2 * self._cap, MAX_BATCHES_PER_MESSAGE)
        t0 = time.perf_counter()
        wire = self.serialize(block)
        return block.framed(time.perf_counter() - t0 if block.rows is not None else 0.0), wire

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        try:
            told = 0.0
            while True:
                built = await loop.run_in_executor(self.pool, self._build_message)
                if self._finished:
                    return
                if built is WAITING:
                    # The rank hears why nothing comes (and that this feeder is alive: it does
                    # not fail over on its idle timeout while every feeder builds the same order).
                    if not self._items and time.monotonic() - told >= WAITING_EVERY_S:
                        told = time.monotonic()
                        self._items.append(((None, self.plan.waiting), 0))
                        self._changed.set()
                    await asyncio.sleep(WAITING_POLL_S)
                    continue
                if built is None:
                    self._finish(None)
                    return
                size = len(built[1])
                # Wait for room; one message always fits, so a huge one cannot deadlock.
                while self._items and (len(self._items) >= cfg.prefetch_messages
                                       or self._bytes + size > cfg.prefetch_bytes):
                    self._changed.clear()
                    await self._changed.wait()
                    if self._finished:
                        return
                self._items.append((built, size))
                self._bytes += size
                if self.state is not None:   # status shows the queue as it is, not as at the last send
                    self.state.queue_depth = len(self._items)
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except FeederError as e:
            self._finish(e)
        except Exception as e:  # a bug: end the stream with an error rather than hang it
            log.exception("stream %s rank %d: producer failed", self.spec.job, self.spec.rank)
            self._finish(e)

    async def messages(self) -> AsyncIterator[tuple[Block, bytes]]:
        self._producer = asyncio.create_task(self._produce())
        try:
            while True:
                while not self._items:
                    if self._finished:
                        if self._end is not None:
                            raise self._end
                        return
                    self._changed.clear()
                    await self._changed.wait()
                (block, wire), size = self._items.popleft()
                self._bytes -= size
                self._changed.set()
                st = self.state
                if block is None:   # waiting: `wire` says on what
                    yield block, wire
                    continue
                if st is not None:
                    st.bad_records = self.plan.bad_records
                    st.kafka_lag = dict(self.plan.lag)
                    per = block.samples_in_epoch
                    st.epoch, st.samples_in_epoch = int(block.epochs[-1]), per
                    st.samples_done = min(per, (int(block.steps[-1]) + 1) * self.spec.micro_batch)
                    last = (int(block.epochs[-1]), int(block.steps[-1]))
                    st.last_sent = last if st.last_sent is None else max(st.last_sent, last)
                    st.queue_depth = len(self._items)
                yield block, wire
        finally:
            self._finish(None)
            if not self._producer.done():
                self._producer.cancel()
                try:
                    await self._producer
                except (asyncio.CancelledError, Exception):
                    pass
