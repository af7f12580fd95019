"""Follow mode's shared reader: one consumer per feeder process and topic, whatever the number
of ranks, instead of one per rank's stream.

Why: a job of W ranks used to fetch and decode the whole topic W times (each rank's reader kept
every W-th record and dropped the rest), so a feeder's CPU per served token, and the brokers'
egress, grew with W.

How: `FollowWindow` reads the interleave (reader.py's order, from the state its first stream
starts at) into a window of records bounded in bytes (the URL's window_bytes), each with the
interleave state just before it. A rank's stream (`Subscription`) walks the window taking every
W-th record, its own, and decodes it (once: the result stays on the record). Records are
fetched once per process and decoded once per record for every job on the same interleave.

A rank far behind the others is not waited for: the window drops its oldest records when over
budget, and a stream whose next record was dropped, or whose state is not in the window (a cursor
from elsewhere in the topic), reads on its own with a FollowReader exactly as before, checking
as it goes whether its state has shown up in the window; it joins again when it has. The window
reads ahead of its leading stream by at most half its budget, so memory is bounded whatever the
ranks do. Cursors are unchanged: a stream yields the same (state, tokens) items as a FollowReader.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from feeder.core.errors import DataLoss, FeederError, Unavailable
from feeder.sources.kafka.codec import BadRecord
from feeder.sources.kafka.consumer import close_soon, consumer_config, unavailable
from feeder.sources.kafka.options import KafkaURL
from feeder.sources.kafka.reader import BrokerWatch, FollowReader, FollowState, is_record, record_tokens, skip_or_fail

log = logging.getLogger("feeder.kafka")

TAKE = 64            # own records a stream takes from the window per visit
JOIN_EVERY = 16      # a stream reading on its own looks for its state in the window every this many records
# How often the streams' lag (the partitions' high watermarks) is refreshed: the client call lets
# the GIL go, and each append of every fetch asked it, once per partition.
HIGH_EVERY_S = 0.25


def _key(st: FollowState) -> tuple:
    """What makes two interleave states the same point of it (k only counts)."""
    return (st.turn, *st.next)


class _Entry:
    """One record of the window. `value` is dropped once `decoded` (tokens + EOS, or the
    BadRecord) is set; readers read `value` before `decoded`, so they never see neither."""
    __slots__ = ("before", "partition", "offset", "value", "decoded", "cum")

    def __init__(self, before: FollowState, partition: int, offset: int, value: bytes | None, cum: int):
        self.before, self.partition, self.offset = before, partition, offset
        self.value, self.decoded, self.cum = value, None, cum


class FollowWindow(BrokerWatch):
    """The records of one topic's interleave that this process's follow streams share.

    Window index g is the record's k counted from the state the window was seeded at; entries
    hold [base, base + len). One thread (`_run`) fetches, waiting on `_need`; streams wait on
    `_data`. Two conditions over one lock: a stream at the tail wakes the fetcher only, never
    the other streams waiting there (which would wake each other without end)."""

    def __init__(self, url: KafkaURL, parts: list[int], *, dtype: np.dtype, vocab_size: int, eos_id: int):
        self.url, self.parts = url, parts
        self.dtype, self.vocab_size, self.eos_id = dtype, vocab_size, eos_id
        self.budget = url.window_bytes
        self._cond = threading.Lock()
        self._data = threading.Condition(self._cond)   # records appended, or the streams' end (error)
        self._need = threading.Condition(self._cond)   # a stream reached the tail, joined, or left
        self._entries: deque[_Entry] = deque()
        self._index: dict[tuple, int] = {}   # _key(entry.before) -> window index
        self._base = 0
        self._tail: FollowState | None = None   # the state after the last entry: where fetching goes on
        self._cum = 0                            # bytes appended since the seed (entry.cum: before it)
        self._seed = 0                           # bumped on each reseed: the fetcher starts over
        self._attached: set[Subscription] = set()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._paused: set[int] = set()          # partitions paused by the fetcher (its thread only)
        self._retired = False                    # replaced (the topic's partitions changed): closes when unused
        self._down_since: float | None = None
        self.high: dict[int, int] = {}           # partition -> high watermark, for the streams' lag
        self._high_at = 0.0                      # when `high` was last asked of the client
        # Figures (status, tests, bench): records fetched from the brokers, entries dropped while a
        # stream still needed them, streams that read on their own and joined back.
        self.fetched = self.dropped = self.solo = self.rejoined = 0

    # -- for streams (any thread)
    def join(self, sub: "Subscription", st: FollowState) -> bool:
        """Attach `sub` at state `st` if the window holds it (or is free to start over there)."""
        with self._cond:
            if self._closed:
                return False
            key = _key(st)
            g = self._index.get(key)
            if g is None and self._tail is not None and key == _key(self._tail):
                g = self._base + len(self._entries)   # where the next record fetched goes (ranks opening together)
            if g is None:
                if self._attached:
                    return False     # others read here: sub reads on its own until it catches up
                self._reseed(st)
                g = 0
            sub.pos, sub.kofs = g, st.k - g
            self._attached.add(sub)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"kafka-window-{self.url.topic}",
                                                daemon=True)
                self._thread.start()
            self._need.notify()
            return True

    def leave(self, sub: "Subscription") -> None:
        with self._cond:
            self._attached.discard(sub)
            if self._retired and not self._attached:
                self._closed = True
                self._need.notify()

    def retire(self) -> None:
        """Another window replaces this one for new streams; it closes once its own have left."""
        with self._cond:
            self._retired = True
            if not self._attached:
                self._closed = True
                self._need.notify()

    def take(self, sub: "Subscription", wait_s: float = 0.2) -> list[tuple[int, _Entry]] | None:
        """`sub`'s next own records (window index, entry) from its position, up to TAKE; [] when
        none came within wait_s; None when sub is no longer attached (it reads on its own)."""
        with self._cond:
            for attempt in (0, 1):
                if sub.error is not None:
                    e, sub.error = sub.error, None
                    raise e
                if sub not in self._attached:
                    return None
                if sub.pos < self._base:   # dropped while sub still needed it: sub fell too far behind
                    self._attached.discard(sub)
                    self.dropped += 1
                    return None
                end = self._base + len(self._entries)
                g = sub.pos + (sub.take_rank - sub.pos - sub.kofs) % sub.take_every
                if g < end:
                    out = [(i, self._entries[i - self._base]) for i in range(g, min(end, g + TAKE * sub.take_every),
                                                                             sub.take_every)]
                    sub.pos = out[-1][0] + 1
                    return out
                if attempt == 0:
                    sub.pos = max(sub.pos, min(g, end))   # at the tail: tell the fetcher it is needed
                    self._need.notify()
                    self._data.wait(wait_s)
            return []

    # -- the fetcher
    def _reseed(self, st: FollowState) -> None:
        self._entries.clear()
        self._index.clear()
        self._base, self._cum, self._seed = 0, 0, self._seed + 1
        self._tail = FollowState(list(st.next), st.turn, 0)

    def _ahead(self) -> int:
        """Bytes the window holds past its leading stream (what the fetcher may still add)."""
        lead = max((s.pos for s in self._attached), default=None)
        if lead is None:
            return self.budget
        i = lead - self._base
        return self._cum - (self._entries[i].cum if 0 <= i < len(self._entries) else self._cum)

    def _run(self) -> None:
        from confluent_kafka import Consumer

        seed, c = -1, None
        queues: list[deque] = [deque() for _ in self.parts]
        try:
            c = Consumer(consumer_config(self.url.bootstrap, error_cb=self._on_error,
                                         **{"queued.max.messages.kbytes": max(1024, min(64 << 10, self.budget >> 11))}))
            while True:
                with self._cond:
                    while not self._closed and (not self._attached or self._ahead() >= self.budget // 2):
                        self._need.wait(1.0)
                    if self._closed:
                        return
                    start = self._tail.copy() if seed != self._seed else None
                    seed = self._seed
                try:
                    if start is not None:
                        self._assign(c, start, queues)
                    self._fetch(c, seed, queues)
                except FeederError as e:
                    self._fail(e, seed)
                except Exception as e:   # a bug, or the client library: end the streams with an error, not hang them
                    log.exception("kafka %s: the shared follow reader failed", self.url.topic)
                    self._fail(Unavailable(f"Kafka {self.url.topic}: the feeder's shared reader failed: {e}; "
                                           "resume from the cursor"), seed)
        except Exception as e:   # no consumer: the streams end, and the next to join starts a new fetcher
            log.exception("kafka %s: the shared follow reader could not start", self.url.topic)
            self._fail(Unavailable(f"Kafka {self.url.topic}: the feeder's shared reader could not start: {e}; "
                                   "resume from the cursor"), seed, force=True)
        finally:
            with self._cond:
                self._thread = None
            if c is not None:
                close_soon(c)

    def _assign(self, c, start: FollowState, queues: list[deque]) -> None:
        from confluent_kafka import TopicPartition

        for q in queues:
            q.clear()
        self._paused = set()
        c.assign([TopicPartition(self.url.topic, p, start.next[j]) for j, p in enumerate(self.parts)])

    def _fetch(self, c, seed: int, queues: list[deque]) -> None:
        """One consume() into the partitions' queues, then as much of the interleave as they
        allow into the window."""
        from confluent_kafka import KafkaException, TopicPartition

        topic = self.url.topic
        with self._cond:
            if seed != self._seed:
                return    # reseeded meanwhile: the loop assigns the consumer again first
            tail = self._tail
        msgs = []
        if not queues[tail.turn]:   # else what is fetched already goes in first, without waiting on the broker
            try:
                msgs = c.consume(2000, timeout=0.2)
            except (KafkaException, RuntimeError) as e:
                raise unavailable(self.url.bootstrap, e) from None
        for m in msgs:
            if not is_record(m, topic):
                continue
            self._down_since = None
            self.fetched += 1
            q = self.parts.index(m.partition())
            if m.offset() >= tail.next[q]:
                queues[q].append(m)
                if len(queues[q]) > 5000 and q not in self._paused:   # one partition must not fill memory
                    c.pause([TopicPartition(topic, m.partition())])
                    self._paused.add(q)
        self._append(seed, queues, c)
        if not queues[tail.turn]:
            self._check_broker(c)

    def _append(self, seed: int, queues: list[deque], c) -> None:
        """Records from the partitions' queues into the window in interleave order, while the
        fetcher is not more than half the budget ahead of the leading stream; then the oldest
        dropped while over budget."""
        from confluent_kafka import TopicPartition

        P = len(self.parts)
        with self._cond:
            if seed != self._seed:
                return
            tail, entries = self._tail, self._entries
            added = False
            room = self.budget // 2 - self._ahead()   # computed once: it walks the streams
            stop_at = self._cum + room
            while queues[tail.turn] and self._cum < stop_at:
                j = tail.turn
                m = queues[j].popleft()
                if j in self._paused and len(queues[j]) < 500:
                    c.resume([TopicPartition(self.url.topic, self.parts[j])])
                    self._paused.discard(j)
                value = m.value()
                before = tail.copy()
                self._index[_key(before)] = before.k
                entries.append(_Entry(before, self.parts[j], m.offset(), value, self._cum))
                self._cum += len(value or b"") + 64   # + the entry's own keep, so empty records count too
                tail.next[j], tail.turn, tail.k = m.offset() + 1, (j + 1) % P, tail.k + 1
                added = True
            lead = max((s.pos for s in self._attached), default=self._base + len(entries))
            while len(entries) > 1 and self._base < lead and self._cum - entries[0].cum > self.budget:
                gone = entries.popleft()
                del self._index[_key(gone.before)]
                self._base += 1
            if added:
                self._data.notify_all()
        self._update_high(c)

    def _fail(self, e: FeederError, seed: int, *, force: bool = False) -> None:
        """Every attached stream ends with `e` (its cursor resumes it); the window starts over."""
        with self._cond:
            if seed != self._seed and not force:
                return
            log.warning("kafka %s: shared follow reader: %s", self.url.topic, e)
            for s in self._attached:
                s.error = e
            self._attached.clear()
            self._reseed(self._tail)   # emptied; the next stream to join seeds it where it stands
            self._data.notify_all()

    def _update_high(self, c) -> None:
        from confluent_kafka import TopicPartition

        now = time.monotonic()
        if now - self._high_at < HIGH_EVERY_S:
            return
        self._high_at = now
        for p in self.parts:
            try:
                _, hi = c.get_watermark_offsets(TopicPartition(self.url.topic, p), cached=True)
            except Exception:
                continue
            if hi >= 0:
                self.high[p] = hi

    def figures(self) -> dict:
        """What the window holds and has done (for status, logs and tests)."""
        with self._cond:
            return {"records": len(self._entries), "bytes": self._cum - (self._entries[0].cum if self._entries else
                                                                        self._cum),
                    "budget": self.budget, "streams": len(self._attached), "fetched": self.fetched,
                    "dropped": self.dropped, "solo": self.solo, "rejoined": self.rejoined}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._data.notify_all()
            self._need.notify()


class Subscription:
    """One rank's follow stream over a FollowWindow: the FollowReader interface (parts,
    executor, lag, bad_records, first_offsets, records, close), reading on its own when it
    cannot share."""

    def __init__(self, window: FollowWindow, *, policy: str, job: str, rank: int, world_size: int,
                 low_watermarks, want=None):
        self.window, self.policy = window, policy
        self.job, self.rank, self.world = job, rank, world_size
        # Which records it takes from the window: its own, every W-th; or, in a mixture of topics
        # (mixed.py), every record, decoding those `want(k)` says the rank gets (asked as each is
        # taken: which slot of the mixture a record fills is known only then).
        self.want = want
        self.take_rank, self.take_every = (0, 1) if want else (rank, world_size)
        self.parts = window.parts
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kafka-follow-r{rank}")
        self.pos = self.kofs = 0          # window index of the next record to look at; k = index + kofs
        self.error: FeederError | None = None
        self._low_watermarks = low_watermarks
        self._own_bad = 0
        self._solo: FollowReader | None = None
        self._solo_bad = 0                 # bad records counted by earlier solo readers
        self._st: FollowState | None = None
        self._closed = threading.Event()

    def first_offsets(self) -> list[int]:
        return self._low_watermarks()

    @property
    def bad_records(self) -> int:
        solo = self._solo
        return self._own_bad + self._solo_bad + (solo.bad_records if solo is not None else 0)

    @property
    def lag(self) -> dict[int, int]:
        solo, st = self._solo, self._st
        if solo is not None:
            return solo.lag
        if st is None:
            return {}
        return {p: max(0, hi - st.next[self.parts.index(p)]) for p, hi in dict(self.window.high).items()}

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self.window.leave(self)
            if self._solo is not None:
                self._solo.close()
            self.executor.shutdown(wait=False)

    def records(self, st: FollowState) -> Iterator[tuple[FollowState, np.ndarray | None] | None]:
        """As FollowReader.records: (state before a record, its tokens + EOS or None) from `st`,
        None when no record is ready. Only this rank's records are yielded after the first item
        (the state the stream starts at), which is all FollowPlan needs of the others."""
        self._st = st
        yield st.copy(), None
        try:
            while not self._closed.is_set():
                if self.window.join(self, st):
                    yield from self._shared(st)
                else:
                    yield from self._alone(st)
        finally:
            self.window.leave(self)

    def _shared(self, st: FollowState):
        """From the window until it drops this stream's next record (or the stream closes)."""
        while not self._closed.is_set():
            got = self.window.take(self)
            if got is None:
                return
            if not got:
                yield None
                continue
            for g, e in got:
                before = FollowState(list(e.before.next), e.before.turn, g + self.kofs)
                tokens = self._tokens(e) if self.want is None or self.want(before.k) else None
                # st: the state after this record, where this stream reads on its own from if it must
                st.next[:] = before.next
                st.next[e.before.turn] = e.offset + 1
                st.turn, st.k = (e.before.turn + 1) % len(self.parts), before.k + 1
                yield before, tokens

    def _alone(self, st: FollowState):
        """A reader of its own from `st` until the window holds st (then this returns)."""
        w = self.window
        w.solo += 1
        log.info("kafka %s: job %s rank %d reads on its own from %s (not in the shared window)",
                 w.url.topic, self.job, self.rank, st.next)
        reader = FollowReader(w.url, dtype=w.dtype, vocab_size=w.vocab_size, eos_id=w.eos_id, policy=self.policy,
                              job=self.job, rank=self.rank, world_size=self.world, want=self.want)
        self._solo = reader
        items = reader.records(st)   # st advances in place
        n = 0
        try:
            for item in items:
                yield item
                n += 1
                if (item is None or n % JOIN_EVERY == 0) and w.join(self, st):
                    w.rejoined += 1
                    log.info("kafka %s: job %s rank %d shares the window again", w.url.topic, self.job, self.rank)
                    return
        finally:
            self._solo, self._solo_bad = None, self._solo_bad + reader.bad_records
            reader.close()
            items.close()   # closes its consumer now, not when the generator is collected

    def _tokens(self, e: _Entry) -> np.ndarray | None:
        value = e.value          # before `decoded`: see _Entry
        d = e.decoded
        if d is None:
            w = self.window
            try:
                d = record_tokens(value, w.url, dtype=w.dtype, vocab_size=w.vocab_size, eos_id=w.eos_id)
            except BadRecord as b:
                d = b
            e.decoded, e.value = d, None
        if isinstance(d, BadRecord):
            self._own_bad += skip_or_fail(d, self.window.url.topic, e.partition, e.offset, self.policy,
                                          job=self.job, rank=self.rank)
            return None
        return d
