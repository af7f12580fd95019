"""Kafka source against the real broker from `make kafka` (no mock): bounded epochs match
DistributedSampler and the equivalent file dataset; follow mode replays exactly across a
feeder SIGKILL and a broker restart; every bad-record kind under both policies."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from feeder_client import FeederDataset
from feeder.core.config import ServeConfig
from feeder.core.errors import FeederError
from feeder.core.sampler import n_samples
from feeder.service.server import ServerThread
from feeder.sources.kafka import encode_record
from tests.helpers import FeederProc, byte_stream, make_docs, prep_docs, reference_ids, sample, write_jsonl

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[1]
BROKER_SCRIPT = ROOT / "deploy" / "kafka" / "broker.py"


def topic_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def publish(broker, docs, tmp_path, topic, partitions=3):
    src = write_jsonl(tmp_path / f"{topic}.jsonl", docs)
    r = subprocess.run([sys.executable, "-m", "feeder.cli", "publish", str(src), "--to", f"kafka://{broker}/{topic}",
                        "--partitions", str(partitions), "--workers", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"published {len(docs)} records to {topic} ({partitions} partitions" in r.stdout
    return topic


def ids_of(batches):
    return [i for b in batches for i in b.sample_ids.tolist()]


@pytest.fixture(scope="module")
def bounded_topic(kafka_broker, tmp_path_factory):
    docs = make_docs(240, seed=11)
    tmp = tmp_path_factory.mktemp("kafka-bounded")
    topic = publish(kafka_broker, docs, tmp, topic_name("bounded"))
    # The equivalent file dataset: the same documents in (partition, offset) order.
    ordered = [docs[i] for p in range(3) for i in range(p, len(docs), 3)]
    prep_docs(tmp, ordered, chunk_tokens=900, shard_tokens=4000)
    return topic, docs, ordered, tmp


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bounded_epoch_is_distributed_sampler_over_the_file_equivalent(kafka_broker, bounded_topic, world):
    topic, docs, ordered, tmp = bounded_topic
    seq_len, seed = 24, 7
    stream = byte_stream(ordered)
    n = n_samples(len(stream), seq_len)
    spool = tmp / f"spool-{world}"
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?spool={spool}", listen="127.0.0.1:0")) as kf, \
            ServerThread(ServeConfig(source=str(tmp / "shards"), listen="127.0.0.1:0")) as ff:
        for rank in range(world):
            common = dict(job=f"b{world}", rank=rank, world_size=world, seq_len=seq_len, micro_batch=4, seed=seed,
                          num_epochs=2)
            from_kafka = list(FeederDataset([kf.address], **common))
            from_files = list(FeederDataset([ff.address], **common))
            want = [i for e in range(2) for i in reference_ids(n, world, rank, shuffle=True, seed=seed,
                                                                 drop_last=False, epoch=e)]
            assert ids_of(from_kafka) == want
            assert ids_of(from_files) == want
            for a, b in zip(from_kafka, from_files):
                assert (a.epoch, a.step) == (b.epoch, b.step)
                np.testing.assert_array_equal(a.tokens.numpy(), b.tokens.numpy())
                for row, i in zip(a.tokens.numpy(), a.sample_ids.tolist()):
                    np.testing.assert_array_equal(row, sample(stream, i, seq_len))


def test_bounded_epoch_is_frozen_and_resumes_on_a_fresh_feeder(kafka_broker, tmp_path):
    """Records produced after the job starts are not in its epoch; a cursor carries the
    offset ranges, so another feeder (empty spool) rebuilds exactly that epoch."""
    docs = make_docs(150, seed=12)
    topic = publish(kafka_broker, docs, tmp_path, topic_name("frozen"))
    ordered = [docs[i] for p in range(3) for i in range(p, len(docs), 3)]
    stream = byte_stream(ordered)
    seq_len, n = 16, n_samples(len(stream), 16)
    url = f"kafka://{kafka_broker}/{topic}"
    with ServerThread(ServeConfig(source=f"{url}?spool={tmp_path / 'a'}", listen="127.0.0.1:0")) as a:
        ds = FeederDataset([a.address], job="frozen", rank=0, world_size=2, seq_len=seq_len, micro_batch=3, seed=1)
        it = iter(ds)
        head = [next(it) for _ in range(10)]
        publish(kafka_broker, make_docs(50, seed=99), tmp_path, topic)      # arrives after the job started
        ds.client.close()
        rank1 = list(FeederDataset([a.address], job="frozen", rank=1, world_size=2, seq_len=seq_len, micro_batch=3,
                                   seed=1))
        assert ids_of(rank1) == reference_ids(n, 2, 1, shuffle=True, seed=1, drop_last=False, epoch=0)
    with ServerThread(ServeConfig(source=f"{url}?spool={tmp_path / 'b'}", listen="127.0.0.1:0")) as b:
        tail = list(FeederDataset([b.address], job="frozen", rank=0, world_size=2, seq_len=seq_len, micro_batch=3,
                                  seed=1, cursor=head[4].cursor))
    got = head[:5] + tail
    assert ids_of(got) == reference_ids(n, 2, 0, shuffle=True, seed=1, drop_last=False, epoch=0)
    for bt in got:
        for row, i in zip(bt.tokens.numpy(), bt.sample_ids.tolist()):
            np.testing.assert_array_equal(row, sample(stream, i, seq_len))


def follow_reference(docs, world, rank):
    """Rank's token stream in follow mode: record k (= document k, as published round-robin)
    goes to rank k mod world; its documents are packed with an EOS after each."""
    return byte_stream([d for k, d in enumerate(docs) if k % world == rank])


def check_follow(batches, docs, world, rank, seq_len):
    mine = follow_reference(docs, world, rank)
    expect_i = 0
    for b in batches:
        for row, gid in zip(b.tokens.numpy(), b.sample_ids.tolist()):
            assert gid % world == rank and gid // world == expect_i, (gid, expect_i)
            np.testing.assert_array_equal(row, sample(mine, expect_i, seq_len))
            expect_i += 1


def samples_available(docs, world, rank, seq_len):
    return n_samples(len(follow_reference(docs, world, rank)), seq_len)


def broker(action):
    subprocess.run([sys.executable, str(BROKER_SCRIPT), action], check=True, timeout=180)


@pytest.mark.kafka_restart
def test_follow_replays_exactly_across_feeder_sigkill_and_broker_restart(kafka_broker, tmp_path):
    world, rank, seq_len, mb = 2, 1, 32, 2
    phase1, phase2 = make_docs(300, seed=21), make_docs(300, seed=22)
    topic = publish(kafka_broker, phase1, tmp_path, topic_name("follow"))
    feeder = FeederProc(None, source=f"kafka://{kafka_broker}/{topic}?mode=follow", extra=["--region", "k1"])
    try:
        ds = FeederDataset([feeder.address], job="follow", rank=rank, world_size=world, seq_len=seq_len,
                           micro_batch=mb, num_epochs=0, read_ahead=2, retry_for_s=120)
        it = iter(ds)
        got = [next(it) for _ in range(40)]
        feeder.signal(signal.SIGKILL)                      # the feeder dies mid-stream ...
        feeder.start()                                     # ... and comes back on the same address
        got += [next(it) for _ in range(20)]

        broker("restart")                                  # the broker goes away and comes back
        publish(kafka_broker, phase2, tmp_path, topic)     # the stream tails what arrives after
        total = samples_available(phase1 + phase2, world, rank, seq_len) // mb
        assert total > 200
        got += [next(it) for _ in range(total - 60 - 5)]
        assert ds.client.failovers >= 1
        ds.client.close()
    finally:
        feeder.stop()
    check_follow(got, phase1 + phase2, world, rank, seq_len)
    assert [b.step for b in got] == list(range(len(got)))


@pytest.mark.parametrize("world", [2, 5])
def test_follow_with_fewer_or_more_ranks_than_partitions(kafka_broker, tmp_path, world):
    docs = make_docs(200, seed=30 + world)
    topic = publish(kafka_broker, docs, tmp_path, topic_name(f"ranks{world}"))
    seq_len, mb = 16, 2
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?mode=follow",
                                  listen="127.0.0.1:0")) as srv:
        for rank in range(world):
            n = samples_available(docs, world, rank, seq_len) // mb
            ds = FeederDataset([srv.address], job=f"r{world}", rank=rank, world_size=world, seq_len=seq_len,
                               micro_batch=mb, num_epochs=0)
            it = iter(ds)
            got = [next(it) for _ in range(n)]
            check_follow(got, docs, world, rank, seq_len)
            # resume this rank from the middle on the same feeder: the same batches again
            again = FeederDataset([srv.address], job=f"r{world}", rank=rank, world_size=world, seq_len=seq_len,
                                  micro_batch=mb, num_epochs=0, cursor=got[n // 2 - 1].cursor)
            it2 = iter(again)
            for want in got[n // 2:]:
                b = next(it2)
                assert b.sample_ids.tolist() == want.sample_ids.tolist()
                np.testing.assert_array_equal(b.tokens.numpy(), want.tokens.numpy())
            ds.client.close()
            again.client.close()


def test_follow_commits_what_every_rank_has_taken_to_a_consumer_group(kafka_broker, tmp_path):
    from confluent_kafka import Consumer, TopicPartition

    docs = make_docs(300, seed=40)
    topic = publish(kafka_broker, docs, tmp_path, topic_name("group"))
    group = f"job-{topic}"
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?mode=follow&group={group}",
                                  listen="127.0.0.1:0")) as srv:
        its = []
        for rank, n in ((0, 30), (1, 20)):
            ds = FeederDataset([srv.address], job="grp", rank=rank, world_size=2, seq_len=32, micro_batch=2,
                               num_epochs=0, read_ahead=1, report_every_s=0.2)
            it = iter(ds)
            for _ in range(n):
                next(it)
            its.append((ds, it))   # keep the generator: dropping it closes the rank's stream
        c = Consumer({"bootstrap.servers": kafka_broker, "group.id": group})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = {tp.partition: tp.offset for tp in c.committed([TopicPartition(topic, p) for p in range(3)],
                                                                 timeout=10)}
            if all(o > 0 for o in got.values()):
                break
            time.sleep(0.3)
        c.close()
        for ds, _ in its:
            ds.client.close()
    # rank 1 took 20 batches of 2 samples of 32 tokens: about 1,300 of its tokens, i.e. its first
    # documents; the group's offsets are at least 1 and below what was published per partition
    assert all(0 < o <= 100 for o in got.values()), got
    assert max(got.values()) - min(got.values()) <= 1   # round-robin: partitions advance together


# --------------------------------------------------------------------------- bad records

GOOD = [np.arange(i, i + 40) % 250 for i in range(0, 200, 40)]   # five documents of 40 tokens


def rec(ids):
    return encode_record(np.asarray(ids), vocab_size=257, eos_id=256, tokenizer="byte")


BAD = {
    "undecodable": lambda: b"\x00\x01 not a record",
    "wrong_dtype": lambda: encode_record(np.arange(10), vocab_size=70_000, eos_id=0, tokenizer="big"),
    "wrong_dtype_json": lambda: json.dumps({"tokens": [1, 2.5, 3]}).encode(),
    "out_of_vocab": lambda: rec([1, 2, 300]),
    "out_of_vocab_negative": lambda: json.dumps({"tokens": [5, -1]}).encode(),
    "empty": lambda: None,
    "too_large": lambda: rec(np.ones(3000, dtype=np.int64)),     # > max_record_bytes=4096
    "aborted_transaction": None,
}


def produce_with_bad(bootstrap, topic, kind):
    """One partition: GOOD[0], GOOD[1], <bad>, GOOD[2], GOOD[3], GOOD[4]."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})  # must outlive its future
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for ids in GOOD[:2]:
        p.produce(topic, rec(ids), partition=0)
    p.flush(30)
    if kind == "aborted_transaction":
        t = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{topic}"})
        t.init_transactions(30)
        t.begin_transaction()
        t.produce(topic, rec([7] * 50), partition=0)
        t.produce(topic, rec([8] * 50), partition=0)
        t.flush(30)
        t.abort_transaction(30)
    else:
        p.produce(topic, BAD[kind](), partition=0)
    for ids in GOOD[2:]:
        p.produce(topic, rec(ids), partition=0)
    assert p.flush(30) == 0


def good_stream():
    return byte_stream_ids(GOOD)


def byte_stream_ids(docs):
    out = []
    for d in docs:
        out.extend(int(x) for x in d)
        out.append(256)
    return np.asarray(out)


@pytest.mark.parametrize("policy", ["skip", "fail"])
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_record_kinds_under_both_policies(kafka_broker, kind, policy):
    topic = topic_name(f"bad-{kind.replace('_', '-')}")
    produce_with_bad(kafka_broker, topic, kind)
    seq_len = 8
    stream = good_stream()
    want = n_samples(len(stream), seq_len)
    invisible = kind == "aborted_transaction"   # read_committed: never seen, so never bad
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?mode=follow&max_record_bytes=4096",
                                  listen="127.0.0.1:0")) as srv:
        ds = FeederDataset([srv.address], job="bad", rank=0, world_size=1, seq_len=seq_len, micro_batch=1,
                           num_epochs=0, bad_records=policy, read_ahead=1)
        it = iter(ds)
        if policy == "skip" or invisible:
            got = [next(it) for _ in range(want)]
            for b in got:  # exactly the good documents, in order
                i = b.sample_ids.item()
                np.testing.assert_array_equal(b.tokens.numpy()[0], sample(stream, i, seq_len))
            assert ids_of(got) == list(range(want))
            time.sleep(0.3)
            from feeder.ops.status import fetch

            rank = fetch(srv.address, "bad").jobs[0].ranks[0]
            assert rank.bad_records == (0 if invisible else 1)
        else:
            before_bad = n_samples(2 * 41, seq_len)   # the samples wholly inside GOOD[0:2] come first
            got = []
            with pytest.raises(FeederError) as e:
                while True:
                    got.append(next(it))
            assert len(got) >= before_bad - 1
            msg = str(e.value)
            assert f"{topic}/0@2" in msg and kind.split("_json")[0].split("_negative")[0] in msg, msg
            assert "bad_records=fail" in msg
        ds.client.close()


def test_bounded_bad_records_skip_counts_and_fail_names_the_record(kafka_broker, tmp_path):
    topic = topic_name("bad-bounded")
    produce_with_bad(kafka_broker, topic, "out_of_vocab")
    stream = good_stream()
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?spool={tmp_path}",
                                  listen="127.0.0.1:0")) as srv:
        got = list(FeederDataset([srv.address], job="bb", rank=0, world_size=1, seq_len=8, micro_batch=2,
                                 shuffle=False, bad_records="skip"))
        assert ids_of(got) == list(range(n_samples(len(stream), 8)))
        for b in got:
            for row, i in zip(b.tokens.numpy(), b.sample_ids.tolist()):
                np.testing.assert_array_equal(row, sample(stream, i, 8))
        from feeder.ops.status import fetch

        assert fetch(srv.address, "bb").jobs[0].ranks[0].bad_records == 1
        with pytest.raises(FeederError) as e:
            list(FeederDataset([srv.address], job="bf", rank=0, world_size=1, seq_len=8, micro_batch=2,
                               bad_records="fail"))
        assert f"bad Kafka record {topic}/0@2: out_of_vocab" in str(e.value)


def test_serve_and_publish_user_errors_are_one_clear_line(kafka_broker, tmp_path):
    def run(*args):
        r = subprocess.run([sys.executable, "-m", "feeder.cli", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        return r.stderr

    assert "unknown Kafka URL option(s) ['colour']" in run("serve", "--source", f"kafka://{kafka_broker}/t?colour=red")
    assert "mode must be bounded or follow" in run("serve", "--source", f"kafka://{kafka_broker}/t?mode=sideways")
    assert "cannot reach Kafka at 127.0.0.1:1" in run("publish", str(write_jsonl(tmp_path / "d.jsonl", ["x"])),
                                                      "--to", "kafka://127.0.0.1:1/t")


def test_kafka_metrics_count_skipped_records_and_export_lag(kafka_broker):
    from tests.test_ops import scrape, value

    topic = topic_name("bad-metrics")
    produce_with_bad(kafka_broker, topic, "undecodable")
    with ServerThread(ServeConfig(source=f"kafka://{kafka_broker}/{topic}?mode=follow&bad_records=skip",
                                  listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")) as srv:
        ds = FeederDataset([srv.address], job="km", rank=0, world_size=1, seq_len=8, micro_batch=1,
                           num_epochs=0, read_ahead=1)
        it = iter(ds)
        for _ in range(n_samples(len(good_stream()), 8)):   # every good sample, past the bad record
            next(it)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = scrape(srv.server.metrics_address)
            if ("feeder_kafka_lag_records", (("job", "km"), ("partition", "0"), ("rank", "0"))) in m:
                break
            time.sleep(0.3)
        assert value(m, "feeder_bad_records_total", job="km", rank=0) == 1
        assert 0 <= value(m, "feeder_kafka_lag_records", job="km", rank=0, partition=0) <= 6
        ds.client.close()
