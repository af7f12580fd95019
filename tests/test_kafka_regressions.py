"""Regressions from the Kafka audit (issue 16, finding 5), against the real broker and real
feeders: hostile records are bad records (never INTERNAL), a truncated FTK1 header is not an
empty document, and a bounded resume of a deleted topic is NOT_FOUND/DATA_LOSS at once."""
from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest

from client import FeederDataset
from feeder.config import ServeConfig
from feeder.errors import Code, FeederError
from feeder.sampler import n_samples
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
                from feeder.status import fetch

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
