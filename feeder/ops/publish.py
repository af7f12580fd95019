"""`feeder publish`: documents -> tokenized records on a Kafka topic, one per document.

Same inputs and tokenizers as `feeder prep`. Document i goes to partition i mod P, so the
follow mode's round-robin interleave reads documents back in input order. The producer is
idempotent (no duplicates when it retries) and batches and compresses (zstd).
"""
from __future__ import annotations

import logging

import numpy as np

from feeder.ops import tokenizer
from feeder.core.tool_config import PublishConfig
from feeder.core.errors import InvalidArgument, Unavailable
from feeder.ops.prep import input_kind, tokenized
from feeder.core.progress import Progress
from feeder.sources.kafka.codec import encode_record
from feeder.sources.kafka.options import KafkaURL

log = logging.getLogger("feeder.publish")


def ensure_topic(bootstrap: str, topic: str, partitions: int) -> int:
    """The topic's partition count, creating the topic when it is missing."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.connection.setup.timeout.ms": 5000,
                         "logger": logging.getLogger("feeder.kafka.librdkafka")})
    try:
        md = admin.list_topics(timeout=10)
    except KafkaException as e:
        raise Unavailable(f"cannot reach Kafka at {bootstrap} ({e.args[0].str() if e.args else e}); is the "
                          "broker running? (`make kafka` starts one on 127.0.0.1:9092)") from None
    t = md.topics.get(topic)
    if t is not None and t.error is None:
        have = len(t.partitions)
        if partitions and partitions != have:
            raise InvalidArgument(f"topic {topic!r} exists with {have} partitions, --partitions asks for "
                                  f"{partitions}; leave --partitions out to use the topic as it is")
        return have
    want = partitions or 3
    replication = min(3, len(md.brokers))
    fut = admin.create_topics([NewTopic(topic, num_partitions=want, replication_factor=replication)])[topic]
    try:
        fut.result(30)
    except KafkaException as e:
        if e.args[0].code() != 36:  # TOPIC_ALREADY_EXISTS: a concurrent publisher made it
            raise Unavailable(f"cannot create topic {topic!r} at {bootstrap}: {e.args[0].str()}") from None
    log.info("created topic %s with %d partitions (replication %d)", topic, want, replication)
    return want


def publish(cfg: PublishConfig) -> dict:
    from confluent_kafka import KafkaException, Producer

    import os

    for path in cfg.inputs:
        input_kind(path)  # a missing or unknown file fails before anything is produced
    url = KafkaURL.parse(cfg.to)
    tok = tokenizer.load(cfg.tokenizer, cfg.eos_token)
    name = cfg.tokenizer if cfg.tokenizer == "byte" else f"hf:{tok.identity()['sha256'][:16]}"
    n_parts = ensure_topic(url.bootstrap, url.topic, cfg.partitions)
    failed: list[str] = []

    def delivered(err, msg):
        if err is not None:
            failed.append(f"{msg.topic()}/{msg.partition()}: {err.str()}")

    producer = Producer({
        "bootstrap.servers": url.bootstrap,
        "enable.idempotence": True,       # acks=all, ordered, no duplicates on retry
        "compression.type": "zstd",
        "linger.ms": 20,
        "batch.size": 1 << 20,
        "message.max.bytes": 16 << 20,
        "queue.buffering.max.kbytes": 256 << 10,
        "message.timeout.ms": 120_000,
        "logger": logging.getLogger("feeder.kafka.librdkafka"),
    })
    progress = Progress("publish", sum(os.path.getsize(p) for p in cfg.inputs), enabled=cfg.progress)
    i = 0
    try:
        for tokens, lengths, nbytes in tokenized(cfg.inputs, cfg.tokenizer, cfg.eos_token, workers=cfg.workers,
                                                 batch_docs=cfg.batch_docs):
            ends = np.cumsum(lengths)
            for end, length in zip(ends.tolist(), lengths.tolist()):
                doc = tokens[end - length:end - 1]          # without its EOS: the feeder adds one
                value = encode_record(doc, vocab_size=tok.vocab_size, eos_id=tok.eos_id, tokenizer=name)
                kw = {"key": str(i).encode()} if cfg.key == "index" else {"partition": i % n_parts}
                while True:
                    try:
                        producer.produce(url.topic, value, on_delivery=delivered, **kw)
                        break
                    except BufferError:  # the local queue is full: let deliveries drain it
                        producer.poll(0.1)
                producer.poll(0)
                i += 1
            progress.advance(docs=len(lengths), tokens=int(lengths.sum() - len(lengths)), nbytes=nbytes)
            if failed:
                break
        left = producer.flush(120)
    except KafkaException as e:
        raise Unavailable(f"publishing to {cfg.to} failed: {e}") from None
    finally:
        progress.close()
    if failed or left:
        raise Unavailable(f"{len(failed) + left} of {i} records were not delivered to {cfg.to}"
                          + (f"; first error: {failed[0]}" if failed else " within 120s"))
    return {"records": i, "partitions": n_parts, "topic": url.topic, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id}
