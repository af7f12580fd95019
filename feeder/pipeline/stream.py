"""Open streams: one producer per stream and its bounded prefetch queue (the job registry
they are attached to is pipeline/jobs.py).

Each stream has one producer task that builds whole messages (a Block of batches, up to
`message_bytes` of raw tokens, framed into reply bytes) on the shared thread pool and puts
them in a queue bounded both in messages and bytes. However slowly the peer reads, a stream
holds at most that budget; and all the streams (and members' windows) of a server together
hold at most its MemoryBudget (issue 44.5: one peer holding 200 streams unread grew the
process by 10.7 MB a stream).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Iterator

from feeder.core import context
from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.cursor import CursorWriter
from feeder.core.errors import FailedPrecondition, FeederError, ResourceExhausted
from feeder.core.planning import PENDING, Pending, PlannedRun
from feeder.pipeline.batcher import Block, block_from_runs
from feeder.pipeline.jobs import RankState
from feeder.pipeline.reads import Reads
from feeder.sources import Plan

log = logging.getLogger("feeder.stream")
MAX_BATCHES_PER_MESSAGE = 256
# While a plan waits on something being built (Plan.waiting), the producer looks again every
# WAITING_POLL_S and tells the rank every WAITING_EVERY_S (well inside its idle timeout).
WAITING = object()
UNTIL = object()   # a message would start at its `until`: nothing comes before it
WAITING_POLL_S = 0.2
WAITING_EVERY_S = 1.0


def host_memory_bytes() -> int:
    """The memory this process may use: the host's, or its cgroup's limit where lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v.isdigit():
            total = min(total, int(v))
    return total


def default_budget_bytes(processes: int = 1) -> int:
    """An eighth of the host's (or cgroup's) memory, shared by the processes of the port, within
    64 MiB and 16 GiB."""
    return max(64 << 20, min(16 << 30, host_memory_bytes() // 8 // max(1, processes)))


WAKE_AT_ONCE = 4


class MemoryBudget:
    """The bytes of messages built and not yet handed to gRPC, over every stream and members'
    window of a server (event-loop only). A stream's first message is always allowed (a
    stream that may hold nothing cannot be served). More are built while the total stays
    within EXTRA_SHARE of the budget: past half of it every stream's read-ahead shrinks to one
    message, the other half is left to the first messages of streams (one each). Once the total
    reaches the budget a new stream is refused with RESOURCE_EXHAUSTED (`admit`), which the
    client takes as a break and tries again; the streams already open keep their service."""

    EXTRA_SHARE = 0.5

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.refused = 0       # streams refused since the start
        self.held_back = 0     # times a stream's read-ahead was held back by the budget
        self._waiters: deque[Callable[[], None]] = deque()

    def charge(self, n: int) -> None:
        self.used += n
        self._wake(1)   # (room left after a woken stream took its part: the next one is asked)

    def release(self, n: int) -> None:
        """`n` bytes left (sent, or dropped with their stream): where that makes room, the
        streams held back longest are asked again, a few at a time (not all 200 held streams at
        each message another job reads)."""
        self.used -= n
        self._wake(WAKE_AT_ONCE)

    def _wake(self, k: int) -> None:
        for _ in range(k):
            if not self._waiters or self.used >= self.limit * self.EXTRA_SHARE:
                break
            self._waiters.popleft()()

    def wait(self, wake: Callable[[], None]) -> None:
        """`wake` is called when a release makes room (a stream held back waits for it)."""
        if wake not in self._waiters:
            self._waiters.append(wake)

    def more(self, size: int) -> bool:
        """May a stream (or window) that holds a message built ahead hold `size` bytes more?"""
        if self.used + size <= self.limit * self.EXTRA_SHARE:
            return True
        self.held_back += 1
        return False

    def admit(self, spec: StreamSpec) -> None:
        if self.used < self.limit:
            return
        self.refused += 1
        mib = 2**20
        raise ResourceExhausted(
            f"stream of job {spec.job!r} rank {spec.rank} refused: this feeder's open streams hold "
            f"{self.used / mib:.0f} MiB of messages their peers have not read, its whole memory budget "
            f"({self.limit / mib:.0f} MiB; feeder serve --memory-budget-mb). Streams that are opened and not read "
            "hold it: close them (or read them), try again later or another feeder, or give this one a larger "
            "--memory-budget-mb")


class Producer:
    """Builds one stream's messages from its plan: runs taken up to a message's budget, read,
    encoded and framed (on the pool threads). A RankStream has one; so does a Window, which
    builds a data-parallel rank's messages once for all its members."""

    def __init__(self, spec: StreamSpec, plan: Plan, cfg: ServeConfig, serialize: Callable[[Block], bytes]):
        self.spec, self.plan, self.cfg, self.serialize = spec, plan, cfg, serialize
        self._deferred: FeederError | None = None
        self._cap = 1                # batches allowed in the next message (doubles up to the maximum)
        self._raw_batch_bytes = spec.micro_batch * (spec.seq_len + 1) * plan.dtype.itemsize
        # The stream is taken in runs: planned, read and framed a block at a time. A DataLoader
        # worker's share is every num_workers-th batch, each a run of its own.
        self._runs = self._selected() if spec.num_workers > 1 else plan.runs(MAX_BATCHES_PER_MESSAGE)
        self._rest: PlannedRun | None = None   # the part of a run the last message had no room for
        self._cursors = CursorWriter(plan.cursor_template(), cfg.cursor_secret)
        # A context-parallel member's windows of each sample (None: the whole sample).
        self._windows = None if spec.cp_size == 1 else \
            context.windows(spec.seq_len, spec.cp_size, spec.cp_rank, spec.cp_layout)
        self.finished = False        # set by the owner: stop taking runs (the plan may be closed)

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

    def _take(self, want: int, until: tuple[int, int] | None = None) -> list[PlannedRun]:
        """Up to `want` batches, as runs; fewer when the plan ends or has nothing ready (PENDING),
        or at the first batch at or past (epoch, step) `until` (left for the next message)."""
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
                if out or self.finished or self.plan.waiting:
                    break
                continue
            if until is not None:
                before = _before(run, until)
                if before < len(run):   # `until` is in this run: the message ends before it
                    k = min(before, want - got)
                    if k == 0:
                        self._rest = run
                    else:
                        run, self._rest = run.split(k)
                        out.append(run)
                    break
            if len(run) > want - got:
                run, self._rest = run.split(want - got)
            out.append(run)
            got += len(run)
        return out

    def _block(self, runs: list[PlannedRun]) -> Block:
        s = self.spec
        return block_from_runs(self.plan, runs, seq_len=s.seq_len, compression=s.compression,
                               level=s.compression_level, cursors=self._cursors, windows=self._windows)

    def _singles(self, runs: list[PlannedRun]) -> Iterator[list[PlannedRun]]:
        """The runs as one-batch pieces, in order."""
        for run in runs:
            for j in range(len(run)):
                yield [run.one(j)]

    def build(self, until: tuple[int, int] | None = None) -> tuple[Block, bytes] | None:
        """Runs on a pool thread: the next message's batches, read, encoded and framed; WAITING
        while the plan waits on something being built; None at the plan's end. `until`: the
        message ends before the batch at (epoch, step) `until` (a member catching up with its
        rank's window ends its message where one of the window's begins)."""
        if self._deferred is not None:
            raise self._deferred
        # Slow start: message k holds at most 2**k batches (the first one batch: time to first
        # batch), so over a thin or long link the rank's second batch does not wait behind a
        # megabyte; then messages fill up to message_bytes of tokens, but never with so many
        # small batches that one message takes long to build.
        want = max(1, min(self._cap, -(-self.cfg.message_bytes // self._raw_batch_bytes)))
        items = self._take(want, until)
        if not items:
            if self._rest is not None:   # stopped at `until` with nothing before it
                return UNTIL
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


def _before(run: PlannedRun, until: tuple[int, int]) -> int:
    """How many of the run's batches come before (epoch, step) `until`."""
    epoch, step = until
    if run.epoch != epoch:
        return len(run) if run.epoch < epoch else 0
    return max(0, min(len(run), step - run.step))


class RankStream:
    def __init__(self, spec: StreamSpec, plan: Plan, cfg: ServeConfig, pool: ThreadPoolExecutor,
                 serialize: Callable[[Block], bytes], budget: MemoryBudget | None = None):
        self.spec, self.plan, self.cfg = spec, plan, cfg
        self.budget = budget if budget is not None else MemoryBudget(1 << 62)
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
        self._producer: asyncio.Task | None = None
        self._held = 0   # bytes of the built message the producer holds while it waits for room
        self._build = Producer(spec, plan, cfg, serialize)
        # A member of a model-parallel rank (spec.members > 1) takes its messages from the
        # rank's Window while it is within it (pipeline/members.py).
        self.member = None
        # Where its builds are recorded while their threads run them, and the sources they read
        # (set by the engine: a build that never returns is a stuck read, pipeline/reads.py).
        self.reads: Reads | None = None
        self.read_names: tuple[str, ...] = ()

    def supersede(self) -> None:
        """A newer stream of the same slot took over: end this one with a clear reason."""
        s = self.spec
        hint = ("" if s.members > 1 else
                f". If several processes consume data-parallel rank {s.rank} (its tensor-parallel ranks, its "
                "pipeline stages), give each member=k and members=K (FeederDataset(..., member=k, members=K), "
                "k = 0..K-1); they then all receive the same batches")
        who = f"member {s.member} of " if s.members > 1 else ""
        cp = f" context-parallel rank {s.cp_rank}" if s.cp_size > 1 else ""
        self.end(FailedPrecondition(f"stream of job {s.job!r} {who}rank {s.rank}{cp} was replaced by a newer "
                                    f"stream of the same {who}rank{hint}"))

    def end(self, error: FeederError) -> None:
        """Drop what is queued and end the stream with `error` (its cursor lets the peer resume).

        The error wins even over a producer that already finished: the messages it queued are
        dropped here, so ending with OK would tell the peer a truncated stream was complete."""
        if self._producer is not None:
            self._producer.cancel()
        self._items.clear()
        self.budget.release(self._bytes)
        self._bytes = 0
        self._finish(error)
        self._end = error

    def _finish(self, error: BaseException | None) -> None:
        if not self._finished:
            self._finished, self._end = True, error
            self._build.finished = True
            self.plan.close()   # a plan blocked on its source (Kafka follow) lets its thread go
            if self.member is not None:
                self.member.leave()
        self._changed.set()

    def _build_message(self) -> tuple[Block, bytes] | None:
        return self._build.build()

    async def _build_next(self, loop):
        if self.reads is None:
            return await loop.run_in_executor(self.pool, self._build_message)
        s = self.spec
        return await self.reads.run(self.pool, self._build_message, names=self.read_names,
                                    what=f"job {s.job} rank {s.rank}", streams=(self,))

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        try:
            told = 0.0
            while True:
                # Past its first message a stream builds the next only while the server's
                # budget has room (the last message's size standing for the next one's): where
                # it has none, its read-ahead is the one message queued.
                while self._items and not self.budget.more(self._items[-1][1]):
                    self._changed.clear()
                    self.budget.wait(self._changed.set)
                    await self._changed.wait()
                    if self._finished:
                        return
                built = await self._build_next(loop)
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
                # Held here, it counts in the budget as much as queued (it is released when sent).
                self.budget.charge(size)
                self._held = size
                # Wait for room; one message always fits, so a huge one cannot deadlock.
                while self._items and (len(self._items) >= cfg.prefetch_messages
                                       or self._bytes + size > cfg.prefetch_bytes):
                    self._changed.clear()
                    await self._changed.wait()
                    if self._finished:
                        return
                self._held = 0
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

    def _note(self, block: Block) -> None:
        """What status shows of the rank, from a message about to be sent."""
        st = self.state
        if st is None:
            return
        st.bad_records = self.live_plan.bad_records
        st.lag = dict(self.live_plan.lag)
        per = block.samples_in_epoch
        st.epoch, st.samples_in_epoch = int(block.epochs[-1]), per
        st.samples_done = min(per, (int(block.steps[-1]) + 1) * self.spec.micro_batch)
        last = (int(block.epochs[-1]), int(block.steps[-1]))
        st.last_sent = last if st.last_sent is None else max(st.last_sent, last)
        st.queue_depth = len(self._items)

    @property
    def live_plan(self) -> Plan:
        """The plan this stream's batches come from now (a member's rank window's, while in it)."""
        m = self.member
        return m.window.plan if m is not None and m.joined else self.plan

    async def messages(self) -> AsyncIterator[tuple[Block, bytes]]:
        if self.member is not None:   # a member of a model-parallel rank (pipeline/members.py)
            try:
                async for block, wire in self.member.messages():
                    if block is not None:
                        self._note(block)
                    yield block, wire
            finally:
                self._finish(None)
            return
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
                self.budget.release(size)
                self._changed.set()
                if block is None:   # waiting: `wire` says on what
                    yield block, wire
                    continue
                self._note(block)
                yield block, wire
        finally:
            self._finish(None)
            if not self._producer.done():
                self._producer.cancel()
                try:
                    await self._producer
                except (asyncio.CancelledError, Exception):
                    pass
            # what is still queued or held goes with the stream
            self.budget.release(self._bytes + self._held)
            self._items.clear()
            self._bytes = self._held = 0
