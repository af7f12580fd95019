"""Bounded mode's epoch register: which offset ranges a job's stream *without* a cursor reads.

It is agreed in Kafka itself, so that the ranks of one job read one epoch whichever feeder,
process (`serve --processes N`) or region (sharing the cluster) each lands on, and after a
failover before the first batch: the epoch register, a single-partition topic `__feeder_epochs`
(created if missing, LogAppendTime, no retention limit). Every record is (topic, job, ranges,
ttl); read in log order, a record for a job with no live entry *establishes* the entry with its
ranges, and any other record for it only *refreshes* the entry (its ranges are ignored). An
entry is live until `ttl` (of its establishing record) has passed, by the broker's append
timestamps, since its latest record. Log order and broker timestamps are the same for every
reader, so every feeder derives the same entry: the first writer after a gap wins. A feeder
that needs the epoch appends its proposal (its current high watermarks; acks=all, idempotent),
reads the register up to its own record and takes the entry it finds there; it then knows the
entry stays live for `ttl` and serves further ranks of the job from memory for `ttl`/2.

Run identity (reusing a job name): while a stream of the job is open on any feeder, that feeder
refreshes the entry every `ttl`/4; so the entry expires between 3/4·ttl and ttl after the job's
last stream anywhere closed, and a later run of the same name then gets a new epoch. `ttl` is
the URL option epoch_ttl_s, by default the feeder's job idle TTL (24 h); it must exceed the
longest time between the first and the last rank's first stream of a job. The register must
keep its records (no retention limit, as created here): a reader that started after records
were deleted could take a later record as establishing. A stream with a cursor, or with a Kafka
`expected_fingerprint`, reads those ranges and does not ask the register (it refreshes the
job's entry, or re-establishes it after a long pause, with its ranges).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass

from feeder.core.errors import FailedPrecondition, Unavailable
from feeder.sources.kafka.consumer import close_soon, consumer_config, unavailable
from feeder.sources.kafka.ranges import parse_ranges

log = logging.getLogger("feeder.kafka")
EPOCHS_TOPIC = "__feeder_epochs"


@dataclass
class _Entry:
    ranges: str
    ttl_ms: int
    last_ms: int      # broker append time of the entry's latest record


class EpochRegister:
    """The bounded epochs of one topic's jobs, agreed through `__feeder_epochs` (module doc)."""

    def __init__(self, bootstrap: str, topic: str, *, ttl_s: float, register: str = EPOCHS_TOPIC):
        self.bootstrap, self.topic, self.register = bootstrap, topic, register
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._lock = threading.Lock()          # one agreement at a time per process: others then hit the cache
        self._producer = self._consumer = None
        self._entries: dict[str, _Entry] = {}  # job -> entry, as of the register records read so far
        self._next = 0                          # the next register offset to read
        self._agreed: dict[str, tuple[str, float]] = {}   # job -> (ranges, monotonic time before our record)
        self._live: dict[str, weakref.WeakSet] = {}      # job -> open plans here (collected when dropped)
        self._live_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._stop, self._kick = threading.Event(), threading.Event()
        self._renewer: threading.Thread | None = None
        self._warned = False

    # -- agreement
    def epoch(self, job: str, propose) -> str:
        """The job's epoch (offset ranges): the live entry, or `propose()` if this makes it one."""
        hit = self._cached(job)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._cached(job)
            if hit is not None:
                return hit
            self._connect()
            known = self._entries.get(job)
            # Propose what is already agreed if we know it (a refresh), else our own ranges.
            mine = known.ranges if known is not None and time.time() * 1000 - known.last_ms < known.ttl_ms \
                else propose()
            sent = time.monotonic()
            offset = self._append(job, mine, wait=True)
            self._read_to(offset)
            entry = self._entries[job]   # our own record was applied: the entry exists
            self._agreed[job] = (entry.ranges, sent)
            if entry.ranges != mine:
                log.info("kafka %s job %s: epoch %s agreed earlier by another feeder (ours would be %s)",
                         self.topic, job, entry.ranges, mine)
            return entry.ranges

    def _cached(self, job: str) -> str | None:
        """Our record at monotonic `sent` keeps the entry live for a ttl after it in broker time;
        half of that leaves room for clock rates and the record's own latency."""
        hit = self._agreed.get(job)
        if hit is None:
            return None
        ranges, sent = hit
        entry = self._entries.get(job)
        ttl_ms = min(self.ttl_ms, entry.ttl_ms if entry is not None else self.ttl_ms)
        return ranges if (time.monotonic() - sent) * 1000 < ttl_ms / 2 else None

    def _apply(self, m) -> None:
        """One register record, in log order: establishes the job's entry if it has none live,
        else refreshes it. Malformed or foreign records are skipped (by every reader alike)."""
        try:
            v = json.loads(m.value())
            if v.get("topic") != self.topic:
                return
            job, ranges, ttl_ms = str(v["job"]), str(v["ranges"]), int(v["ttl_ms"])
            if parse_ranges(ranges)[0] != self.topic or ttl_ms <= 0:
                return
        except (ValueError, TypeError, KeyError, AttributeError, FailedPrecondition):
            log.warning("%s@%d: not an epoch register record; skipped", self.register, m.offset())
            return
        # The broker's append time where the register was created here (LogAppendTime); in a
        # register created otherwise, the producers' clocks: still the same for every reader,
        # but a feeder's clock far ahead could end an entry early, so say so once.
        kind, at = m.timestamp()
        if kind != 2 and not self._warned:   # 2: TIMESTAMP_LOG_APPEND_TIME
            self._warned = True
            log.warning("%s does not use LogAppendTime: epoch TTLs follow the feeders' clocks; create it with "
                        "message.timestamp.type=LogAppendTime", self.register)
        e = self._entries.get(job)
        if e is None or at - e.last_ms > e.ttl_ms:
            self._entries[job] = _Entry(ranges, ttl_ms, at)
        else:
            e.last_ms = max(e.last_ms, at)

    # -- keeping a running job's entry live
    def hold(self, job: str, plan) -> None:
        """A bounded stream of `job` is open here with `plan` (its epoch in plan.src, a KafkaEpoch)."""
        with self._live_lock:
            live = self._live.setdefault(job, weakref.WeakSet())
            first = not live
            live.add(plan)
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, daemon=True, name="kafka-epochs")
                self._renewer.start()
        if first:   # e.g. a job resumed from cursors after a long pause: its entry again, at once
            self._kick.set()   # by the renewer: a stream open never waits on the register for this

    def release(self, job: str, plan) -> None:
        """The stream of `job` with `plan` closed here: its entry is no longer refreshed for it."""
        with self._live_lock:
            live = self._live.get(job)
            if live is not None:
                live.discard(plan)

    def _renew(self) -> None:
        every = max(0.25, self.ttl_ms / 4000)
        while True:
            self._kick.wait(every)
            self._kick.clear()
            if self._stop.is_set():
                return
            with self._live_lock:
                running = {job: next(iter(live)).src.ranges for job, live in self._live.items() if len(live)}
                for job in [j for j, live in self._live.items() if not len(live)]:
                    del self._live[job]
            for job, ranges in running.items():
                self._refresh(job, ranges)

    def _refresh(self, job: str, ranges: str) -> None:
        try:
            self._connect()
            self._append(job, ranges, wait=False)
        except Exception as e:   # the next tick tries again; the entry has ttl/4 of slack per miss
            log.warning("kafka %s job %s: refreshing its epoch in %s failed: %s", self.topic, job, self.register, e)

    # -- Kafka
    def _connect(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

        with self._connect_lock:
            if self._producer is not None:
                return
            self._create_topic()
            self._producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                                       "acks": "all", "linger.ms": 0, "message.timeout.ms": 30000,
                                       "logger": logging.getLogger("feeder.kafka.librdkafka")})
            c = Consumer(consumer_config(self.bootstrap))
            c.assign([TopicPartition(self.register, 0, OFFSET_BEGINNING)])
            self._consumer = c

    def _create_topic(self) -> None:
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        try:
            md = admin.list_topics(timeout=10)
            if self.register in md.topics:
                return
            # LogAppendTime: one clock (the broker's) for every reader's TTL arithmetic; no
            # retention limit: an entry's establishing record must outlive the job.
            topic = NewTopic(self.register, 1, min(3, max(1, len(md.brokers))),
                             config={"message.timestamp.type": "LogAppendTime", "retention.ms": "-1",
                                     "retention.bytes": "-1", "cleanup.policy": "delete"})
            admin.create_topics([topic])[self.register].result(30)
            log.info("created the epoch register topic %s", self.register)
        except KafkaException as e:
            if e.args and getattr(e.args[0], "code", lambda: None)() == KafkaError.TOPIC_ALREADY_EXISTS:
                return   # another feeder created it meanwhile
            raise unavailable(self.bootstrap, e) from None

    def _append(self, job: str, ranges: str, *, wait: bool) -> int:
        value = json.dumps({"topic": self.topic, "job": job, "ranges": ranges, "ttl_ms": self.ttl_ms},
                           separators=(",", ":")).encode()
        box: dict = {}
        self._producer.produce(self.register, value=value, key=json.dumps([self.topic, job]).encode(), partition=0,
                               on_delivery=(lambda err, msg: box.update(err=err, msg=msg)) if wait else None)
        if not wait:
            self._producer.poll(0)
            return -1
        self._producer.flush(30)
        if box.get("err") is not None or "msg" not in box:
            raise unavailable(self.bootstrap, box.get("err") or "the epoch register write timed out")
        return box["msg"].offset()

    def _read_to(self, offset: int) -> None:
        """Applies register records in order up to and including `offset`."""
        from confluent_kafka import KafkaError

        deadline = time.monotonic() + 30
        while self._next <= offset:
            if time.monotonic() > deadline:
                raise Unavailable(f"reading the epoch register {self.register} at {self.bootstrap} up to offset "
                                  f"{offset} made no progress for 30s (at {self._next})")
            # At most what is missing: consume() returns once it has that many (or at the end
            # of the partition), instead of waiting out its timeout on every agreement.
            for m in self._consumer.consume(max(1, min(1000, offset + 1 - self._next)), timeout=0.5):
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise unavailable(self.bootstrap, err.str())
                if m.offset() >= self._next:
                    self._apply(m)
                    self._next = m.offset() + 1
                    deadline = time.monotonic() + 30

    def close(self) -> None:
        """Stops refreshing and lets go of the register's clients (without waiting on them)."""
        self._stop.set()
        self._kick.set()
        if self._consumer is not None:
            close_soon(self._consumer)
        if self._producer is not None:   # refreshes in flight; never wait long on shutdown
            threading.Thread(target=self._producer.flush, args=(2,), daemon=True, name="kafka-epochs-flush").start()

