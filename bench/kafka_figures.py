"""The Kafka figures: the feeder's Kafka source against a bare confluent-kafka consume() loop,
both reading the same topic from its start, in this process."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .config import BenchConfig

PARTITIONS = 3


def kafka_figures(cfg: BenchConfig, data: dict) -> dict:
    """Kafka source (follow mode's reader, packing and batching) vs a bare consume() loop."""
    from feeder.publish import ensure_topic

    topic = f"bench-{int(time.time())}"
    ensure_topic(cfg.kafka, topic, PARTITIONS)
    produced, docs = _produce(cfg, data, topic)
    # the first read may warm the broker's page cache
    bare = max(_bare_consume(cfg, data, topic, docs), _bare_consume(cfg, data, topic, docs))
    source = _source_tokens_s(cfg, data, topic, target=produced + docs - 2 * cfg.seq_len * cfg.micro_batch)
    return {"kafka_topic": topic, "kafka_records": docs, "kafka_bare_consume_tokens_s": bare,
            "kafka_source_tokens_s": source, "kafka_ratio": source / bare}


def _produce(cfg: BenchConfig, data: dict, topic: str) -> tuple[int, int]:
    """The prepared shards' documents as records, round-robin over the partitions, until a
    few million tokens: (tokens produced, records)."""
    import pyarrow as pa
    from confluent_kafka import Producer

    from feeder.sources.kafka import encode_record

    p = Producer({"bootstrap.servers": cfg.kafka, "enable.idempotence": True, "compression.type": "zstd",
                  "linger.ms": 20, "batch.size": 1 << 20, "queue.buffering.max.kbytes": 512 << 10})
    limit = 4_000_000 if cfg.quick else 24_000_000
    produced = docs = 0
    for path in sorted(Path(data["shards"]).glob("shard-*.arrow")):
        with pa.memory_map(str(path)) as f:
            reader = pa.ipc.open_file(f)
            for b in range(reader.num_record_batches):
                col = reader.get_batch(b).column(0)
                offsets = col.offsets.to_numpy()
                values = col.values.to_numpy()
                for k in range(len(col)):
                    ids = values[offsets[k]:offsets[k + 1] - 1]   # stored with EOS; records are without
                    while True:
                        try:
                            p.produce(topic, encode_record(ids, vocab_size=data["vocab_size"], eos_id=0,
                                                           tokenizer="bench"), partition=docs % PARTITIONS)
                            break
                        except BufferError:
                            p.poll(0.1)
                    produced += len(ids)
                    docs += 1
                    if produced >= limit:
                        break
                if produced >= limit:
                    break
        if produced >= limit:
            break
    p.flush(60)
    # docs is a multiple of 3 minus at most 2: round-robin over partitions never waits at the end
    return produced, docs


def _bare_consume(cfg: BenchConfig, data: dict, topic: str, docs: int) -> float:
    """Tokens/s of a bare consume() loop reading every record of the topic."""
    from confluent_kafka import Consumer, TopicPartition

    from feeder.sources.kafka import consumer_config, encode_record

    header = len(encode_record(np.zeros(0, dtype=np.int64), vocab_size=data["vocab_size"], eos_id=0,
                               tokenizer="bench"))
    c = Consumer(consumer_config(cfg.kafka))
    c.assign([TopicPartition(topic, q, 0) for q in range(PARTITIONS)])
    got = n = 0
    t0 = time.monotonic()
    while n < docs:
        for m in c.consume(1000, timeout=0.2):   # as the source's reader does
            if m.error() is None:
                got += (len(m.value()) - header) // 2
                n += 1
    rate = got / (time.monotonic() - t0)
    c.close()
    return rate


def _source_tokens_s(cfg: BenchConfig, data: dict, topic: str, target: int) -> float:
    """Tokens/s of the feeder's Kafka source in follow mode, batched and framed as a feeder
    does, until `target` tokens (all but the last, partial batches)."""
    from feeder.config import StreamSpec
    from feeder.cursor import CursorWriter
    from feeder.pipeline.batcher import block_from_runs
    from feeder.planning import PENDING
    from feeder.service.wire import encode_reply
    from feeder.sources.kafka import FollowPlan, KafkaSource, KafkaURL

    src = KafkaSource(KafkaURL.parse(f"kafka://{cfg.kafka}/{topic}?mode=follow&vocab_size={data['vocab_size']}"
                                     f"&eos_id=0"))
    spec = StreamSpec(job="bench", rank=0, world_size=1, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch,
                      num_epochs=0, compression="none")
    plan = FollowPlan(src, spec, None, "fail")
    cursors = CursorWriter(plan.cursor_template(), b"")
    tokens, t0 = 0, time.monotonic()
    for run in plan.runs():
        if run is PENDING:
            if tokens >= 0.95 * target:
                break
            continue
        b = block_from_runs(plan, [run], seq_len=cfg.seq_len, compression="none", level=0, cursors=cursors)
        encode_reply(b, "")   # what a feeder does with it, framing included
        tokens += b.n_tokens
        if tokens >= target:
            break
    source = tokens / (time.monotonic() - t0)
    plan.close()
    src.close()
    return source
