"""Bounded mode: one partition's offsets [lo, hi) read and decoded into a spill (the ids, and
each record's length) that the snapshot joins in partition order (snapshot.py). One of these
per partition runs at once, each with its own consumer, so an epoch is read in parallel."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from feeder.core.errors import DataLoss, Unavailable
from feeder.sources.kafka.codec import BadRecord, decode_record
from feeder.sources.kafka.consumer import close_soon, consumer_config, unavailable, watermarks
from feeder.sources.kafka.options import KafkaURL

log = logging.getLogger("feeder.kafka")

SPILL_TOKENS = 1 << 20   # ids gathered before they are appended to the spill


class PartitionRead:
    """Reads offsets [lo, hi) of partition p into `tmp`/part-P.ids and part-P.lengths; `done`
    (records passed) and `tokens` are its progress, `bad` the records skipped."""

    def __init__(self, url: KafkaURL, ranges: str, p: int, lo: int, hi: int, *, policy: str, dtype: np.dtype,
                 vocab_size: int, tmp: Path, stop: threading.Event):
        self.url, self.ranges, self.p, self.lo, self.hi = url, ranges, p, lo, hi
        self.policy, self.dtype, self.vocab_size = policy, dtype, vocab_size
        self.ids_path, self.lengths_path = tmp / f"part-{p}.ids", tmp / f"part-{p}.lengths"
        self.stop = stop
        self.done = self.tokens = self.docs = 0
        self.bad: list[dict] = []

    def check(self, c, present: set[int]) -> None:
        """The partition still holds [lo, hi): else DataLoss, as the epoch cannot be read again."""
        topic, ranges, p, lo, hi = self.url.topic, self.ranges, self.p, self.lo, self.hi
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

    def run(self) -> None:
        """Offsets [lo, hi) in offset order into the spill (on a thread of the build's pool)."""
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        topic, p, hi = self.url.topic, self.p, self.hi
        c = Consumer(consumer_config(self.url.bootstrap))
        pending: list[np.ndarray] = []
        try:
            c.assign([TopicPartition(topic, p, self.lo)])
            with open(self.ids_path, "wb") as ids, open(self.lengths_path, "wb") as lengths:
                pos, idle_since = self.lo, time.monotonic()
                while pos < hi and not self.stop.is_set():
                    # No more than the range still needs: consume() returns once it has that many,
                    # instead of waiting out its timeout for a 1000 that will not come.
                    msgs = c.consume(max(1, min(1000, hi - pos)), timeout=1.0)
                    if not msgs:
                        pos = max(pos, c.position([TopicPartition(topic, p)])[0].offset)
                        if pos < hi and time.monotonic() - idle_since > 30:
                            raise Unavailable(f"Kafka {topic}/{p}: no progress reading offsets [{pos}, {hi}) "
                                              "for 30s")
                        continue
                    idle_since = time.monotonic()
                    for m in msgs:
                        pos, end = self._take(m, pos, pending)
                        if end:
                            break
                    self.done = min(pos, hi) - self.lo
                    if sum(len(a) for a in pending) >= SPILL_TOKENS:
                        self._spill(pending, ids, lengths)
                        pending = []
                self._spill(pending, ids, lengths)
        except KafkaException as e:
            raise unavailable(self.url.bootstrap, e) from None
        finally:
            close_soon(c)

    def _take(self, m, pos: int, pending: list[np.ndarray]) -> tuple[int, bool]:
        """One consumed message: its ids onto `pending` if it is a good record of the range.
        Returns the new read position and whether the range's end was passed."""
        from confluent_kafka import KafkaError

        topic, p, hi = self.url.topic, self.p, self.hi
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

    def _spill(self, docs: list[np.ndarray], ids, lengths) -> None:
        if not docs:
            return
        np.concatenate(docs).astype(self.dtype, copy=False).tofile(ids)
        np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs)).tofile(lengths)
        self.docs += len(docs)
        self.tokens += sum(len(d) for d in docs)

    def documents(self, eos_id: int, chunk_tokens: int = SPILL_TOKENS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The spill back, in order, as (tokens with an EOS after each document, lengths with
        it), about chunk_tokens at a time: what prep.join_documents makes of the same records."""
        lengths = np.fromfile(self.lengths_path, dtype=np.int64)
        if not len(lengths):
            return
        # (a partition of empty documents only spills no token: mmap refuses an empty file)
        ids = np.memmap(self.ids_path, dtype=self.dtype, mode="r") if os.path.getsize(self.ids_path) else \
            np.zeros(0, dtype=self.dtype)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        a = 0
        while a < len(lengths):
            b = max(a + 1, int(np.searchsorted(starts, starts[a] + chunk_tokens, side="right")) - 1)
            b = min(b, len(lengths))
            n = lengths[a:b] + 1
            out = np.full(int(n.sum()), eos_id, dtype=self.dtype)
            keep = np.ones(len(out), dtype=bool)
            keep[np.cumsum(n) - 1] = False          # the EOS after each document
            out[keep] = ids[starts[a]:starts[b]]
            yield out, n
            a = b
        del ids
