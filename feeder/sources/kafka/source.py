"""The Kafka source: presents a topic, and decides per stream what the job reads (a bounded
epoch's snapshot, or a follow stream's reader) from the URL's mode (package doc)."""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from feeder.sources import NO_CONTEXT, Context, packed_samples
from feeder.sources import manifest as mf
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor
from feeder.sources.kafka_positions import KafkaEpoch
from feeder.core.errors import FailedPrecondition, InvalidArgument, WrongReplica
from feeder.core.planning import StreamPlan
from feeder.sources.kafka.codec import read_header
from feeder.sources.kafka.consumer import close_soon, consumer_config, partitions, topic_id, watermarks
from feeder.sources.kafka.follow import FollowPlan
from feeder.sources.kafka.groups import GroupCommits
from feeder.sources.kafka.options import KafkaURL
from feeder.sources.kafka.ranges import format_ranges
from feeder.sources.kafka.register import EpochRegister
from feeder.sources.kafka.shared import FollowWindow, Subscription
from feeder.sources.kafka.snapshot import Snapshots

log = logging.getLogger("feeder.kafka")



class KafkaSource:
    """Presents a topic (a `Source`); `plan` decides per stream what the job reads (see the package doc)."""

    def __init__(self, url: KafkaURL, *, cache_dir: str = ""):
        from confluent_kafka import Consumer

        self.url = url
        self.name = url.topic
        self._consumer = Consumer(consumer_config(url.bootstrap))   # metadata and watermarks only
        self._meta_lock = threading.Lock()
        self._recent: dict[object, tuple[float, object]] = {}   # _recently's: key -> (when asked, answer)
        self.vocab_size, self.eos_id = url.vocab_size, url.eos_id
        if self.vocab_size <= 0:
            self.vocab_size, self.eos_id = self._vocab_from_first_record()
        if not 0 <= self.eos_id < self.vocab_size:
            raise InvalidArgument(f"Kafka source {url.topic}: eos_id must be in [0, vocab_size={self.vocab_size}), "
                                  f"got {self.eos_id}")
        self.dtype = np.dtype(mf.dtype_for_vocab(self.vocab_size))
        self.n_tokens = self.n_documents = 0   # unknown until a job freezes its epoch
        self._register = EpochRegister(url.bootstrap, url.topic, ttl_s=url.epoch_ttl_s)
        self._groups = GroupCommits(url)
        # Where bounded epochs' snapshots are built once and kept: shared with every feeder and
        # process that reads the same directory (once.py keeps it to one build).
        if url.spool:
            spool = Path(url.spool)
        elif cache_dir:
            spool = Path(cache_dir) / "kafka"
        else:
            spool = Path(tempfile.gettempdir()) / f"feeder-kafka-spool-{os.getuid()}"
        self._snapshots = Snapshots(url, spool, dtype=self.dtype, vocab_size=self.vocab_size, eos_id=self.eos_id)
        self._window: FollowWindow | None = None   # follow mode: the records this process's streams share

    # -- Info
    @property
    def fingerprint(self) -> str:
        """bounded: the offset ranges a job starting now would read (pass it back as
        expected_fingerprint to pin every rank, on every feeder, to the same epoch)."""
        if self.url.mode == "follow":
            return f"kafka-follow:{self.url.topic}"
        return self._ranges_now()

    def _vocab_from_first_record(self) -> tuple[int, int]:
        from confluent_kafka import TopicPartition

        c = self._consumer
        with self._meta_lock:
            for p in partitions(c, self.url.topic, self.url.bootstrap):
                lo, hi = watermarks(c, self.url.topic, p, self.url.bootstrap)
                if hi <= lo:
                    continue
                c.assign([TopicPartition(self.url.topic, p, lo)])
                msgs = c.consume(1, timeout=10)
                c.unassign()
                header = read_header(msgs[0].value() if msgs and msgs[0].error() is None else None)
                if header is not None:
                    log.info("topic %s: vocab_size=%d eos_id=%d from its first record's header",
                             self.url.topic, *header)
                    return header
                break
        raise InvalidArgument(f"Kafka source {self.url.topic}: give vocab_size and eos_id (URL options "
                              "?vocab_size=N&eos_id=N or --vocab-size/--eos-id); the topic's first record does not "
                              "carry them (empty topic, or JSON records)")

    def _ranges_now(self) -> str:
        c, topic, bootstrap = self._consumer, self.url.topic, self.url.bootstrap
        with self._meta_lock:
            spans = [(p, *watermarks(c, topic, p, bootstrap)) for p in partitions(c, topic, bootstrap)]
        return format_ranges(topic, spans)

    # -- streams
    def plan(self, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT) -> "StreamPlan | FollowPlan":
        """The plan of one stream (Source.plan): a StreamPlan over the job's epoch snapshot, or a
        FollowPlan tailing the topic. May block (snapshot build, metadata)."""
        policy = spec.bad_records or self.url.bad_records
        if self.url.mode == "follow":
            if spec.reshard:
                raise FailedPrecondition("a Kafka follow stream cannot be re-dealt to another world size; "
                                         "resume it with the world size of its cursor")
            self.refuse_documents(spec)
            return FollowPlan(self, spec, cursor, policy, reader=self.subscribe(spec, policy))
        if cursor is not None and cursor.src is not None:
            if type(cursor.src) is not KafkaEpoch:
                raise FailedPrecondition("cursor does not fit this stream: it is from a Kafka follow stream, and "
                                         f"this feeder serves topic {self.url.topic} bounded (mode=bounded)")
            pinned = cursor.src.ranges
        elif spec.expected_fingerprint.startswith("kafka:"):
            pinned = spec.expected_fingerprint
        elif spec.expected_fingerprint:
            raise WrongReplica(f"expected_fingerprint {spec.expected_fingerprint!r} is not a Kafka epoch; "
                               f"this feeder serves topic {self.url.topic} (Info gives its current epoch)")
        else:
            pinned = ""
        ranges, snap = self.epoch(spec, pinned)
        data, n_samples = snap, 0
        table = packed_samples(snap, spec, ctx)   # a record is a document: the epoch's records, packed
        if table is not None:
            data, n_samples = table, table.n_samples
        if cursor is not None and cursor.fingerprint != data.fingerprint:
            raise WrongReplica(f"cursor does not fit this stream: dataset fingerprint differs: the cursor has "
                               f"{cursor.fingerprint!r}, the Kafka epoch {ranges} reads as {data.fingerprint!r}")
        plan = _BoundedPlan(spec, n_tokens=snap.n_tokens, fingerprint=data.fingerprint, cursor=cursor,
                            src=KafkaEpoch(ranges), data=data, n_samples=n_samples, orders=ctx.orders)
        plan.bad_records = snap.bad_records
        plan.register = self._register
        self._register.hold(spec.job, plan)
        return plan

    # -- as a part of a mixture (sources/mixture.py)
    @property
    def tailed(self) -> bool:
        """Follow mode: no epoch to freeze, so mixed only with other tailed topics, record by record."""
        return self.url.mode == "follow"

    def epoch(self, spec: StreamSpec, pinned: str = ""):
        """(ranges, snapshot) of the job's frozen epoch of this topic: the ranges `pinned` names
        (a cursor's), else the ones agreed for the job with every other feeder of the cluster
        (register.py). May block: the snapshot is built, or waited for, first."""
        if self.tailed:
            raise FailedPrecondition(f"topic {self.url.topic} is followed (mode=follow): it has no epoch to freeze")
        ranges = pinned or self._register.epoch(spec.job, self._ranges_now)
        return ranges, self.snapshot(ranges, spec.bad_records or self.url.bad_records)

    def hold(self, job: str, ranges: str) -> object:
        """Keep the job's register entry live while the returned token is (a mixture's plan holds it)."""
        token = _Held(KafkaEpoch(ranges))
        self._register.hold(job, token)
        return token

    def release(self, job: str, token: object) -> None:
        self._register.release(job, token)

    def refuse_documents(self, spec: StreamSpec) -> None:
        if spec.elastic:   # (what a followed topic cannot be asked, whatever the stream: live elasticity too)
            raise FailedPrecondition(
                f"source {self.name!r} (Kafka topic {self.url.topic}, mode=follow) cannot deal global steps "
                f"(global_batch={spec.global_batch}): a followed topic has no epoch order to deal them from; serve "
                "it with mode=bounded, or stream it without live elasticity")
        if spec.boundaries or spec.packing != "concat":
            # A followed topic has no end: there is no corpus to pack, and its samples are cut
            # from records as they arrive (docs/packing.md).
            raise FailedPrecondition(
                f"source {self.name!r} (Kafka topic {self.url.topic}, mode=follow) cannot serve "
                f"{'packing=' + spec.packing if spec.packing != 'concat' else 'boundaries'}: a followed topic "
                "has no fixed set of documents; serve it with mode=bounded, or ask without them")

    def interleave(self, names, weights, sources, spec: StreamSpec, cursor: Cursor | None):
        """The plan of a follow-mode mixture of `sources` (tailed topics, this one among them): mixed.py."""
        from feeder.sources.kafka.mixed import FollowMixPlan

        self.refuse_documents(spec)   # (a mixture of followed topics no more than one of them)
        return FollowMixPlan(names, weights, sources, spec, cursor)

    def subscribe(self, spec: StreamSpec, policy: str, want=None) -> Subscription:
        """A follow stream's reader: through this process's shared window of the topic (shared.py)."""
        c, topic, bootstrap = self._consumer, self.url.topic, self.url.bootstrap
        tid, parts = self._recently("topic", lambda: (topic_id(bootstrap, topic), partitions(c, topic, bootstrap)))
        with self._meta_lock:
            w = self._window
            # first stream, or the topic's partitions changed, or it is another topic of that name
            if w is None or w.parts != parts or getattr(w, "topic_id", "") != tid:
                if w is not None:
                    w.retire()
                w = self._window = FollowWindow(self.url, parts, dtype=self.dtype, vocab_size=self.vocab_size,
                                                eos_id=self.eos_id)
                w.topic_id = tid
        return Subscription(w, policy=policy, job=spec.job, rank=spec.rank, world_size=spec.world_size,
                            low_watermarks=lambda: self._low_watermarks(parts), want=want)

    def _low_watermarks(self, parts: list[int]) -> list[int]:
        """Each partition's low watermark: where a follow stream without a cursor starts."""
        c, topic, bootstrap = self._consumer, self.url.topic, self.url.bootstrap
        lows = self._recently(("low", *parts), lambda: [watermarks(c, topic, p, bootstrap)[0] for p in parts])
        return list(lows)   # a stream's state moves in place

    def _recently(self, key, ask):
        """ask()'s answer, asked under the metadata lock after this call came (single flight).

        Follow streams that open together (a job's W ranks at its start, or after a failover)
        ask the broker the same things: the topic's id and partitions, and where it starts. One
        that waited on the lock while another asked takes the answer of a question asked after
        it came, if there is one: as fresh as its own would be (no answer is kept for a time, so
        a topic given partitions or created again is seen by the next stream that opens), and
        W round trips one after another become a few."""
        came = time.monotonic()
        with self._meta_lock:
            got = self._recent.get(key)
            if got is None or got[0] < came:
                asked = time.monotonic()
                got = self._recent[key] = (asked, ask())
            return got[1]

    def follow_figures(self) -> dict:
        """The shared follow window's figures (empty before the first follow stream)."""
        w = self._window
        return w.figures() if w is not None else {}

    def snapshot(self, ranges: str, policy: str):
        """The frozen epoch as a local file dataset, built once per (topic id, ranges, policy)."""
        return self._snapshots.get(ranges, policy, topic_id(self.url.bootstrap, self.url.topic))

    def commit_taken(self, job: str, rank: int, world: int, offsets: dict[int, int]) -> None:
        """Follow mode with ?group=NAME: commit, per partition, the offset every rank of the job
        has passed (the minimum over ranks of what their loops have taken), so standard Kafka
        tooling (kafka-consumer-groups --describe) shows the job's lag. Best effort, async."""
        self._groups.commit_taken(job, rank, world, offsets)

    def close(self) -> None:
        """Lets go of the source's Kafka clients (without waiting on them)."""
        close_soon(self._consumer)
        if self._window is not None:
            self._window.close()
        self._register.close()
        self._groups.close()


class _Held:
    """What the register sees of a mixture's stream: its epoch of this topic (plan.src, as a bounded plan's)."""

    def __init__(self, src: KafkaEpoch):
        self.src = src


class _BoundedPlan(StreamPlan):
    """A bounded stream's plan; while it is open its job's register entry is kept live."""

    register: "EpochRegister | None" = None

    def close(self) -> None:
        if self.register is not None:
            self.register.release(self.spec.job, self)
        super().close()
