"""Kafka partitions as a token source: the only module that imports confluent_kafka.

URL: kafka://HOST:PORT[,HOST:PORT...]/TOPIC[?mode=bounded|follow&bad_records=fail|skip
     &vocab_size=N&eos_id=N&max_record_bytes=N&spool=DIR&group=NAME&epoch_ttl_s=SECONDS]

Record value: `encode_record` (a header naming dtype, vocab and tokenizer, then the token
ids little-endian), or JSON {"tokens": [...]} as existing producers write it. A document's
tokens never include EOS; the source adds one after each record, as `feeder prep` does.

bounded (default): an epoch is the set of records present when the job starts, frozen as
    offset ranges per partition. The feeder reads those ranges once into a local snapshot
    (Arrow shards in a spool directory, ordered by (partition, offset)) and serves it exactly
    as a file dataset: same packing, same DistributedSampler, same cursors. The ranges travel
    in every cursor, so any feeder rebuilds the same snapshot on resume.

    Which ranges a job's stream *without* a cursor gets is agreed in Kafka itself, so that the
    ranks of one job read one epoch whichever feeder, process (`serve --processes N`) or region
    (sharing the cluster) each lands on, and after a failover before the first batch: the epoch
    register, a single-partition topic `__feeder_epochs` (created if missing, LogAppendTime,
    no retention limit). Every record is (topic, job, ranges, ttl); read in log order, a record
    for a job with no live entry *establishes* the entry with its ranges, and any other record
    for it only *refreshes* the entry (its ranges are ignored). An entry is live until `ttl`
    (of its establishing record) has passed, by the broker's append timestamps, since its
    latest record. Log order and broker timestamps are the same for every reader, so every
    feeder derives the same entry: the first writer after a gap wins. A feeder that needs the
    epoch appends its proposal (its current high watermarks; acks=all, idempotent), reads the
    register up to its own record and takes the entry it finds there; it then knows the entry
    stays live for `ttl` and serves further ranks of the job from memory for `ttl`/2.
    Run identity (reusing a job name): while a stream of the job is open on any feeder, that
    feeder refreshes the entry every `ttl`/4; so the entry expires between 3/4·ttl and ttl
    after the job's last stream anywhere closed, and a later run of the same name then gets a
    new epoch. `ttl` is the URL option epoch_ttl_s, by default the feeder's job idle TTL (24 h);
    it must exceed the longest time between the first and the last rank's first stream of a
    job. The register must keep its records (no retention limit, as created here): a reader
    that started after records were deleted could take a later record as establishing. A stream with a cursor, or with a Kafka `expected_fingerprint`, reads those ranges and
    does not ask the register (it refreshes the job's entry, or re-establishes it after a long
    pause, with its ranges).
follow: the topic is tailed without end. Records are interleaved round-robin over the
    partitions (record k is the next one of partition k mod P), record k goes to rank k mod W,
    and each rank packs its records into samples. The cursor holds the offsets, so a restart
    replays exactly. Round-robin is what makes the order deterministic: a partition with no
    new record holds the stream until it has one (`feeder publish` fills them evenly).

Offsets are owned by the cursor: explicit assign(), no auto-commit, read_committed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qs, urlparse

import numpy as np

from feeder import manifest as mf
from feeder.config import StreamSpec
from feeder.cursor import Cursor
from feeder.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, Unavailable, WrongReplica
from feeder.pipeline.plan import PlannedBatch, Start, StreamPlan
from feeder.prep import ShardWriter, join_documents

log = logging.getLogger("feeder.kafka")

MAGIC = b"FTK1"
_HEADER = struct.Struct("<4sBBII")   # magic, dtype itemsize, tokenizer-name length, vocab_size, eos_id
MODES = ("bounded", "follow")
POLICIES = ("fail", "skip")
BAD_KINDS = ("undecodable", "wrong_dtype", "out_of_vocab", "empty", "too_large")
EPOCHS_TOPIC = "__feeder_epochs"
EPOCH_TTL_S = 24 * 3600.0   # the engine's job idle TTL (pipeline.stream.Jobs): a forgotten job's name is free


# --------------------------------------------------------------------------- records

def encode_record(ids: np.ndarray, *, vocab_size: int, eos_id: int, tokenizer: str) -> bytes:
    dtype = np.dtype(mf.dtype_for_vocab(vocab_size)).newbyteorder("<")
    name = tokenizer.encode()[:255]
    head = _HEADER.pack(MAGIC, dtype.itemsize, len(name), vocab_size, eos_id)
    return head + name + np.asarray(ids).astype(dtype, copy=False).tobytes()


class BadRecord(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def decode_record(value: bytes | None, *, dtype: np.dtype, vocab_size: int, max_bytes: int) -> np.ndarray:
    """Token ids of one record, or BadRecord saying what is wrong with it.

    Total on any bytes: a record is written by whoever can produce to the topic, so whatever
    a parser raises on hostile input (json's RecursionError on deep nesting, ValueError on a
    5,000-digit integer, struct.error, ...) is the record's fault and becomes BadRecord
    ("undecodable"), never an exception that ends the stream as INTERNAL/UNKNOWN (which
    clients retry for minutes). The kinds we can name are named first."""
    try:
        return _decode(value, dtype=dtype, vocab_size=vocab_size, max_bytes=max_bytes)
    except BadRecord:
        raise
    except (ValueError, ArithmeticError, TypeError, LookupError, RecursionError, struct.error) as e:
        raise BadRecord("undecodable", f"{type(e).__name__}: {str(e)[:200]}") from None


def _decode(value: bytes | None, *, dtype: np.dtype, vocab_size: int, max_bytes: int) -> np.ndarray:
    if not value:  # a tombstone or a producer bug; an empty *document* still has a header or {"tokens": []}
        raise BadRecord("empty", "the record has no value (null or 0 bytes)")
    if len(value) > max_bytes:
        raise BadRecord("too_large", f"{len(value)} bytes, the limit is max_record_bytes={max_bytes}")
    if value[:4] == MAGIC:
        if len(value) < _HEADER.size:
            raise BadRecord("undecodable", f"{len(value)} bytes is shorter than the {_HEADER.size}-byte header")
        _, itemsize, name_len, _vocab, _eos = _HEADER.unpack_from(value)
        if _HEADER.size + name_len > len(value):
            # Slicing past the end gives an empty payload, i.e. an empty document: the bytes
            # would be served as something they do not say.
            raise BadRecord("undecodable", f"the header's tokenizer name of {name_len} bytes runs past the end of "
                                           f"the {len(value)}-byte record")
        if itemsize != dtype.itemsize:
            raise BadRecord("wrong_dtype", f"the record holds {itemsize}-byte ids, this topic's vocab "
                                           f"({vocab_size}) uses {dtype.itemsize}-byte ids ({dtype.name})")
        payload = memoryview(value)[_HEADER.size + name_len:]
        if len(payload) % itemsize:
            raise BadRecord("undecodable", f"payload of {len(payload)} bytes is not a whole number of "
                                           f"{itemsize}-byte ids")
        ids = np.frombuffer(payload, dtype=dtype.newbyteorder("<"))
    elif value[:1] in (b"{", b" "):
        try:
            obj = json.loads(value)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRecord("undecodable", f"not valid JSON ({e})") from None
        toks = obj.get("tokens") if isinstance(obj, dict) else None
        if not isinstance(toks, list):
            raise BadRecord("undecodable", "a JSON record must be an object with a 'tokens' list")
        if not all(type(t) is int for t in toks):   # bool is an int subclass, and not a token id
            bad = next(t for t in toks if type(t) is not int)
            raise BadRecord("wrong_dtype", f"'tokens' must hold integers, found {str(bad)[:40]!r}")
        if toks:
            # Checked on Python ints, before numpy: an id beyond int64 would raise OverflowError there.
            lo, hi = min(toks), max(toks)
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise BadRecord("out_of_vocab", f"token ids must be in [0, {vocab_size}), found {str(bad)[:40]}")
        ids = np.asarray(toks, dtype=np.int64)
    else:
        raise BadRecord("undecodable", f"neither a feeder record ({MAGIC!r} header) nor JSON "
                                       f"(starts with {bytes(value[:8])!r})")
    if ids.size == 0:
        return ids.astype(dtype)  # an empty document (header or {"tokens": []}): EOS only, as `prep` does
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise BadRecord("out_of_vocab", f"token ids must be in [0, {vocab_size}), found {lo if lo < 0 else hi}")
    return ids


# --------------------------------------------------------------------------- configuration

@dataclass(frozen=True, kw_only=True)
class KafkaURL:
    bootstrap: str
    topic: str
    mode: str = "bounded"
    bad_records: str = "fail"
    vocab_size: int = 0
    eos_id: int = -1
    max_record_bytes: int = 16 << 20
    spool: str = ""
    group: str = ""
    epoch_ttl_s: float = EPOCH_TTL_S

    @classmethod
    def parse(cls, url: str, *, vocab_size: int = 0, eos_id: int = -1) -> "KafkaURL":
        u = urlparse(url)
        topic = u.path.strip("/")
        if u.scheme != "kafka" or not u.netloc or not topic or "/" in topic:
            raise InvalidArgument(f"a Kafka source is kafka://HOST:PORT[,HOST:PORT]/TOPIC[?options], got {url!r}")
        q = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        known = {"mode", "bad_records", "vocab_size", "eos_id", "max_record_bytes", "spool", "group",
                 "epoch_ttl_s"}
        unknown = sorted(set(q) - known)
        if unknown:
            raise InvalidArgument(f"unknown Kafka URL option(s) {unknown}; known: {sorted(known)}")

        def integer(name, default):
            try:
                return int(q.get(name, default))
            except ValueError:
                raise InvalidArgument(f"Kafka URL option {name} must be an integer, got {q[name]!r}") from None

        def number(name, default):
            try:
                return float(q.get(name, default))
            except ValueError:
                raise InvalidArgument(f"Kafka URL option {name} must be a number, got {q[name]!r}") from None

        cfg = cls(bootstrap=u.netloc, topic=topic, mode=q.get("mode", "bounded"),
                  bad_records=q.get("bad_records", "fail"), vocab_size=integer("vocab_size", vocab_size),
                  eos_id=integer("eos_id", eos_id), max_record_bytes=integer("max_record_bytes", 16 << 20),
                  spool=q.get("spool", ""), group=q.get("group", ""), epoch_ttl_s=number("epoch_ttl_s", EPOCH_TTL_S))
        if cfg.mode not in MODES:
            raise InvalidArgument(f"Kafka URL option mode must be bounded or follow, got {cfg.mode!r}")
        if cfg.bad_records not in POLICIES:
            raise InvalidArgument(f"Kafka URL option bad_records must be fail or skip, got {cfg.bad_records!r}")
        if cfg.max_record_bytes <= 0:
            raise InvalidArgument(f"max_record_bytes must be positive, got {cfg.max_record_bytes}")
        if not 0 < cfg.epoch_ttl_s < float("inf"):
            raise InvalidArgument(f"Kafka URL option epoch_ttl_s must be a positive number of seconds, "
                                  f"got {cfg.epoch_ttl_s}")
        return cfg


def consumer_config(bootstrap: str, **extra) -> dict:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": f"feeder-{uuid.uuid4().hex[:12]}",  # never joined: partitions are assign()ed
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",      # records of aborted transactions are never seen
        "enable.partition.eof": True,
        "auto.offset.reset": "error",              # an offset gone to retention is an error, not a jump
        "fetch.max.bytes": 64 << 20,
        "max.partition.fetch.bytes": 16 << 20,
        "queued.max.messages.kbytes": 64 << 10,
        "reconnect.backoff.ms": 100,
        "reconnect.backoff.max.ms": 2000,
        "socket.keepalive.enable": True,
        "logger": logging.getLogger("feeder.kafka.librdkafka"),
        **extra,
    }


def _unavailable(bootstrap: str, e: Exception) -> Unavailable:
    return Unavailable(f"cannot read Kafka at {bootstrap}: {e}; the feeder retries, resume from the cursor")


def watermarks(consumer, topic: str, partition: int, bootstrap: str) -> tuple[int, int]:
    """(low, high) offsets of a partition, asked of the broker now."""
    from confluent_kafka import KafkaException, TopicPartition

    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
    except KafkaException as e:
        raise _unavailable(bootstrap, e) from None


def partitions(consumer, topic: str, bootstrap: str) -> list[int]:
    from confluent_kafka import KafkaException

    try:
        md = consumer.list_topics(topic, timeout=10)
    except KafkaException as e:
        raise _unavailable(bootstrap, e) from None
    t = md.topics.get(topic)
    if t is None or t.error is not None and t.error.code() == 3:  # UNKNOWN_TOPIC_OR_PART
        raise NotFound(f"Kafka topic {topic!r} does not exist at {bootstrap}")
    if t.error is not None:
        raise _unavailable(bootstrap, t.error)
    return sorted(t.partitions)


# --------------------------------------------------------------------------- the source

class KafkaSource:
    """Presents a topic; `plan_for` decides per stream what the job reads (see module doc)."""

    def __init__(self, url: KafkaURL):
        from confluent_kafka import Consumer

        self.url = url
        self.name = url.topic
        self._consumer = Consumer(consumer_config(url.bootstrap))   # metadata and watermarks only
        self._meta_lock = threading.Lock()
        self.vocab_size, self.eos_id = url.vocab_size, url.eos_id
        if self.vocab_size <= 0:
            self.vocab_size, self.eos_id = self._vocab_from_first_record()
        if not 0 <= self.eos_id < self.vocab_size:
            raise InvalidArgument(f"Kafka source {url.topic}: eos_id must be in [0, vocab_size={self.vocab_size}), "
                                  f"got {self.eos_id}")
        self.dtype = np.dtype(mf.dtype_for_vocab(self.vocab_size))
        self.n_tokens = self.n_documents = 0   # unknown until a job freezes its epoch
        self._register = EpochRegister(url.bootstrap, url.topic, ttl_s=url.epoch_ttl_s)
        self._snapshots: dict[str, object] = {}
        self._building: dict[str, threading.Lock] = {}
        self._taken: dict[str, dict[int, dict[int, int]]] = {}
        self._committed: dict[str, dict[int, int]] = {}
        self._group_consumer = None
        self._spool = Path(url.spool or Path(tempfile.gettempdir()) / f"feeder-kafka-spool-{os.getuid()}")

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
                v = msgs[0].value() if msgs and msgs[0].error() is None else None
                if v and v[:4] == MAGIC and len(v) >= _HEADER.size:
                    _, _, _, vocab, eos = _HEADER.unpack_from(v)
                    log.info("topic %s: vocab_size=%d eos_id=%d from its first record's header",
                             self.url.topic, vocab, eos)
                    return vocab, eos
                break
        raise InvalidArgument(f"Kafka source {self.url.topic}: give vocab_size and eos_id (URL options "
                              "?vocab_size=N&eos_id=N or --vocab-size/--eos-id); the topic's first record does not "
                              "carry them (empty topic, or JSON records)")

    def _ranges_now(self) -> str:
        c, topic, bootstrap = self._consumer, self.url.topic, self.url.bootstrap
        with self._meta_lock:
            spans = [(p, *watermarks(c, topic, p, bootstrap)) for p in partitions(c, topic, bootstrap)]
        return f"kafka:{topic}:" + ",".join(f"{p}={lo}-{hi}" for p, lo, hi in spans)

    # -- streams
    def plan_for(self, spec: StreamSpec, cursor: Cursor | None):
        """(plan, token source) for one stream; may block (snapshot build, metadata)."""
        policy = spec.bad_records or self.url.bad_records
        if self.url.mode == "follow":
            if spec.reshard:
                raise FailedPrecondition("a Kafka follow stream cannot be re-dealt to another world size; "
                                         "resume it with the world size of its cursor")
            return FollowPlan(self, spec, cursor, policy), self
        if cursor is not None and cursor.src:
            ranges = cursor.src
        elif spec.expected_fingerprint.startswith("kafka:"):
            ranges = spec.expected_fingerprint
        elif spec.expected_fingerprint:
            raise WrongReplica(f"expected_fingerprint {spec.expected_fingerprint!r} is not a Kafka epoch; "
                                     f"this feeder serves topic {self.url.topic} (Info gives its current epoch)")
        else:  # agreed with every other feeder of the cluster (see the module doc)
            ranges = self._register.epoch(spec.job, self._ranges_now)
        snap = self.snapshot(ranges, policy)
        if cursor is not None and cursor.fingerprint != snap.fingerprint:
            raise WrongReplica(f"cursor does not fit this stream: dataset fingerprint differs: the cursor has "
                                     f"{cursor.fingerprint!r}, the Kafka epoch {ranges} reads as {snap.fingerprint!r}")
        plan = _BoundedPlan(spec, n_tokens=snap.n_tokens, fingerprint=snap.fingerprint, cursor=cursor, src=ranges)
        plan.bad_records = snap.bad_records
        plan.register = self._register
        self._register.hold(spec.job, plan)
        return plan, snap

    def snapshot(self, ranges: str, policy: str):
        """The frozen epoch as a local file dataset, built once per (ranges, policy)."""
        from feeder.sources.posix import PosixSource

        key = hashlib.sha256(f"{self.url.bootstrap}|{ranges}|{policy}|{self.vocab_size}|{self.eos_id}|"
                             f"{self.url.max_record_bytes}".encode()).hexdigest()[:20]
        with self._meta_lock:
            snap = self._snapshots.get(key)
            lock = self._building.setdefault(key, threading.Lock())
        if snap is not None:
            return snap
        with lock:  # ranks opening together: one builds, the others wait for it
            snap = self._snapshots.get(key)
            if snap is not None:
                return snap
            out = self._spool / f"{self.url.topic}-{key}"
            if not (out / mf.NAME).is_file():
                self._build(ranges, policy, out)
            snap = PosixSource(out, name=self.url.topic)
            snap.bad_records = json.loads((out / "kafka.json").read_text())["bad_records"]
            self._snapshots[key] = snap
            return snap

    def _build(self, ranges: str, policy: str, out: Path) -> None:
        from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

        topic, spans = parse_ranges(ranges)
        if topic != self.url.topic:
            raise WrongReplica(f"the epoch {ranges!r} is of topic {topic!r}; this feeder serves "
                                     f"{self.url.topic!r}")
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}-{threading.get_ident()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.monotonic()
        writer = ShardWriter(tmp, self.dtype.name, shard_tokens=64 << 20, chunk_tokens=1 << 20)
        bad: list[dict] = []
        docs = tokens = 0
        c = Consumer(consumer_config(self.url.bootstrap))
        try:
            # The topic and each partition must still exist before we wait on them: a deleted
            # topic is NOT_FOUND at once (as in follow mode), not UNAVAILABLE retried for minutes.
            present = set(partitions(c, topic, self.url.bootstrap))
            for p, lo, hi in spans:
                if hi <= lo:
                    continue
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
                        err = m.error()
                        if err is not None:
                            if err.code() == KafkaError._PARTITION_EOF:
                                pos = max(pos, m.offset())
                                continue
                            if err.code() == KafkaError._AUTO_OFFSET_RESET:
                                raise DataLoss(f"Kafka {topic}/{p}: offset {pos} is out of range ({err.str()})")
                            if err.fatal():
                                raise _unavailable(self.url.bootstrap, err.str())
                            log.warning("kafka %s/%d: %s (retrying)", topic, p, err.str())
                            continue
                        off = m.offset()
                        pos = off + 1
                        if off >= hi:
                            break
                        try:
                            ids = decode_record(m.value(), dtype=self.dtype, vocab_size=self.vocab_size,
                                                max_bytes=self.url.max_record_bytes)
                        except BadRecord as b:
                            where = f"{topic}/{p}@{off}"
                            if policy == "fail":
                                raise DataLoss(f"bad Kafka record {where}: {b} (policy bad_records=fail; "
                                               "bad_records=skip serves the epoch without it)") from None
                            log.warning("bad Kafka record %s skipped: %s", where, b)
                            bad.append({"partition": p, "offset": off, "kind": b.kind, "detail": b.detail})
                            continue
                        pending.append(ids)
                    if sum(len(a) for a in pending) >= 1 << 20:
                        d, t = self._flush(writer, pending)
                        docs, tokens = docs + d, tokens + t
                        pending = []
                d, t = self._flush(writer, pending)
                docs, tokens = docs + d, tokens + t
                c.unassign()
        except KafkaException as e:
            raise _unavailable(self.url.bootstrap, e) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            _close(c)
        shards = writer.close()
        if not shards:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FailedPrecondition(f"the Kafka epoch {ranges} holds no servable records"
                                     + (f" ({len(bad)} bad records skipped)" if bad else ""))
        mf.write(tmp, mf.Manifest(tokenizer={"kind": "kafka", "topic": topic, "ranges": ranges},
                                  vocab_size=self.vocab_size, eos_id=self.eos_id, dtype=self.dtype.name,
                                  shards=tuple(shards)))
        (tmp / "kafka.json").write_text(json.dumps({"ranges": ranges, "policy": policy, "bad_records": len(bad),
                                                    "bad": bad[:1000]}))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        log.info("kafka epoch %s: %d documents, %d tokens, %d bad records skipped, read in %.1fs into %s",
                 ranges, docs, tokens, len(bad), time.monotonic() - t0, out)

    def _flush(self, writer, docs: list[np.ndarray]) -> tuple[int, int]:
        if not docs:
            return 0, 0
        tokens, lengths = join_documents(docs, self.eos_id, self.dtype)
        writer.add(tokens, lengths)
        return len(docs), len(tokens)

    def commit_taken(self, job: str, rank: int, world: int, offsets: dict[int, int]) -> None:
        """Follow mode with ?group=NAME: commit, per partition, the offset every rank of the job
        has passed (the minimum over ranks of what their loops have taken), so standard Kafka
        tooling (kafka-consumer-groups --describe) shows the job's lag. Best effort, async."""
        if not self.url.group:
            return
        from confluent_kafka import Consumer, TopicPartition

        taken = self._taken.setdefault(job, {})
        taken[rank] = offsets
        if len(taken) < world:
            return
        low = {p: min(o[p] for o in taken.values() if p in o) for p in offsets}
        if low == self._committed.get(job):
            return
        if self._group_consumer is None:
            self._group_consumer = Consumer(consumer_config(self.url.bootstrap, **{"group.id": self.url.group}))
        try:
            self._group_consumer.commit(offsets=[TopicPartition(self.url.topic, p, o) for p, o in sorted(low.items())],
                                        asynchronous=True)
            self._committed[job] = low
        except Exception as e:  # the data path must not suffer for a dashboard
            log.warning("kafka %s: committing offsets to group %s failed: %s", self.url.topic, self.url.group, e)

    def close(self) -> None:
        _close(self._consumer)
        self._register.close()
        if self._group_consumer is not None:
            _close(self._group_consumer)


class _BoundedPlan(StreamPlan):
    """A bounded stream's plan; while it is open its job's register entry is kept live."""

    register: "EpochRegister | None" = None

    def close(self) -> None:
        if self.register is not None:
            self.register.release(self.spec.job, self)
        super().close()


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
        """A bounded stream of `job` is open here with `plan` (its ranges in plan.src)."""
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
                running = {job: next(iter(live)).src for job, live in self._live.items() if len(live)}
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
            raise _unavailable(self.bootstrap, e) from None

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
            raise _unavailable(self.bootstrap, box.get("err") or "the epoch register write timed out")
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
                    raise _unavailable(self.bootstrap, err.str())
                if m.offset() >= self._next:
                    self._apply(m)
                    self._next = m.offset() + 1
                    deadline = time.monotonic() + 30

    def close(self) -> None:
        self._stop.set()
        self._kick.set()
        if self._consumer is not None:
            _close(self._consumer)
        if self._producer is not None:   # refreshes in flight; never wait long on shutdown
            threading.Thread(target=self._producer.flush, args=(2,), daemon=True, name="kafka-epochs-flush").start()


def parse_ranges(ranges: str) -> tuple[str, list[tuple[int, int, int]]]:
    try:
        kind, topic, body = ranges.split(":", 2)
        assert kind == "kafka"
        spans = []
        for part in body.split(","):
            p, span = part.split("=")
            lo, hi = span.split("-")
            spans.append((int(p), int(lo), int(hi)))
        return topic, spans
    except (ValueError, AssertionError):
        raise FailedPrecondition(f"{ranges!r} is not a Kafka epoch (kafka:TOPIC:P=LO-HI,...)") from None


def _close(consumer) -> None:
    """close() has been seen to hang (confluent-kafka-python #1667): never wait on it."""
    threading.Thread(target=consumer.close, daemon=True, name="kafka-close").start()


# --------------------------------------------------------------------------- follow mode

@dataclass
class FollowState:
    """Where the interleave stands: the next record is the first of partition `turn` at or
    after offset next[turn]; `k` records came before it."""
    next: list[int]
    turn: int = 0
    k: int = 0

    def copy(self) -> "FollowState":
        return FollowState(list(self.next), self.turn, self.k)


@dataclass
class _Mark:
    at: int              # position, in this rank's token stream, of the record's first token
    state: FollowState   # interleave state just before the record


class FollowPlan:
    """One rank's endless stream: round-robin interleave, records dealt k mod W, packed."""

    def __init__(self, src: KafkaSource, spec: StreamSpec, cursor: Cursor | None, policy: str):
        from confluent_kafka import Consumer

        self.src, self.spec, self.policy = src, spec, policy
        self.fingerprint = f"kafka-follow:{src.url.topic}"
        self.n = 0
        self.bad_records = 0
        self.lag: dict[int, int] = {}
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kafka-follow-r{spec.rank}")
        # step -> offsets fully consumed once the batch of that step is taken (for group commits)
        self.offsets_after: deque[tuple[int, list[int]]] = deque(maxlen=4096)
        self._closed = threading.Event()
        self._consumer = Consumer(consumer_config(src.url.bootstrap, error_cb=self._on_error))
        self._down_since: float | None = None
        parts = partitions(self._consumer, src.url.topic, src.url.bootstrap)
        if cursor is None:
            url = src.url
            self.state = FollowState(next=[watermarks(self._consumer, url.topic, p, url.bootstrap)[0] for p in parts])
            self.i, skip, step = 0, 0, 0
        else:
            if cursor.fingerprint != self.fingerprint:
                raise FailedPrecondition(f"cursor does not fit this stream: dataset fingerprint differs: the cursor "
                                         f"has {cursor.fingerprint!r}, this stream reads {self.fingerprint!r}")
            for name, theirs, ours in (("job", cursor.job, spec.job), ("world_size", cursor.world_size, spec.world_size),
                                       ("rank", cursor.rank, spec.rank), ("seq_len", cursor.seq_len, spec.seq_len)):
                if theirs != ours:
                    raise FailedPrecondition(f"cursor does not fit this stream: {name} differs: the cursor has "
                                             f"{theirs!r}, the request has {ours!r}")
            pos = json.loads(cursor.src)
            if pos["P"] != len(parts):
                raise FailedPrecondition(f"topic {src.url.topic} had {pos['P']} partitions when this cursor was made "
                                         f"and has {len(parts)} now; a follow stream needs a fixed partition count")
            self.state = FollowState(next=pos["next"], turn=pos["turn"], k=pos["k"])
            self.i, skip, step = pos["i"], pos["skip"], cursor.step
        self.parts = parts
        self.start = Start(epoch=spec.epoch, base=0, world=spec.world_size, pos=self.i, step=step)
        self._skip = skip
        self._step = step

    def _on_error(self, err) -> None:
        from confluent_kafka import KafkaError

        if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            if self._down_since is None:
                self._down_since = time.monotonic()
            log.warning("kafka %s: %s", self.src.url.topic, err.str())

    def close(self) -> None:
        """Stops the reader; the consumer is closed by the reader's own thread (or when the
        generator is collected), never while another thread is inside consume()."""
        if not self._closed.is_set():
            self._closed.set()
            self.executor.shutdown(wait=False)

    def _cursor(self, state: FollowState, skip: int, i: int, step: int) -> Cursor:
        s = self.spec
        src = json.dumps({"P": len(self.parts), "next": state.next, "turn": state.turn, "k": state.k,
                          "skip": skip, "i": i}, separators=(",", ":"))
        return Cursor(job=s.job, fingerprint=self.fingerprint, seed=s.seed, shuffle=False, drop_last=s.drop_last,
                      seq_len=s.seq_len, world_size=s.world_size, rank=s.rank, epoch=s.epoch, base=0, pos=i,
                      step=step, src=src)

    def _records(self) -> Iterator[tuple[FollowState, np.ndarray | None] | None]:
        """(state before the record, its tokens + EOS, or None when it is another rank's or
        skipped) in interleave order; None when no record is ready yet."""
        from confluent_kafka import TopicPartition

        topic, P, W, r = self.src.url.topic, len(self.parts), self.spec.world_size, self.spec.rank
        c = self._consumer
        st = self.state
        c.assign([TopicPartition(topic, self.parts[j], st.next[j]) for j in range(P)])
        try:
            yield from self._interleave(c, st, topic, P, W, r)
        finally:
            _close(c)

    def _interleave(self, c, st, topic, P, W, r):
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        queues = [deque() for _ in range(P)]
        paused: set[int] = set()
        last_lag = 0.0
        while not self._closed.is_set():
            j = st.turn
            if not queues[j]:
                try:
                    msgs = c.consume(2000, timeout=0.2)
                except (KafkaException, RuntimeError) as e:
                    if self._closed.is_set():
                        return
                    raise _unavailable(self.src.url.bootstrap, e) from None
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            continue
                        if err.code() == KafkaError._AUTO_OFFSET_RESET:
                            raise DataLoss(f"Kafka {topic}/{m.partition()}: the cursor's offset is out of range "
                                           f"(deleted by retention?): {err.str()}")
                        log.warning("kafka %s: %s", topic, err.str())
                        continue
                    self._down_since = None
                    q = self.parts.index(m.partition())
                    if m.offset() >= st.next[q]:
                        queues[q].append(m)
                        if len(queues[q]) > 5000 and q not in paused:  # one partition must not fill memory
                            c.pause([TopicPartition(topic, m.partition())])
                            paused.add(q)
                if time.monotonic() - last_lag > 2.0:
                    last_lag = time.monotonic()
                    self._update_lag(c, st)
                if not queues[j]:
                    self._check_broker(c)
                    yield None
                    continue
            m = queues[j].popleft()
            if j in paused and len(queues[j]) < 500:
                c.resume([TopicPartition(topic, self.parts[j])])
                paused.discard(j)
            before = st.copy()
            st.next[j] = m.offset() + 1
            st.turn = (j + 1) % P
            st.k += 1
            if before.k % W != r:
                yield before, None
                continue
            try:
                ids = decode_record(m.value(), dtype=self.src.dtype, vocab_size=self.src.vocab_size,
                                    max_bytes=self.src.url.max_record_bytes)
            except BadRecord as b:
                where = f"{topic}/{m.partition()}@{m.offset()}"
                if self.policy == "fail":
                    raise DataLoss(f"bad Kafka record {where}: {b} (policy bad_records=fail; "
                                   "bad_records=skip serves the stream without it)") from None
                self.bad_records += 1
                log.warning("bad Kafka record %s skipped (job %s rank %d): %s", where, self.spec.job, r, b)
                yield before, None
                continue
            tokens = np.empty(len(ids) + 1, dtype=self.src.dtype)
            tokens[:-1] = ids
            tokens[-1] = self.src.eos_id
            yield before, tokens

    def offsets_at(self, step: int) -> dict[int, int] | None:
        """{partition: next offset} once the batch of `step` has been taken, if remembered."""
        for s, nxt in reversed(self.offsets_after):
            if s == step:
                return dict(zip(self.parts, nxt))
            if s < step:
                break
        return None

    def _update_lag(self, c, st: FollowState) -> None:
        from confluent_kafka import TopicPartition

        for j, p in enumerate(self.parts):
            try:
                _, hi = c.get_watermark_offsets(TopicPartition(self.src.url.topic, p), cached=True)
            except Exception:
                continue
            if hi >= 0:
                self.lag[p] = max(0, hi - st.next[j])

    def _check_broker(self, c) -> None:
        """Tailing an idle topic looks like a dead broker; ask before calling it UNAVAILABLE."""
        from confluent_kafka import KafkaException

        if self._down_since is None or time.monotonic() - self._down_since < 3.0:
            return
        try:
            c.list_topics(self.src.url.topic, timeout=2)
            self._down_since = None
        except KafkaException as e:
            raise _unavailable(self.src.url.bootstrap, e) from None

    def batches(self) -> Iterator[PlannedBatch | None]:
        s = self.spec
        L, W, r, mb = s.seq_len, s.world_size, s.rank, s.micro_batch
        i, step = self.i, self._step
        buf = np.empty(0, dtype=self.src.dtype)
        buf_at = i * L - self._skip        # stream position of buf[0]
        marks: deque[_Mark] = deque()
        first = True
        rows: list[np.ndarray] = []
        for item in self._records():
            if item is None:
                yield None
                continue
            before, tokens = item
            if first:
                marks.append(_Mark(buf_at, before))
                first = False
            if tokens is None:
                continue
            end = buf_at + len(buf)
            marks.append(_Mark(end, before))
            buf = np.concatenate([buf, tokens]) if len(buf) else tokens
            while buf_at + len(buf) >= (i * L) + L + 1:        # sample i is complete
                off = i * L - buf_at
                rows.append(buf[off:off + L + 1])
                i += 1
                drop = i * L - buf_at
                if drop > 0:
                    buf, buf_at = buf[drop:], buf_at + drop
                if len(rows) == mb:
                    nxt = i * L
                    while len(marks) > 1 and marks[1].at <= nxt:
                        marks.popleft()
                    mark = marks[0]
                    ids = np.arange(i - mb, i, dtype=np.int64) * W + r
                    cursor = self._cursor(mark.state, nxt - mark.at, i, step + 1)
                    self.offsets_after.append((step, list(mark.state.next)))
                    yield PlannedBatch(epoch=s.epoch, step=step, ids=ids, cursor=cursor, samples_in_epoch=0,
                                       tokens=np.stack(rows))
                    rows, step = [], step + 1
