"""Regressions from the Kafka audit (issue 16, finding 5), against the real broker and real
feeders: hostile records are bad records (never INTERNAL), a truncated FTK1 header is not an
empty document, and a bounded resume of a deleted topic is NOT_FOUND/DATA_LOSS at once."""
from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest

from feeder_client import FeederDataset
from feeder.core.config import ServeConfig
from feeder.core.errors import Code, FeederError
from feeder.core.sampler import n_samples
from feeder.service.server import ServerThread
from feeder.sources.kafka import MAGIC, BadRecord, decode_record
from tests.helpers import sample
from tests.test_kafka import GOOD, good_stream, ids_of, rec, topic_name

pytestmark = pytest.mark.kafka

SEQ = 8


def produce_around(bootstrap: str, topic: str, bad: bytes | None, partitions: int = 1) -> None:
    """One partition: GOOD[0], GOOD[1], <bad>, GOOD[2], GOOD[3], GOOD[4] (the bad one at offset 2)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for value in [rec(GOOD[0]), rec(GOOD[1]), bad, *(rec(g) for g in GOOD[2:])]:
        p.produce(topic, value, partition=0)
    assert p.flush(30) == 0


# Hostile JSON records, and the kind each must be reported as. Before the fix the first three
# raised OverflowError / RecursionError out of decode_record.
HOSTILE_JSON = {
    "overflow": (b'{"tokens": [1, 100000000000000000000000]}', "out_of_vocab"),
    "overflow_negative": (b'{"tokens": [1, -100000000000000000000000]}', "out_of_vocab"),
    "deep_nesting": (b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "undecodable"),
    "huge_digits": (b'{"tokens": [1, ' + b"9" * 5000 + b"]}", "undecodable"),
    "negative": (b'{"tokens": [5, -1]}', "out_of_vocab"),
    "float": (b'{"tokens": [1, 2.0]}', "wrong_dtype"),
    "nan": (b'{"tokens": [1, NaN]}', "wrong_dtype"),
    "nested_list": (b'{"tokens": [1, [2]]}', "wrong_dtype"),
    "string": (b'{"tokens": [1, "2"]}', "wrong_dtype"),
    "bool": (b'{"tokens": [1, true]}', "wrong_dtype"),
    "null_tokens": (b'{"tokens": null}', "undecodable"),
    "not_an_object": (b' [1, 2, 3]', "undecodable"),
    "huge_list_out_of_vocab": (json.dumps({"tokens": [1] * 200_000 + [257]}).encode(), "out_of_vocab"),
}

# An FTK1 header whose tokenizer-name length (200) runs past the end of a 20-byte record.
TRUNCATED_FTK1 = struct.pack("<4sBBII", MAGIC, 2, 200, 257, 256) + b"ab\x01\x00\x02\x00"


@pytest.mark.parametrize("name", list(HOSTILE_JSON))
def test_regression_every_hostile_json_record_is_a_bad_record_of_its_kind(name):
    value, kind = HOSTILE_JSON[name]
    with pytest.raises(BadRecord) as e:
        decode_record(value, dtype=np.dtype("uint16"), vocab_size=257, max_bytes=16 << 20)
    assert e.value.kind == kind, e.value


def test_regression_ftk1_header_running_past_the_record_is_undecodable_not_empty():
    with pytest.raises(BadRecord) as e:
        decode_record(TRUNCATED_FTK1, dtype=np.dtype("uint16"), vocab_size=257, max_bytes=1 << 20)
    assert e.value.kind == "undecodable" and "runs past the end" in e.value.detail


def _serve_with_bad(kafka_broker, tmp_path, bad: bytes, mode: str, policy: str, kind: str):
    topic = topic_name(f"hostile-{mode}")
    produce_around(kafka_broker, topic, bad)
    stream = good_stream()
    want = n_samples(len(stream), SEQ)
    url = f"kafka://{kafka_broker}/{topic}?mode={mode}&vocab_size=257&eos_id=256&spool={tmp_path}"
    with ServerThread(ServeConfig(source=url, listen="127.0.0.1:0")) as srv:
        # retry_for_s is short so that an INTERNAL/UNKNOWN (retried by clients) fails the test quickly.
        job = f"h-{mode}-{policy}"
        ds = FeederDataset([srv.address], job=job, rank=0, world_size=1, seq_len=SEQ,
                           micro_batch=1, shuffle=False, num_epochs=0 if mode == "follow" else 1,
                           bad_records=policy, read_ahead=1, retry_for_s=5)
        it = iter(ds)
        try:
            if policy == "skip":
                got = [next(it) for _ in range(want)]
                assert ids_of(got) == list(range(want))
                for b in got:   # exactly the good documents, in order: the bad one is skipped
                    np.testing.assert_array_equal(b.tokens.numpy()[0], sample(stream, b.sample_ids.item(), SEQ))
                from feeder.ops.status import fetch

                deadline = time.monotonic() + 5
                while fetch(srv.address, job).jobs[0].ranks[0].bad_records != 1:
                    assert time.monotonic() < deadline, "the skipped record was not counted"
                    time.sleep(0.2)
            else:
                with pytest.raises(FeederError) as e:
                    while True:
                        next(it)
                assert e.value.code == Code.DATA_LOSS, e.value
                msg = str(e.value)
                assert f"bad Kafka record {topic}/0@2: {kind}" in msg and "bad_records=fail" in msg, msg
        finally:
            ds.client.close()


@pytest.mark.parametrize("mode", ["bounded", "follow"])
@pytest.mark.parametrize("policy", ["fail", "skip"])
@pytest.mark.parametrize("name", ["overflow", "deep_nesting"])
def test_regression_hostile_json_record_is_data_loss_or_skipped_not_internal(kafka_broker, tmp_path, name, mode,
                                                                            policy):
    value, kind = HOSTILE_JSON[name]
    _serve_with_bad(kafka_broker, tmp_path, value, mode, policy, kind)


@pytest.mark.parametrize("mode", ["bounded", "follow"])
@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_regression_truncated_ftk1_header_is_a_bad_record_not_an_empty_document(kafka_broker, tmp_path, mode,
                                                                                policy):
    _serve_with_bad(kafka_broker, tmp_path, TRUNCATED_FTK1, mode, policy, "undecodable")


def test_regression_bounded_resume_of_a_deleted_topic_is_not_found_then_data_loss(kafka_broker, tmp_path):
    """A cursor of a topic deleted since: NOT_FOUND at once; the topic created again with
    fewer records: DATA_LOSS at once (the epoch's offsets are gone). Before: UNAVAILABLE,
    retried for minutes."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = topic_name("deleted")
    produce_around(kafka_broker, topic, rec(np.arange(30)))
    url = f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256"
    common = dict(job="gone", rank=0, world_size=1, seq_len=SEQ, micro_batch=1, shuffle=False, read_ahead=1)
    with ServerThread(ServeConfig(source=f"{url}&spool={tmp_path / 'a'}", listen="127.0.0.1:0")) as a:
        ds = FeederDataset([a.address], **common)
        it = iter(ds)
        cursor = [next(it) for _ in range(3)][-1].cursor
        ds.client.close()

    admin = AdminClient({"bootstrap.servers": kafka_broker})
    admin.delete_topics([topic])[topic].result(30)
    deadline = time.monotonic() + 30
    while topic in admin.list_topics(timeout=10).topics:
        assert time.monotonic() < deadline
        time.sleep(0.2)

    def resume(spool):
        with ServerThread(ServeConfig(source=f"{url}&spool={tmp_path / spool}", listen="127.0.0.1:0")) as b:
            t0 = time.monotonic()
            with pytest.raises(FeederError) as e:
                list(FeederDataset([b.address], cursor=cursor, retry_for_s=60, **common))
            return e.value, time.monotonic() - t0

    err, took = resume("b")
    assert err.code == Code.NOT_FOUND and f"Kafka topic {topic!r} does not exist" in str(err), err
    assert took < 15, took

    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": kafka_broker})
    p.produce(topic, rec(GOOD[0]), partition=0)
    assert p.flush(30) == 0
    err, took = resume("c")
    assert err.code == Code.DATA_LOSS and f"{topic}/0" in str(err) and "cannot be read again" in str(err), err
    assert took < 15, took


# --------------------------------------------------------------------------- one epoch per job (bounded)

EPOCH_SEQ, EPOCH_MB, EPOCH_SEED = 16, 4, 3


class Trickle:
    """A producer writing byte-token records round-robin over the partitions, `n0` at once and
    then one every few milliseconds until stopped: the topic grows while ranks open. With
    `trickle=False` it writes the n0 and nothing more (a test that needs exactly n0: a thread
    started and stopped at once may still write one, issue 34's flaky test)."""

    def __init__(self, bootstrap: str, topic: str, *, partitions: int = 3, n0: int = 90, trickle: bool = True):
        import threading

        from confluent_kafka import Producer
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)
        self.topic, self.partitions, self.k = topic, partitions, 0
        self.p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 0})
        for _ in range(n0):
            self.one()
        assert self.p.flush(30) == 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if trickle:
            self._thread.start()

    def one(self) -> None:
        rng = np.random.default_rng(self.k)
        self.p.produce(self.topic, rec(rng.integers(0, 256, size=int(rng.integers(0, 60)))),
                       partition=self.k % self.partitions)
        self.k += 1

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.one()
            self.p.poll(0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
            assert not self._thread.is_alive(), "the producer thread did not stop"
        assert self.p.flush(30) == 0


def epoch_of(batch) -> str:
    """The offset ranges a batch's cursor carries (the epoch the feeder served it from)."""
    from feeder.core.cursor import DEV_SECRET, Cursor

    return Cursor.decode(batch.cursor, DEV_SECRET).src.ranges


def epoch_stream(bootstrap: str, ranges: str) -> np.ndarray:
    """The packed stream of an epoch, read here without the feeder: records of each
    partition's [lo, hi) in (partition, offset) order, an EOS (256) after each."""
    from confluent_kafka import Consumer, TopicPartition

    from feeder.sources.kafka import parse_ranges

    topic, spans = parse_ranges(ranges)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "t", "enable.auto.commit": False})
    out: list[int] = []
    for p, lo, hi in spans:
        c.assign([TopicPartition(topic, p, lo)])
        got = 0
        while got < hi - lo:
            for m in c.consume(hi - lo - got, timeout=5):   # returns once that many have come
                if m.error() is None and lo <= m.offset() < hi:
                    out.extend(int(x) for x in decode_record(m.value(), dtype=np.dtype("uint16"), vocab_size=257,
                                                             max_bytes=1 << 20))
                    out.append(256)
                    got += 1
    c.close()
    return np.asarray(out)


def check_one_epoch(bootstrap: str, by_rank: dict[int, list], world: int) -> str:
    """Every batch of every rank comes from one epoch, and the ranks' ids are exactly
    DistributedSampler's over it (their union is every sample, nothing twice beyond padding)."""
    epochs = {r: {epoch_of(b) for b in bs} for r, bs in by_rank.items()}
    assert all(len(e) == 1 for e in epochs.values()), epochs
    union = set.union(*epochs.values())
    assert len(union) == 1, f"the ranks read different epochs: {epochs}"
    (ranges,) = union
    stream = epoch_stream(bootstrap, ranges)
    n = n_samples(len(stream), EPOCH_SEQ)
    for r, bs in by_rank.items():
        from tests.helpers import check_batches, reference_ids

        check_batches(bs, stream, EPOCH_SEQ, reference_ids(n, world, r, shuffle=True, seed=EPOCH_SEED,
                                                           drop_last=False, epoch=0))
    every = [i for bs in by_rank.values() for i in ids_of(bs)]
    assert set(every) == set(range(n)) and len(every) - n == (-n) % world
    return ranges


def grew_after(ranges: str, trickle: Trickle) -> None:
    """The topic got records after the epoch was frozen, while the ranks were opening: what
    makes reading two epochs possible, so the test would see it."""
    from feeder.sources.kafka import parse_ranges

    assert sum(hi - lo for _, lo, hi in parse_ranges(ranges)[1]) < trickle.k - 30, (ranges, trickle.k)


def open_rank(targets, job, rank, world=2, **kw):
    ds = FeederDataset(targets, job=job, rank=rank, world_size=world, seq_len=EPOCH_SEQ, micro_batch=EPOCH_MB,
                       seed=EPOCH_SEED, read_ahead=1, retry_for_s=30, **kw)
    it = iter(ds)
    return ds, it, [next(it)]


def kafka_url(bootstrap, topic, spool, extra=""):
    return f"kafka://{bootstrap}/{topic}?vocab_size=257&eos_id=256&spool={spool}{extra}"


def test_regression_ranks_on_two_feeder_processes_read_one_epoch(kafka_broker, tmp_path):
    """Rank 0 on feeder A, rank 1 on feeder B a second later, while a producer writes: before,
    each process froze its own epoch and ~500 ids went to both ranks."""
    from tests.helpers import FeederProc

    topic = topic_name("one-epoch")
    trickle = Trickle(kafka_broker, topic)
    a = FeederProc(None, source=kafka_url(kafka_broker, topic, tmp_path / "a"))
    b = FeederProc(None, source=kafka_url(kafka_broker, topic, tmp_path / "b"))
    try:
        ds0, it0, got0 = open_rank([a.address], "two-feeders", 0)
        time.sleep(1.0)
        ds1, it1, got1 = open_rank([b.address], "two-feeders", 1)
        trickle.stop()
        got0 += list(it0)
        got1 += list(it1)
        ds0.client.close()
        ds1.client.close()
    finally:
        trickle.stop()
        a.stop()
        b.stop()
    grew_after(check_one_epoch(kafka_broker, {0: got0, 1: got1}, 2), trickle)


def test_regression_ranks_on_serve_processes_2_read_one_epoch(kafka_broker, tmp_path):
    """`feeder serve --processes 2`: rank 1's stream is opened again until the kernel hands it
    to the other process than rank 0's (the log says which); both read one epoch."""
    import re

    from tests.test_processes import Supervised

    topic = topic_name("one-epoch-procs")
    trickle = Trickle(kafka_broker, topic)
    sup = Supervised(kafka_url(kafka_broker, topic, tmp_path / "spool"), tmp_path / "feeder.log")
    job = "two-processes"

    def served_by(rank):
        opened = re.findall(rf"\[process (\d)\] feeder\.engine: stream opened job={job} rank={rank}/2",
                            open(sup.log.name).read())
        return opened[-1] if opened else None

    try:
        ds0, it0, got0 = open_rank([sup.address], job, 0)
        p0 = served_by(0)
        assert p0 is not None
        for _ in range(40):
            time.sleep(0.2)
            ds1, it1, got1 = open_rank([sup.address], job, 1)
            if served_by(1) != p0:
                break
            ds1.client.close()
        assert served_by(1) != p0, "the kernel never handed rank 1 to the other process"
        trickle.stop()
        got0 += list(it0)
        got1 += list(it1)
        ds0.client.close()
        ds1.client.close()
    finally:
        trickle.stop()
        sup.stop()
    grew_after(check_one_epoch(kafka_broker, {0: got0, 1: got1}, 2), trickle)
    # ... from one snapshot, built by one of the two processes (their spool directory is shared)
    built = re.findall(r"feeder\.kafka: kafka epoch \S+: \d+ documents, .* read in", open(sup.log.name).read())
    assert len(built) == 1, built


def test_regression_rank_failing_over_before_its_first_batch_reads_the_jobs_epoch(kafka_broker, tmp_path):
    """Rank 1's first feeder is down, so it fails over to its second with no cursor (before its
    first batch), after more records arrived: it must still read the epoch rank 0 read on the
    first. Before, the second feeder froze its own, later epoch."""
    from tests.helpers import FeederProc

    topic = topic_name("one-epoch-failover")
    trickle = Trickle(kafka_broker, topic)
    a = FeederProc(None, source=kafka_url(kafka_broker, topic, tmp_path / "a"))
    b = FeederProc(None, source=kafka_url(kafka_broker, topic, tmp_path / "b"))
    try:
        ds0, it0, got0 = open_rank([a.address, b.address], "failover", 0)
        got0 += list(it0)
        ds0.client.close()
        time.sleep(0.5)
        a.stop()
        ds1, it1, got1 = open_rank([a.address, b.address], "failover", 1, prefer="order")   # A first
        trickle.stop()
        got1 += list(it1)
        assert ds1.client.failovers >= 1
        ds1.client.close()
    finally:
        trickle.stop()
        a.stop()
        b.stop()
    grew_after(check_one_epoch(kafka_broker, {0: got0, 1: got1}, 2), trickle)


def test_regression_job_name_reused_after_the_job_was_forgotten_gets_a_new_epoch(kafka_broker, tmp_path):
    """epoch_ttl_s=4: a run of the job right after the last one ended still reads its epoch (the
    entry is live); once no stream of it was open for the TTL, the name starts a new epoch with
    what the topic holds now. Before, the first epoch was kept for the process's lifetime."""
    topic = topic_name("reuse")
    trickle = Trickle(kafka_broker, topic, n0=60, trickle=False)   # exactly 60: the epoch is 0-20 per partition
    trickle.stop()
    url = kafka_url(kafka_broker, topic, tmp_path / "spool", "&epoch_ttl_s=4")
    with ServerThread(ServeConfig(source=url, listen="127.0.0.1:0")) as srv:
        def run():
            ds, it, got = open_rank([srv.address], "reuse", 0, world=1)
            got += list(it)
            ds.client.close()
            return got

        first = run()
        for _ in range(30):
            trickle.one()
        assert trickle.p.flush(30) == 0
        again = run()                              # within the TTL: the same run (e.g. a restart)
        time.sleep(5)                              # no stream of the job for longer than the TTL
        later = run()
    r1 = check_one_epoch(kafka_broker, {0: first}, 1)
    assert check_one_epoch(kafka_broker, {0: again}, 1) == r1
    r2 = check_one_epoch(kafka_broker, {0: later}, 1)
    assert r1 == f"kafka:{topic}:0=0-20,1=0-20,2=0-20"
    assert r2 == f"kafka:{topic}:0=0-30,1=0-30,2=0-30"


class _Rec:
    """A register record as confluent_kafka hands it over (value, broker timestamp, offset)."""

    def __init__(self, offset, at_ms, value):
        self._o, self._t, self._v = offset, at_ms, value

    def value(self):
        return self._v if isinstance(self._v, bytes) else json.dumps(self._v).encode()

    def timestamp(self):
        return 2, self._t

    def offset(self):
        return self._o


def test_epoch_register_first_record_after_a_gap_wins_and_later_ones_only_refresh():
    """The rule every feeder applies to the register in log order (module doc of kafka.py)."""
    from feeder.sources.kafka import EpochRegister

    reg = EpochRegister("unused:9092", "t", ttl_s=10)
    A, B, C = "kafka:t:0=0-5", "kafka:t:0=0-9", "kafka:t:0=0-12"
    log = [
        {"topic": "t", "job": "j", "ranges": A, "ttl_ms": 10_000},       # establishes A
        {"topic": "t", "job": "j", "ranges": B, "ttl_ms": 10_000},       # a racing proposal: refresh only
        {"topic": "other", "job": "j", "ranges": "kafka:other:0=0-1", "ttl_ms": 10_000},   # another topic's
        b"not json",                                                      # junk: skipped by everyone
        {"topic": "t", "job": "j", "ranges": "kafka:u:0=0-1", "ttl_ms": 10_000},           # wrong topic inside
        {"topic": "t", "job": "j", "ranges": B, "ttl_ms": 10_000},       # refresh at 9 s
        {"topic": "t", "job": "j", "ranges": C, "ttl_ms": 10_000},       # 10.0 s after: still A's (not > ttl)
        {"topic": "t", "job": "j", "ranges": C, "ttl_ms": 10_000},       # 10.001 s after the last: C establishes
    ]
    times = [0, 5, 6, 7, 8, 9_000, 19_000, 29_001]
    seen = []
    for i, (v, at) in enumerate(zip(log, times)):
        reg._apply(_Rec(i, at, v))
        seen.append(reg._entries["j"].ranges)
    assert seen == [A, A, A, A, A, A, A, C]


def test_epoch_ttl_option_must_be_a_positive_number():
    from feeder.core.errors import InvalidArgument
    from feeder.sources.kafka import KafkaURL

    assert KafkaURL.parse("kafka://h:1/t?epoch_ttl_s=2.5").epoch_ttl_s == 2.5
    assert KafkaURL.parse("kafka://h:1/t").epoch_ttl_s == 24 * 3600
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(InvalidArgument, match="epoch_ttl_s must be"):
            KafkaURL.parse(f"kafka://h:1/t?epoch_ttl_s={bad}")


def test_review_a_partition_of_empty_documents_only_is_served(kafka_broker, tmp_path):
    """Found by the outside review of issue 26: a bounded topic one of whose partitions holds only
    empty documents (valid records, each a lone EOS) failed every build ("cannot mmap an empty
    file"), alone and in a mixture; the epoch is now served whole."""
    from tests.helpers import byte_stream
    from tests.test_kafka import publish

    docs = [f"document {i} " * (1 + i % 5) if i % 2 == 0 else "" for i in range(40)]
    topic = publish(kafka_broker, docs, tmp_path, topic_name("empty-docs"), partitions=2)
    stream = byte_stream([docs[i] for p in range(2) for i in range(p, len(docs), 2)])   # partition order
    url = f"kafka://{kafka_broker}/{topic}?mode=bounded&spool={tmp_path / 'spool'}"
    with ServerThread(ServeConfig(source=url, listen="127.0.0.1:0")) as srv:
        ds = FeederDataset([srv.address], job="empty-docs", rank=0, world_size=1, seq_len=SEQ, micro_batch=4,
                           shuffle=False, num_epochs=1, retry_for_s=20)
        got = list(ds)
    assert ids_of(got) == list(range(n_samples(len(stream), SEQ)))
    for b in got:
        for row, i in zip(b.tokens.numpy(), b.sample_ids.tolist()):
            np.testing.assert_array_equal(row, sample(stream, i, SEQ))


def test_review_a_followed_topic_whose_producers_pause_holds_the_stream(kafka_broker, tmp_path):
    """Found by the outside review of issue 26: when a followed topic had nothing new, the feeder
    sent nothing, so the rank dropped the stream at every idle timeout and raised UNAVAILABLE
    after retry_for_s (about 5 minutes with the defaults), though the docs say the stream holds.
    The stream now tells the rank why it waits; after a pause longer than both the rank goes on."""
    from tests.helpers import make_docs
    from tests.test_kafka import check_follow, publish, samples_available

    docs = make_docs(60, seed=77)
    topic = publish(kafka_broker, docs, tmp_path, topic_name("quiet"), partitions=1)
    more = make_docs(60, seed=78)
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?mode=follow",
                                  listen="127.0.0.1:0")) as srv:
        ds = FeederDataset([srv.address], job="quiet", rank=0, world_size=1, seq_len=SEQ, micro_batch=2,
                           num_epochs=0, idle_timeout_s=2.5, retry_for_s=3, read_ahead=1)
        it = iter(ds)
        first = (samples_available(docs, 1, 0, SEQ) - 1) // 2
        got = [next(it) for _ in range(first)]
        time.sleep(7)                                   # producers quiet past both timeouts
        publish(kafka_broker, more, tmp_path, topic, partitions=1)
        got += [next(it) for _ in range(20)]
        ds.client.close()
    check_follow(got, docs + more, 1, 0, SEQ)


def test_review_a_topic_deleted_and_created_again_is_not_served_from_what_was_read_of_the_old(
        kafka_broker, tmp_path):
    """Found by the outside review of issue 26: a topic deleted and published again with other
    documents, the same number per partition, was served to new jobs from the old topic's
    snapshot (bounded: same offset ranges, same key) and from the old follow window (same
    partitions). Snapshots and windows are now of the topic's Kafka id as well as its name."""
    from confluent_kafka.admin import AdminClient

    from tests.helpers import byte_stream, make_docs
    from tests.test_kafka import follow_reference, publish

    topic = topic_name("recreated")
    old, new = make_docs(30, seed=91), make_docs(30, seed=92)
    in_order = lambda docs: [docs[i] for p in range(3) for i in range(p, len(docs), 3)]   # noqa: E731
    publish(kafka_broker, old, tmp_path, topic)
    bounded = f"b=kafka://{kafka_broker}/{topic}?mode=bounded&spool={tmp_path / 'spool'}"
    follow = f"f=kafka://{kafka_broker}/{topic}?mode=follow"
    with ServerThread(ServeConfig(sources=(tuple(bounded.split("=", 1)), tuple(follow.split("=", 1))),
                                  listen="127.0.0.1:0")) as srv:
        def first(job, dataset, **kw):
            ds = FeederDataset([srv.address], job=job, rank=0, world_size=1, seq_len=SEQ, micro_batch=4,
                               shuffle=False, dataset=dataset, retry_for_s=20, **kw)
            b = next(iter(ds))
            ds.client.close()
            return b.tokens.numpy()

        def want(docs, follow_mode):
            stream = np.asarray(follow_reference(docs, 1, 0) if follow_mode else byte_stream(in_order(docs)))
            return np.stack([sample(stream, i, SEQ) for i in range(4)])

        np.testing.assert_array_equal(first("old-b", "b", num_epochs=1), want(old, False))
        np.testing.assert_array_equal(first("old-f", "f", num_epochs=0), want(old, True))
        admin = AdminClient({"bootstrap.servers": kafka_broker})
        admin.delete_topics([topic])[topic].result(30)
        for _ in range(100):   # (the broker forgets a deleted topic a moment later)
            if topic not in admin.list_topics(timeout=10).topics:
                break
            time.sleep(0.1)
        publish(kafka_broker, new, tmp_path, topic)
        np.testing.assert_array_equal(first("new-b", "b", num_epochs=1), want(new, False))
        np.testing.assert_array_equal(first("new-f", "f", num_epochs=0), want(new, True))
