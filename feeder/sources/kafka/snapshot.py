"""Bounded mode's snapshot: a frozen epoch's offset ranges read once into Arrow shards in a
spool directory, ordered by (partition, offset), then served exactly as a file dataset
(same packing, same DistributedSampler, same cursors)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from feeder import manifest as mf
from feeder.errors import DataLoss, FailedPrecondition, Unavailable, WrongReplica
from feeder.prep import ShardWriter, join_documents
from feeder.sources.kafka.codec import BadRecord, decode_record
from feeder.sources.kafka.consumer import close_soon, consumer_config, partitions, unavailable, watermarks
from feeder.sources.kafka.options import KafkaURL
from feeder.sources.kafka.ranges import parse_ranges

log = logging.getLogger("feeder.kafka")


class Snapshots:
    """The snapshots of one topic's epochs, each built once per (ranges, policy) and shared by
    every stream that reads it; a snapshot already in the spool directory is not read again."""

    def __init__(self, url: KafkaURL, spool: Path, *, dtype: np.dtype, vocab_size: int, eos_id: int):
        self.url, self.spool = url, spool
        self.dtype, self.vocab_size, self.eos_id = dtype, vocab_size, eos_id
        self._lock = threading.Lock()
        self._snapshots: dict[str, object] = {}
        self._building: dict[str, threading.Lock] = {}

    def get(self, ranges: str, policy: str):
        """The epoch `ranges` as a PosixSource (with `bad_records`: how many were skipped)."""
        from feeder.sources.posix import PosixSource

        key = hashlib.sha256(f"{self.url.bootstrap}|{ranges}|{policy}|{self.vocab_size}|{self.eos_id}|"
                             f"{self.url.max_record_bytes}".encode()).hexdigest()[:20]
        with self._lock:
            snap = self._snapshots.get(key)
            lock = self._building.setdefault(key, threading.Lock())
        if snap is not None:
            return snap
        with lock:  # ranks opening together: one builds, the others wait for it
            snap = self._snapshots.get(key)
            if snap is not None:
                return snap
            out = self.spool / f"{self.url.topic}-{key}"
            if not (out / mf.NAME).is_file():
                SnapshotBuild(self.url, ranges, policy, dtype=self.dtype, vocab_size=self.vocab_size,
                              eos_id=self.eos_id).run(out)
            snap = PosixSource(out, name=self.url.topic)
            snap.bad_records = json.loads((out / "kafka.json").read_text())["bad_records"]
            self._snapshots[key] = snap
            return snap


class SnapshotBuild:
    """One read of an epoch's ranges into a snapshot directory (written aside, then renamed
    into place, so a reader never sees half of one)."""

    def __init__(self, url: KafkaURL, ranges: str, policy: str, *, dtype: np.dtype, vocab_size: int, eos_id: int):
        self.url, self.ranges, self.policy = url, ranges, policy
        self.dtype, self.vocab_size, self.eos_id = dtype, vocab_size, eos_id
        self.bad: list[dict] = []
        self.docs = self.tokens = 0
        self.writer: ShardWriter | None = None

    def run(self, out: Path) -> None:
        from confluent_kafka import Consumer, KafkaException

        topic, spans = parse_ranges(self.ranges)
        if topic != self.url.topic:
            raise WrongReplica(f"the epoch {self.ranges!r} is of topic {topic!r}; this feeder serves "
                               f"{self.url.topic!r}")
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.monotonic()
        self.writer = ShardWriter(tmp, self.dtype.name, shard_tokens=64 << 20, chunk_tokens=1 << 20)
        c = Consumer(consumer_config(self.url.bootstrap))
        try:
            # The topic and each partition must still exist before we wait on them: a deleted
            # topic is NOT_FOUND at once (as in follow mode), not UNAVAILABLE retried for minutes.
            present = set(partitions(c, topic, self.url.bootstrap))
            for p, lo, hi in spans:
                if hi <= lo:
                    continue
                self._check(c, present, p, lo, hi)
                self._read(c, p, lo, hi)
        except KafkaException as e:
            raise unavailable(self.url.bootstrap, e) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            close_soon(c)
        self._finish(tmp, out, t0)

    def _check(self, c, present: set[int], p: int, lo: int, hi: int) -> None:
        """The partition still holds [lo, hi): else DataLoss, as the epoch cannot be read again."""
        topic, ranges = self.url.topic, self.ranges
        if p not in present:
            raise DataLoss(f"Kafka {topic}/{p}: the partition is gone (the topic has partitions "
                           f"{sorted(present)}), so the epoch {ranges} cannot be read again")
        low_now, high_now = watermarks(c, topic, p, self.url.bootstrap)
        if low_now > lo:
            raise DataLoss(f"Kafka {topic}/{p}: records from offset {lo} are gone (retention); the "
                           f"partition now starts at {low_now}, so the epoch {ranges} cannot be read again")
        if high_now < hi:
            # Offsets never go back: the topic was deleted and created again (or truncated).
            raise DataLoss(f"Kafka {topic}/{p}: the epoch {ranges} needs offsets up to {hi}, the partition "
                           f"now ends at {high_now} (deleted and created again?), so it cannot be read again")

    def _read(self, c, p: int, lo: int, hi: int) -> None:
        """Offsets [lo, hi) of partition p into the writer, in offset order."""
        from confluent_kafka import TopicPartition

        topic = self.url.topic
        c.assign([TopicPartition(topic, p, lo)])
        pending: list[np.ndarray] = []
        pos, idle_since = lo, time.monotonic()
        while pos < hi:
            # No more than the range still needs: consume() returns once it has that many,
            # instead of waiting out its timeout for a 1000 that will not come.
            msgs = c.consume(max(1, min(1000, hi - pos)), timeout=1.0)
            if not msgs:
                pos = max(pos, c.position([TopicPartition(topic, p)])[0].offset)
                if pos < hi and time.monotonic() - idle_since > 30:
                    raise Unavailable(f"Kafka {topic}/{p}: no progress reading offsets [{pos}, {hi}) for 30s")
                continue
            idle_since = time.monotonic()
            for m in msgs:
                pos, done = self._take(m, p, pos, hi, pending)
                if done:
                    break
            if sum(len(a) for a in pending) >= 1 << 20:
                self._flush(pending)
                pending = []
        self._flush(pending)
        c.unassign()

    def _take(self, m, p: int, pos: int, hi: int, pending: list[np.ndarray]) -> tuple[int, bool]:
        """One consumed message: its ids onto `pending` if it is a good record of the range.
        Returns the new read position and whether the range's end was passed."""
        from confluent_kafka import KafkaError

        topic = self.url.topic
        err = m.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                return max(pos, m.offset()), False
            if err.code() == KafkaError._AUTO_OFFSET_RESET:
                raise DataLoss(f"Kafka {topic}/{p}: offset {pos} is out of range ({err.str()})")
            if err.fatal():
                raise unavailable(self.url.bootstrap, err.str())
            log.warning("kafka %s/%d: %s (retrying)", topic, p, err.str())
            return pos, False
        off = m.offset()
        if off >= hi:
            return off + 1, True
        try:
            pending.append(decode_record(m.value(), dtype=self.dtype, vocab_size=self.vocab_size,
                                         max_bytes=self.url.max_record_bytes))
        except BadRecord as b:
            where = f"{topic}/{p}@{off}"
            if self.policy == "fail":
                raise DataLoss(f"bad Kafka record {where}: {b} (policy bad_records=fail; "
                               "bad_records=skip serves the epoch without it)") from None
            log.warning("bad Kafka record %s skipped: %s", where, b)
            self.bad.append({"partition": p, "offset": off, "kind": b.kind, "detail": b.detail})
        return off + 1, False

    def _flush(self, docs: list[np.ndarray]) -> None:
        if not docs:
            return
        tokens, lengths = join_documents(docs, self.eos_id, self.dtype)
        self.writer.add(tokens, lengths)
        self.docs, self.tokens = self.docs + len(docs), self.tokens + len(tokens)

    def _finish(self, tmp: Path, out: Path, t0: float) -> None:
        """The manifest and the bad-record list, then the directory renamed into place."""
        shards = self.writer.close()
        bad, ranges = self.bad, self.ranges
        if not shards:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FailedPrecondition(f"the Kafka epoch {ranges} holds no servable records"
                                     + (f" ({len(bad)} bad records skipped)" if bad else ""))
        mf.write(tmp, mf.Manifest(tokenizer={"kind": "kafka", "topic": self.url.topic, "ranges": ranges},
                                  vocab_size=self.vocab_size, eos_id=self.eos_id, dtype=self.dtype.name,
                                  shards=tuple(shards)))
        (tmp / "kafka.json").write_text(json.dumps({"ranges": ranges, "policy": self.policy,
                                                    "bad_records": len(bad), "bad": bad[:1000]}))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        log.info("kafka epoch %s: %d documents, %d tokens, %d bad records skipped, read in %.1fs into %s",
                 ranges, self.docs, self.tokens, len(bad), time.monotonic() - t0, out)
