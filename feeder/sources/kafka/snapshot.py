"""Bounded mode's snapshot: a frozen epoch's offset ranges read once into Arrow shards in a
spool directory, ordered by (partition, offset), then served exactly as a file dataset
(same packing, same DistributedSampler, same cursors).

A snapshot is a cache entry, not the data: the topic still holds its records. It is written
aside, fsynced and renamed into place (feeder.sources.cache.publish); its manifest is checked
when it is opened and each chunk against the manifest's sha256 on first read (as any dataset's).
A damaged one (issue 34: one flipped byte was DATA_LOSS for every job of that epoch, forever) is
said once, counted, removed, and read again from the topic: the rank that met it is told
UNAVAILABLE, resumes from its cursor and waits for the rebuild as for any build."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from feeder.sources import cache, preparing
from feeder.sources import manifest as mf
from feeder.core.errors import DataLoss, FailedPrecondition, NotFound, Unavailable, WrongReplica
from feeder.sources.posix import PosixSource
from feeder.sources.shards import ShardWriter
from feeder.sources.kafka.consumer import close_soon, consumer_config, partitions, unavailable
from feeder.sources.kafka.once import Beat, build_once, lock_path
from feeder.sources.kafka.options import KafkaURL
from feeder.sources.kafka.partread import PartitionRead
from feeder.sources.kafka.ranges import parse_ranges

log = logging.getLogger("feeder.kafka")

READERS = 8   # partitions read at once while building a snapshot (each its own consumer and thread)
PROGRESS_EVERY_S = 5.0


# Why the spool could not hold a snapshot ("" while it could), for `feeder status`.
problem = ""


def _own_spool() -> Path:
    return cache.own_directory("kafka")


class Snapshots:
    """The snapshots of one topic's epochs, each built once per (ranges, policy) and shared by
    every stream that reads it; a snapshot already in the spool directory is not read again."""

    def __init__(self, url: KafkaURL, spool: Path, *, dtype: np.dtype, vocab_size: int, eos_id: int):
        self.url, self.spool = url, spool
        self.dtype, self.vocab_size, self.eos_id = dtype, vocab_size, eos_id
        self._lock = threading.Lock()
        self._snapshots: dict[str, object] = {}
        self._building: dict[str, threading.Lock] = {}
        # ranges -> the progress of a snapshot being built for this process, here or by another
        # process or feeder sharing the spool (cache) directory: for the log, status and metrics
        self.progress: dict[str, dict] = {}

    def get(self, ranges: str, policy: str, topic_id: str = ""):
        """The epoch `ranges` as a PosixSource (with `bad_records`: how many were skipped), of
        the topic whose Kafka id is `topic_id` (a recreated topic's same ranges are not its)."""
        out = self.dir_for(ranges, policy, topic_id)
        key = out.name
        with self._lock:
            snap = self._snapshots.get(key)
            lock = self._building.setdefault(key, threading.Lock())
        if snap is not None:
            return snap
        with lock:  # ranks opening together: one builds, the others wait for it
            snap = self._snapshots.get(key)
            if snap is not None:
                return snap
            for last in (False, True):   # (one found damaged at open is read again, once)
                try:
                    try:
                        self._build_or_wait(out, ranges, policy, self.identity(ranges, policy, topic_id))
                    except OSError as e:   # the spool cannot hold it (read-only, full, not ours): our own
                        if self.spool == _own_spool():
                            raise
                        self._spool_unusable(e)
                        out = self.dir_for(ranges, policy, topic_id)
                        self._build_or_wait(out, ranges, policy, self.identity(ranges, policy, topic_id))
                finally:
                    self.progress.pop(ranges, None)
                    preparing.finished(ranges)
                seen = cache.identity(out)   # (before it is read: only this one is removed if it fails)
                try:
                    snap = SnapshotSource(out, name=self.url.topic, ranges=ranges, on_damage=self._damaged)
                    snap.bad_records = _bad_records(out, ranges, policy, self.identity(ranges, policy, topic_id))
                    break
                except (DataLoss, NotFound, OSError, ValueError, KeyError, TypeError) as e:
                    # (NotFound: another process removed a damaged copy between its build and here)
                    if last:
                        raise Unavailable(f"the snapshot of Kafka epoch {ranges} could not be opened after it was "
                                          f"built again ({type(e).__name__}: {e}); resume from the cursor") from None
                    cache.remove_damaged(out, seen, "snapshot", f"of Kafka epoch {ranges} ({out})",
                                         f"{type(e).__name__}: {e}")
            with self._lock:
                self._snapshots[key] = snap
            return snap

    def _spool_unusable(self, e: OSError) -> None:
        """Issue 44.2: the data (the topic) is sound, so the rank is served from a snapshot in
        this process's own directory, with a warning and `feeder status` saying what to fix."""
        global problem
        problem = cache.cannot_keep("Kafka snapshots", self.spool, e, f"reads its epochs into {_own_spool()}", problem)
        self.spool = _own_spool()

    def _damaged(self, snap: "SnapshotSource", why: str) -> None:
        """A chunk of a snapshot served here failed its check: forget it here and remove it (unless
        another process already replaced it), so the next stream of the epoch builds it again."""
        with self._lock:
            if self._snapshots.get(snap.root.name) is snap:
                del self._snapshots[snap.root.name]
        cache.remove_damaged(snap.root, snap.identity, "snapshot", f"of Kafka epoch {snap.ranges} ({snap.root})", why)

    def identity(self, ranges: str, policy: str, topic_id: str = "") -> str:
        """Everything a snapshot is the snapshot of: the cluster, the topic (and its Kafka id: a
        recreated topic's same ranges are not its), the epoch's ranges, the bad-record policy, the
        vocabulary and the record limit. Its directory is named by its hash, and its kafka.json
        records it whole, checked at open: another topic's snapshot of the same ranges copied
        under this name is damage, not this epoch (outside review 5)."""
        return (f"{self.url.bootstrap}|{ranges}|{policy}|{self.vocab_size}|{self.eos_id}|"
                f"{self.url.max_record_bytes}{'|' + topic_id if topic_id else ''}")

    def dir_for(self, ranges: str, policy: str, topic_id: str = "") -> Path:
        """Where the snapshot of epoch `ranges` read under `policy` is kept in the spool."""
        key = hashlib.sha256(self.identity(ranges, policy, topic_id).encode()).hexdigest()[:20]
        return self.spool / f"{self.url.topic}-{key}"

    def _build_or_wait(self, out: Path, ranges: str, policy: str, identity: str) -> None:
        """Build `out` here, or wait for the process already building it (once.py)."""
        done = (out / mf.NAME).is_file
        said = [0.0]

        def build() -> None:
            b = SnapshotBuild(self.url, ranges, policy, dtype=self.dtype, vocab_size=self.vocab_size,
                              eos_id=self.eos_id, identity=identity)
            beat = Beat(lock_path(out), lambda: self._note(ranges, b.progress(), said, "building"))
            try:
                b.run(out)
            finally:
                beat.stop()

        build_once(out, done, build, waiting=lambda got: self._note(ranges, got, said, "waiting for"))

    def _note(self, ranges: str, progress: dict | None, said: list[float], doing: str) -> dict:
        """Keep a build's progress for status and metrics, and log it every few seconds."""
        progress = dict(progress or {"ranges": ranges, "phase": "starting"})
        progress["doing"] = doing
        self.progress[ranges] = progress
        total = progress.get("records") or 0
        done = progress.get("records_done", 0) / total if total else None
        by = "" if doing == "building" else f" (built by {progress.get('host', '?')} pid {progress.get('pid', '?')})"
        what = (f"{doing} the snapshot of Kafka epoch {ranges}: {progress.get('phase')}, "
                f"{'?' if done is None else f'{100 * done:.0f}%'} of {total or '?'} records{by}")
        preparing.note(ranges, what, done)
        if time.monotonic() - said[0] >= PROGRESS_EVERY_S:
            said[0] = time.monotonic()
            log.info("kafka: %s", what)
        return progress


class SnapshotBuild:
    """One read of an epoch's ranges into a snapshot directory: the partitions read in parallel
    (partread.py), then joined in (partition, offset) order into shards exactly as a sequential
    read would write them (same files, same fingerprint); written aside, then renamed into
    place, so a reader never sees half of one."""

    def __init__(self, url: KafkaURL, ranges: str, policy: str, *, dtype: np.dtype, vocab_size: int, eos_id: int,
                 identity: str = ""):
        self.url, self.ranges, self.policy, self.identity = url, ranges, policy, identity
        self.dtype, self.vocab_size, self.eos_id = dtype, vocab_size, eos_id
        self.parts: list[PartitionRead] = []
        self.records = 0                  # records in the epoch's ranges
        self.phase = "starting"
        self.docs = self.tokens = 0

    def progress(self) -> dict:
        """What the build has done (the lock file's content, the log's, status's)."""
        done = sum(r.done for r in self.parts)
        return {"ranges": self.ranges, "phase": self.phase, "records_done": done, "records": self.records,
                "tokens_read": sum(r.tokens for r in self.parts)}

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
        stop = threading.Event()
        self.parts = [PartitionRead(self.url, self.ranges, p, lo, hi, policy=self.policy, dtype=self.dtype,
                                    vocab_size=self.vocab_size, tmp=tmp, stop=stop) for p, lo, hi in spans if hi > lo]
        self.records = sum(r.hi - r.lo for r in self.parts)
        try:
            c = Consumer(consumer_config(self.url.bootstrap))
            try:
                # The topic and each partition must still exist before we wait on them: a deleted
                # topic is NOT_FOUND at once (as in follow mode), not UNAVAILABLE retried for minutes.
                present = set(partitions(c, topic, self.url.bootstrap))
                for r in self.parts:
                    r.check(c, present)
            except KafkaException as e:
                raise unavailable(self.url.bootstrap, e) from None
            finally:
                close_soon(c)
            self.phase = "reading"
            self._read_all(stop)
            self.phase = "writing"
            self._write(tmp)
        except BaseException:
            stop.set()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._finish(tmp, out, t0)

    def _read_all(self, stop: threading.Event) -> None:
        """Every partition at once (up to READERS), each on its own consumer; the first error
        stops the others and is raised."""
        if not self.parts:
            return
        with ThreadPoolExecutor(min(READERS, len(self.parts)), thread_name_prefix="kafka-snapshot") as pool:
            futures = [pool.submit(r.run) for r in self.parts]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                stop.set()
                raise failed[0].exception()
            for f in futures:
                f.result()

    def _write(self, tmp: Path) -> None:
        self.writer = ShardWriter(tmp, self.dtype.name, shard_tokens=64 << 20, chunk_tokens=1 << 20)
        for r in self.parts:
            for tokens, lengths in r.documents(self.eos_id):
                self.writer.add(tokens, lengths)
                self.docs, self.tokens = self.docs + len(lengths), self.tokens + len(tokens)
            r.ids_path.unlink()
            r.lengths_path.unlink()

    def _finish(self, tmp: Path, out: Path, t0: float) -> None:
        """The manifest and the bad-record list, then the directory renamed into place."""
        shards = self.writer.close() if self.parts else []
        bad = [b for r in self.parts for b in r.bad]
        ranges = self.ranges
        if not shards:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FailedPrecondition(f"the Kafka epoch {ranges} holds no servable records"
                                     + (f" ({len(bad)} bad records skipped)" if bad else ""))
        mf.write(tmp, mf.Manifest(tokenizer={"kind": "kafka", "topic": self.url.topic, "ranges": ranges},
                                  vocab_size=self.vocab_size, eos_id=self.eos_id, dtype=self.dtype.name,
                                  shards=tuple(shards)))
        (tmp / "kafka.json").write_text(json.dumps({"ranges": ranges, "policy": self.policy, "topic": self.url.topic,
                                                    "identity": self.identity,
                                                    "bad_records": len(bad), "bad": bad[:1000]}))
        shutil.rmtree(out, ignore_errors=True)
        cache.publish(tmp, out)
        took = time.monotonic() - t0
        log.info("kafka epoch %s: %d documents, %d tokens, %d bad records skipped, read in %.1fs (%.0f MB/s of "
                 "tokens, %d partitions at once) into %s", ranges, self.docs, self.tokens, len(bad), took,
                 self.tokens * self.dtype.itemsize / max(took, 1e-9) / 1e6, min(READERS, len(self.parts)), out)


def _bad_records(out: Path, ranges: str, policy: str, identity: str) -> int:
    """How many bad records the snapshot's build skipped, from its kafka.json, which must say the
    snapshot's whole identity (Snapshots.identity: the topic, the epoch, the policy, ...) and
    a count that agrees with the records it lists (ValueError otherwise: kafka.json is not under
    the manifest's fingerprint, so it is checked here)."""
    meta = json.loads((out / "kafka.json").read_text())
    n, bad = meta["bad_records"], meta["bad"]
    if meta["ranges"] != ranges or meta["policy"] != policy or meta.get("identity") != identity \
            or not isinstance(n, int) or len(bad) != min(n, 1000):
        raise ValueError(f"{out / 'kafka.json'} does not describe this epoch's build")
    return n


class SnapshotSource(PosixSource):
    """A snapshot served as a file dataset, whose damage is not the end of it: a chunk that
    fails its check has the snapshot removed (`on_damage`) and is UNAVAILABLE to the rank, which
    resumes from its cursor while the epoch is read again from the topic."""

    def __init__(self, root: Path, *, name: str, ranges: str, on_damage):
        self.identity = cache.identity(root)   # (before the manifest is read: the directory checked is this one)
        super().__init__(root, name=name)
        self.ranges, self._on_damage, self._told = ranges, on_damage, False

    def chunk(self, k: int) -> np.ndarray:
        try:
            return super().chunk(k)
        except DataLoss as e:
            raise self._rebuilding(str(e)) from None

    def doc_starts(self, k: int) -> np.ndarray:
        try:
            return super().doc_starts(k)
        except DataLoss as e:
            raise self._rebuilding(str(e)) from None

    def _rebuilding(self, why: str) -> Unavailable:
        with self._lock:
            first, self._told = not self._told, True
        if first:
            self._on_damage(self, why)
        return Unavailable(f"the snapshot of Kafka epoch {self.ranges} in the cache was damaged ({why}): it is "
                           "being read again from the topic; resume from the cursor")
