"""Follow mode's reader: the I/O of one rank's tailing stream (its consumer and the thread that
blocks on it), kept out of the plan (`follow.FollowPlan`), which only packs what this yields.

Records are interleaved round-robin over the partitions (record k is the next one of partition
k mod P) and record k is rank k mod W's. Round-robin is what makes the order deterministic: a
partition with no new record holds the stream until it has one (`feeder publish` fills them
evenly).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from feeder.core.errors import DataLoss
from feeder.sources.kafka.codec import BadRecord, decode_record
from feeder.sources.kafka.consumer import close_soon, consumer_config, partitions, unavailable, watermarks
from feeder.sources.kafka.options import KafkaURL

log = logging.getLogger("feeder.kafka")


@dataclass
class FollowState:
    """Where the interleave stands: the next record is the first of partition `turn` at or
    after offset next[turn]; `k` records came before it."""
    next: list[int]
    turn: int = 0
    k: int = 0

    def copy(self) -> "FollowState":
        return FollowState(list(self.next), self.turn, self.k)


class BrokerWatch:
    """What a rank's own follow reader and the shared window (shared.FollowWindow) both do about
    the broker; they have `url` and `_down_since` (when a broker error was first seen since data
    last came)."""

    def _on_error(self, err) -> None:
        from confluent_kafka import KafkaError

        if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            if self._down_since is None:
                self._down_since = time.monotonic()
            log.warning("kafka %s: %s", self.url.topic, err.str())

    def _check_broker(self, c) -> None:
        """Tailing an idle topic looks like a dead broker; ask before calling it UNAVAILABLE."""
        from confluent_kafka import KafkaException

        if self._down_since is None or time.monotonic() - self._down_since < 3.0:
            return
        try:
            c.list_topics(self.url.topic, timeout=2)
            self._down_since = None
        except KafkaException as e:
            raise unavailable(self.url.bootstrap, e) from None


class FollowReader(BrokerWatch):
    """One rank's records of a tailed topic, decoded, in interleave order.

    Owns a consumer (partitions assign()ed from the state it is given, no commits) and a
    one-thread executor that the pipeline runs the stream on, since consume() blocks."""

    def __init__(self, url: KafkaURL, *, dtype: np.dtype, vocab_size: int, eos_id: int, policy: str,
                 job: str, rank: int, world_size: int, want=None):
        from confluent_kafka import Consumer

        self.url, self.policy = url, policy
        self.dtype, self.vocab_size, self.eos_id = dtype, vocab_size, eos_id
        self.job, self.rank, self.world_size = job, rank, world_size
        # which records (by k) are the rank's, decoded: record k mod W, or a mixture's choice (mixed.py)
        self.want = want or (lambda k: k % world_size == rank)
        self.bad_records = 0                  # skipped under bad_records=skip
        self.lag: dict[int, int] = {}         # partition -> records between this reader and the end
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kafka-follow-r{rank}")
        self._closed = threading.Event()
        self._consumer = Consumer(consumer_config(url.bootstrap, error_cb=self._on_error))
        self._down_since: float | None = None
        self._last_lag = 0.0
        self.parts = partitions(self._consumer, url.topic, url.bootstrap)

    @classmethod
    def for_stream(cls, src, spec, policy: str) -> "FollowReader":
        """The reader of stream `spec` of KafkaSource `src`."""
        return cls(src.url, dtype=src.dtype, vocab_size=src.vocab_size, eos_id=src.eos_id, policy=policy,
                   job=spec.job, rank=spec.rank, world_size=spec.world_size)

    def first_offsets(self) -> list[int]:
        """Each partition's low watermark: where a stream without a cursor starts."""
        return [watermarks(self._consumer, self.url.topic, p, self.url.bootstrap)[0] for p in self.parts]

    def close(self) -> None:
        """Stops the reader; the consumer is closed by the reader's own thread (or when the
        generator is collected), never while another thread is inside consume()."""
        if not self._closed.is_set():
            self._closed.set()
            self.executor.shutdown(wait=False)

    def records(self, st: FollowState) -> Iterator[tuple[FollowState, np.ndarray | None] | None]:
        """From `st` (advanced in place): (state before the record, its tokens + EOS, or None
        when it is another rank's or skipped) in interleave order; None when no record is
        ready yet."""
        from confluent_kafka import TopicPartition

        c = self._consumer
        c.assign([TopicPartition(self.url.topic, self.parts[j], st.next[j]) for j in range(len(self.parts))])
        try:
            yield from self._interleave(c, st)
        finally:
            close_soon(c)

    def _interleave(self, c, st: FollowState):
        from confluent_kafka import TopicPartition

        P, want = len(self.parts), self.want
        queues: list[deque] = [deque() for _ in range(P)]
        paused: set[int] = set()
        while not self._closed.is_set():
            j = st.turn
            if not queues[j]:
                if not self._fill(c, st, queues, paused):
                    return
                if not queues[j]:
                    self._check_broker(c)
                    yield None
                    continue
            m = queues[j].popleft()
            if j in paused and len(queues[j]) < 500:
                c.resume([TopicPartition(self.url.topic, self.parts[j])])
                paused.discard(j)
            before = st.copy()
            st.next[j] = m.offset() + 1
            st.turn = (j + 1) % P
            st.k += 1
            yield before, (self._tokens(m) if want(before.k) else None)

    def _fill(self, c, st: FollowState, queues: list[deque], paused: set[int]) -> bool:
        """One consume() into the partitions' queues; False when the reader was closed meanwhile."""
        from confluent_kafka import KafkaException, TopicPartition

        topic = self.url.topic
        try:
            msgs = c.consume(2000, timeout=0.2)
        except (KafkaException, RuntimeError) as e:
            if self._closed.is_set():
                return False
            raise unavailable(self.url.bootstrap, e) from None
        for m in msgs:
            if not is_record(m, topic):
                continue
            self._down_since = None
            q = self.parts.index(m.partition())
            if m.offset() >= st.next[q]:
                queues[q].append(m)
                if len(queues[q]) > 5000 and q not in paused:  # one partition must not fill memory
                    c.pause([TopicPartition(topic, m.partition())])
                    paused.add(q)
        if time.monotonic() - self._last_lag > 2.0:
            self._last_lag = time.monotonic()
            self._update_lag(c, st)
        return True

    def _tokens(self, m) -> np.ndarray | None:
        """This rank's record: its ids and an EOS, or None if it is bad and skipped."""
        try:
            return record_tokens(m.value(), self.url, dtype=self.dtype, vocab_size=self.vocab_size,
                                 eos_id=self.eos_id)
        except BadRecord as b:
            self.bad_records += skip_or_fail(b, self.url.topic, m.partition(), m.offset(), self.policy,
                                             job=self.job, rank=self.rank)
            return None

    def _update_lag(self, c, st: FollowState) -> None:
        from confluent_kafka import TopicPartition

        for j, p in enumerate(self.parts):
            try:
                _, hi = c.get_watermark_offsets(TopicPartition(self.url.topic, p), cached=True)
            except Exception:
                continue
            if hi >= 0:
                self.lag[p] = max(0, hi - st.next[j])

def is_record(m, topic: str) -> bool:
    """Whether a consumed message is a record (False: an event to pass over, logged if it is an
    error); DataLoss when the cursor's offset is gone (deleted by retention)."""
    from confluent_kafka import KafkaError   # (the kafka extra's: imported where it is used)

    err = m.error()
    if err is None:
        return True
    if err.code() == KafkaError._AUTO_OFFSET_RESET:
        raise DataLoss(f"Kafka {topic}/{m.partition()}: the cursor's offset is out of range "
                       f"(deleted by retention?): {err.str()}")
    if err.code() != KafkaError._PARTITION_EOF:
        log.warning("kafka %s: %s", topic, err.str())
    return False


def record_tokens(value: bytes | None, url: KafkaURL, *, dtype: np.dtype, vocab_size: int,
                  eos_id: int) -> np.ndarray:
    """A record's ids and an EOS (how follow mode packs documents); BadRecord if it is bad."""
    return decode_record(value, dtype=dtype, vocab_size=vocab_size, max_bytes=url.max_record_bytes, eos_id=eos_id)


def skip_or_fail(bad: BadRecord, topic: str, partition: int, offset: int, policy: str, *, job: str,
                 rank: int) -> int:
    """A bad record under the stream's policy: DataLoss naming it (fail), or 1 to count (skip)."""
    where = f"{topic}/{partition}@{offset}"
    if policy == "fail":
        raise DataLoss(f"bad Kafka record {where}: {bad} (policy bad_records=fail; "
                       "bad_records=skip serves the stream without it)") from None
    log.warning("bad Kafka record %s skipped (job %s rank %d): %s", where, job, rank, bad)
    return 1
