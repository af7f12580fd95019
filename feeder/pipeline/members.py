"""Members of a data-parallel rank: one read for every process that consumes the rank.

A model-parallel job has several processes per data-parallel rank (its tensor-parallel ranks,
its first and last pipeline stages): its members, StreamSpec.member of members. They receive
the same batches, bit for bit, so the feeder builds each message once (reads, locates,
compresses, signs its cursors) into the rank's Window, and every member's stream sends it.

* The window is bounded in bytes (ServeConfig.member_window_bytes): it keeps the newest
  messages, read or not, so a member that restarts from a recent cursor takes up where it was.
  Its producer runs ahead of the fastest member by at most the prefetch budget, like a stream's
  own queue; nobody waits for a slower member.
* A member whose next message left the window (more than the window behind), or whose cursor
  names no message in it (it resumed elsewhere in the stream), reads on its own: a plan of its
  own from its cursor, its messages cut so that one ends where one of the window's begins; then
  it rejoins. Matching is by cursor bytes: a message is taken from the window only by a member
  whose last cursor is the one the message follows, so sharing never changes what a member gets.
* A member's stream is a slot of its own in the job registry: fenced, replaced, failed over
  and resumed by itself (pipeline/jobs.py). Event-loop only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.errors import FeederError
from feeder.pipeline.batcher import Block
from feeder.pipeline.jobs import slot_of
from feeder.pipeline.stream import UNTIL, WAITING, WAITING_EVERY_S, WAITING_POLL_S, MemoryBudget, Producer, RankStream
from feeder.sources import Plan

log = logging.getLogger("feeder.stream")

# The request's fields that make two members' streams the same stream (all but who sends it).
NOT_SHARED = ("member", "client_started_ns", "continued", "hedge")


def share_key(spec: StreamSpec) -> tuple:
    """Members whose specs agree on this receive the same messages from the same position."""
    return tuple((k, v) for k, v in sorted(vars(spec).items()) if k not in NOT_SHARED)


@dataclass(slots=True)
class Entry:
    seq: int
    before: bytes                # the cursor the message follows (b"": the stream's start)
    after: bytes                 # its last batch's cursor
    first: tuple[int, int]       # (epoch, step) of its first batch
    block: Block                 # framed: its columns without the tokens
    wire: bytes
    size: int


class Window:
    """One data-parallel rank's messages, built once for its members (see the module doc)."""

    def __init__(self, key: tuple, spec: StreamSpec, plan: Plan, opened_at: bytes, cfg: ServeConfig,
                 pool, serialize: Callable[[Block], bytes], on_empty: Callable[["Window"], None],
                 budget: MemoryBudget | None = None):
        self.key, self.spec, self.plan, self.cfg = key, spec, plan, cfg
        # Its messages count in the server's budget as long as it keeps them.
        self.budget = budget if budget is not None else MemoryBudget(1 << 62)
        self.pool = plan.executor or pool
        self._build = Producer(spec, plan, cfg, serialize)
        self._on_empty = on_empty
        self.entries: deque[Entry] = deque()
        self.bytes = 0
        self.next_seq = 0            # of the next message built
        self._last = opened_at       # the cursor the next message follows
        self.done = False
        self.error: BaseException | None = None
        self.members: dict[tuple, "Member"] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.closed = False
        self.built = 0               # messages built (each sent to every member that read it)
        self.state = None            # the rank's RankState (counts what was built)

    # --- what members ask
    def seq_after(self, cursor: bytes) -> int | None:
        """The seq of the message that follows `cursor`, if the window still has it (or builds
        it next)."""
        if cursor == self._last and not self.done:
            return self.next_seq
        for e in self.entries:
            if e.before == cursor:
                return e.seq
        return None

    def at(self, seq: int) -> Entry | None:
        base = self.entries[0].seq if self.entries else self.next_seq
        if seq < base:
            raise LookupError(seq)   # left the window: the member reads on its own
        i = seq - base
        return self.entries[i] if i < len(self.entries) else None

    def first_after(self, position: tuple[int, int]) -> tuple[int, int] | None:
        """(epoch, step) of the window's first message that starts after `position`."""
        for e in self.entries:
            if e.first > position:
                return e.first
        return None

    def changed(self):
        """An awaitable of the window's next change. The event is taken now, not when the
        awaitable first runs: a change between the two (the producer's end, wrapped in a task
        that starts later) would otherwise be waited for on a fresh event nobody sets (a member
        then sat out its rank's idle timeout at the stream's end: review of issue 33)."""
        return self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def join(self, member: "Member") -> None:
        self.members[member.slot] = member
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._produce())
        self._notify()

    def leave(self, member: "Member") -> None:
        if self.members.get(member.slot) is member:
            del self.members[member.slot]
        self._notify()
        if not self.members:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._build.finished = True
        if self._task is not None:
            self._task.cancel()
        self.plan.close()
        self.entries.clear()
        self.budget.release(self.bytes)
        self.bytes = 0
        self._notify()
        self._on_empty(self)

    # --- the producer
    def _wanted(self) -> bool:
        """Build the next message when the fastest member is within the prefetch budget of the
        window's end (a stream's own queue's bound)."""
        joined = [m.next for m in self.members.values() if m.joined]
        if not joined:
            return False
        fastest = max(joined)
        ahead = self.next_seq - fastest
        if ahead <= 0:
            return True
        queued = sum(e.size for e in self.entries if e.seq >= fastest)
        if not (ahead < self.cfg.prefetch_messages and queued < self.cfg.prefetch_bytes):
            return False
        # (the next message's size is not known before it is built: the last one's stands for it)
        if self.budget.more(self.entries[-1].size if self.entries else self.cfg.message_bytes):
            return True
        self.budget.wait(self._notify)   # asked again when the budget has room
        return False

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.closed:
                if not self._wanted():
                    await self.changed()
                    continue
                built = await loop.run_in_executor(self.pool, self._build.build)
                if self.closed:
                    return
                if built is WAITING:
                    self._notify()   # members tell their ranks why nothing comes
                    await asyncio.sleep(WAITING_POLL_S)
                    continue
                if built is None:
                    self.done = True
                    self._notify()
                    return
                block, wire = built
                e = Entry(seq=self.next_seq, before=self._last, after=block.cursors[-1],
                          first=(int(block.epochs[0]), int(block.steps[0])), block=block, wire=wire, size=len(wire))
                self.entries.append(e)
                self.bytes += e.size
                self.budget.charge(e.size)
                self.next_seq += 1
                self._last = e.after
                self.built += 1
                if self.state is not None:
                    self.state.window_builds += 1
                # Bounded in bytes whoever has read what: a member left behind reads on its own.
                # Past the server's budget, what every joined member has read is let go too.
                slowest = min((m.next for m in self.members.values() if m.joined), default=self.next_seq)
                while len(self.entries) > 1 and (self.bytes > self.cfg.window_bytes or (
                        self.budget.used > self.budget.limit * MemoryBudget.EXTRA_SHARE
                        and self.entries[0].seq < slowest)):
                    gone = self.entries.popleft().size
                    self.bytes -= gone
                    self.budget.release(gone)
                self._notify()
        except asyncio.CancelledError:
            raise
        except FeederError as e:
            self.done, self.error = True, e
            self._notify()
        except Exception as e:  # a bug: end the members' streams with an error rather than hang them
            log.exception("window of job %s rank %d: producer failed", self.spec.job, self.spec.rank)
            self.done, self.error = True, e
            self._notify()

    @property
    def waiting(self) -> str:
        return self.plan.waiting


class Member:
    """One member's side: where it is in its rank's window, or its own plan while it is not."""

    def __init__(self, stream: RankStream, window: Window, opened_at: bytes,
                 replan: Callable[[bytes], Awaitable[Plan]]):
        self.stream, self.window, self.replan = stream, window, replan
        s = stream.spec
        self.slot = slot_of(s)
        self.last = opened_at                  # the cursor of the last batch sent (b"": none yet)
        self.position: tuple[int, int] | None = None   # (epoch, step) of that batch
        seq = window.seq_after(opened_at)
        self.joined = seq is not None
        self.next = seq if seq is not None else 0
        self.solo_messages = 0                 # messages this member built on its own
        self.shared_messages = 0               # taken from the window
        window.join(self)

    def leave(self) -> None:
        self.window.leave(self)

    async def messages(self) -> AsyncIterator[tuple[Block | None, bytes | str]]:
        st = self.stream
        if self.joined:
            self._drop_own_plan()
        else:
            log.info("job %s rank %d member %d reads on its own (its cursor is not in the window)",
                     st.spec.job, st.spec.rank, st.spec.member)
        told = 0.0
        while True:
            if st._finished:
                if st._end is not None:
                    raise st._end
                return
            if self.joined:
                w = self.window
                try:
                    e = None if w.closed else w.at(self.next)
                except LookupError:
                    log.info("job %s rank %d member %d fell out of the window (%d bytes): reads on its own",
                             st.spec.job, st.spec.rank, st.spec.member, self.window.cfg.window_bytes)
                    await self._go_solo()
                    continue
                if e is not None:
                    self.next += 1
                    self.last, self.position = e.after, (int(e.block.epochs[-1]), int(e.block.steps[-1]))
                    self.shared_messages += 1
                    if st.state is not None:
                        st.state.member_shared += 1
                    w._notify()   # the producer may build again
                    yield e.block, e.wire
                    continue
                if w.done or w.closed:
                    if w.error is not None:
                        raise w.error
                    if w.closed:   # (only when every member left: this one is ending too)
                        await self._go_solo()
                        continue
                    return
                if w.waiting and time.monotonic() - told >= WAITING_EVERY_S:
                    told = time.monotonic()
                    yield None, w.waiting
                    continue
                waiter = asyncio.ensure_future(w.changed())
                try:
                    await asyncio.wait({waiter}, timeout=WAITING_POLL_S if w.waiting else None)
                finally:
                    waiter.cancel()
                continue
            # On its own: a message of its own plan, ending where one of the window's begins.
            until = self.window.first_after(self.position) if self.position is not None and \
                not self.window.closed else None
            loop = asyncio.get_running_loop()
            built = await loop.run_in_executor(st.pool, st._build.build, until)
            if st._finished:
                continue
            if built is WAITING:
                if time.monotonic() - told >= WAITING_EVERY_S:
                    told = time.monotonic()
                    yield None, st.plan.waiting
                await asyncio.sleep(WAITING_POLL_S)
                continue
            if built is UNTIL:
                if not self._rejoin():   # the window's message there follows another cursor: go on alone
                    built = await loop.run_in_executor(st.pool, st._build.build, None)
                    if built is None:
                        return
                    yield _sent(self, built)
                continue
            if built is None:
                return
            yield _sent(self, built)
            self._rejoin()

    def _rejoin(self) -> bool:
        w = self.window
        if w.closed:
            return False
        seq = w.seq_after(self.last)
        if seq is None:
            return False
        try:
            w.at(seq)
        except LookupError:
            return False
        self.joined, self.next = True, seq
        self._drop_own_plan()
        log.info("job %s rank %d member %d rejoined its rank's window", self.stream.spec.job, self.stream.spec.rank,
                 self.stream.spec.member)
        w._notify()
        return True

    def _drop_own_plan(self) -> None:
        """Its own plan is not needed while it reads the window (a Kafka reader lets go)."""
        self.stream._build.finished = True
        self.stream.plan.close()

    async def _go_solo(self) -> None:
        """Read on its own from the last batch sent: a plan of its own from that cursor."""
        st = self.stream
        plan = await self.replan(self.last)
        if st._finished:
            plan.close()
            return
        st.plan = plan
        st.pool = plan.executor or st.pool
        st._build = Producer(st.spec, plan, st.cfg, st.serialize)
        self.joined = False
        self.window._notify()


def _sent(member: Member, built: tuple[Block, bytes]) -> tuple[Block, bytes]:
    block, _ = built
    member.last, member.position = block.cursors[-1], (int(block.epochs[-1]), int(block.steps[-1]))
    member.solo_messages += 1
    if member.stream.state is not None:
        member.stream.state.member_solo += 1
    return built
