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
    from feeder.ops.publish import ensure_topic

    topic = f"bench-{int(time.time())}"
    ensure_topic(cfg.kafka, topic, PARTITIONS)
    produced, docs = _produce(cfg, data, topic)
    # the first read may warm the broker's page cache
    bare = max(_bare_consume(cfg, data, topic, docs), _bare_consume(cfg, data, topic, docs))
    source = _source_tokens_s(cfg, data, topic, target=produced + docs - 2 * cfg.seq_len * cfg.micro_batch)
    # Issue 26's figures, on a topic of records of 200-1200 tokens (a few million tokens)
    cut = f"bench-cut-{int(time.time())}"
    ensure_topic(cfg.kafka, cut, PARTITIONS)
    lengths = _produce_cut(cfg, data, cut)
    cut_bare = max(_bare_consume(cfg, data, cut, len(lengths)) for _ in range(2))
    snapshot = _snapshot_tokens_s(cfg, data, cut)
    return {"kafka_topic": topic, "kafka_records": docs, "kafka_bare_consume_tokens_s": bare,
            "kafka_source_tokens_s": source, "kafka_ratio": source / bare,
            "kafka_cut_topic": cut, "kafka_cut_records": len(lengths), "kafka_cut_bare_consume_tokens_s": cut_bare,
            "kafka_snapshot_tokens_s": snapshot, "kafka_snapshot_gb_s": snapshot * 2 / 1e9,
            "kafka_snapshot_ratio": snapshot / cut_bare,
            "kafka_follow": follow_cpu_per_token(cfg, data, cut, lengths)}


def _snapshot_tokens_s(cfg: BenchConfig, data: dict, topic: str) -> float:
    """Tokens/s of a bounded epoch's snapshot build (the whole topic, its partitions in parallel,
    into Arrow shards in a temporary directory), as a feeder builds it once per region. Of the
    best of two builds, as the bare loop's figure is (the first may warm the broker's cache)."""
    import shutil
    import tempfile

    from feeder.sources.kafka import KafkaSource, KafkaURL

    spool = tempfile.mkdtemp(prefix="bench-snapshot-")
    src = KafkaSource(KafkaURL.parse(f"kafka://{cfg.kafka}/{topic}?vocab_size={data['vocab_size']}&eos_id=0"
                                     f"&spool={spool}"))
    try:
        ranges = src.fingerprint   # bounded: the offset ranges of the whole topic now
        rates = []
        for policy in ("fail", "skip"):   # two builds: the policy is part of a snapshot's key
            t0 = time.monotonic()
            snap = src.snapshot(ranges, policy)
            rates.append(snap.n_tokens / (time.monotonic() - t0))
        return max(rates)
    finally:
        src.close()
        shutil.rmtree(spool, ignore_errors=True)


FOLLOW_RANKS = (1, 8, 64)


def follow_cpu_per_token(cfg: BenchConfig, data: dict, topic: str, lengths: np.ndarray) -> dict:
    """Feeder CPU per served token in follow mode with 1, 8 and 64 ranks of one job on one
    `feeder serve` process (ranks as threads here), over a topic of records of 200-1200 tokens
    (`lengths`) cut from the bench's token stream. Each rank takes 90% of the batches (of one sample of
    seq_len + 1: small enough for 64 ranks to get many each) its records make, so no rank
    reaches the topic's end and waits there; uncompressed (the source's cost, not zstd's).
    Target: within 1.5x of one rank's at 8 and at 64 ranks.

    Beside it, the same ranks taking the same batches from the bench's file corpus (`file_*`):
    what serving W streams costs the feeder whatever the source (their setup, the slow start's
    small first messages, W threads under one GIL), so that the Kafka reader's own share of the
    ratio can be read off."""
    from .clients import Feeder
    from .config import say

    url = f"kafka://{cfg.kafka}/{topic}?mode=follow&vocab_size={data['vocab_size']}&eos_id=0"
    out: dict[str, dict] = {}
    for world in FOLLOW_RANKS:
        say(f"Kafka follow mode: {world} ranks of one job on one feeder")
        f = Feeder(url, message_bytes=cfg.message_bytes)   # a fresh one: each job fetches the topic itself
        try:
            # record k is rank k mod W's, with an EOS after it; batch b needs (b + 1) * seq_len + 1 tokens
            mine = [lengths[r::world].sum() + len(lengths[r::world]) for r in range(world)]
            batches = [int(0.9 * ((n - 1) // cfg.seq_len)) for n in mine]
            cpu0, t0 = f.cpu_s(), time.monotonic()
            served = _follow_job(cfg, f.address, f"follow-{world}-{time.time_ns()}", batches)
            wall, cpu = time.monotonic() - t0, f.cpu_s() - cpu0
            out[str(world)] = {"tokens": served, "wall_s": wall, "tokens_s": served / wall,
                               "feeder_cpu_s_per_mtok": cpu / (served / 1e6)}
        finally:
            f.stop()
        f = Feeder(data["shards"], message_bytes=cfg.message_bytes)
        try:
            cpu0 = f.cpu_s()
            served = _follow_job(cfg, f.address, f"file-{world}-{time.time_ns()}", batches)
            out[str(world)]["file_feeder_cpu_s_per_mtok"] = (f.cpu_s() - cpu0) / (served / 1e6)
        finally:
            f.stop()
    for key in ("", "file_"):
        one = out["1"][f"{key}feeder_cpu_s_per_mtok"]
        for fig in out.values():
            fig[f"{key}vs_one_rank"] = fig[f"{key}feeder_cpu_s_per_mtok"] / one
    return {"topic": topic, "records": len(lengths), "ranks": out}


def _produce_cut(cfg: BenchConfig, data: dict, topic: str) -> np.ndarray:
    """Records of 200-1200 tokens (seeded lengths) cut from the packed token stream, round-robin
    over the partitions, until a few million tokens: their lengths."""
    from confluent_kafka import Producer

    from feeder.sources.kafka import encode_record

    packed = np.memmap(data["packed"], dtype=np.uint16, mode="r")
    limit = 1_000_000 if cfg.quick else 24_000_000   # the stream again from its start if it is shorter
    lengths = np.random.default_rng(26).integers(200, 1201, size=limit // 200)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths), limit)]
    p = Producer({"bootstrap.servers": cfg.kafka, "enable.idempotence": True, "compression.type": "zstd",
                  "linger.ms": 20, "batch.size": 1 << 20, "queue.buffering.max.kbytes": 512 << 10})
    at = 0
    for k, n in enumerate(lengths.tolist()):
        if at + n > len(packed):
            at = 0
        value = encode_record(packed[at:at + n], vocab_size=data["vocab_size"], eos_id=0, tokenizer="bench")
        at += n
        while True:
            try:
                p.produce(topic, value, partition=k % PARTITIONS)
                break
            except BufferError:
                p.poll(0.1)
    p.flush(60)
    return lengths


def _follow_job(cfg: BenchConfig, address: str, job: str, batches: list[int]) -> int:
    """Rank r takes batches[r] batches of one sample: the tokens served."""
    import threading

    from feeder_client import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec

    world = len(batches)
    served = [0] * world
    errors: list[str] = []

    def rank_loop(r: int) -> None:
        if not batches[r]:
            return
        spec = StreamSpec(job=job, rank=r, world_size=world, seq_len=cfg.seq_len, micro_batch=1, num_epochs=0,
                          compression="none")
        cli = FeederClient(ClientConfig(targets=(address,), spec=spec, read_ahead=4))
        try:
            for n, b in enumerate(cli, 1):
                served[r] += b.tokens.numel()
                if n == batches[r]:
                    break
        except Exception as e:   # a failed rank is a result, not a crash of the bench
            errors.append(f"rank {r}: {e.__class__.__name__}: {e}")
        finally:
            cli.close()

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise RuntimeError(f"follow-mode ranks failed: {errors[:3]}")
    return sum(served)


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
    from feeder.core.config import StreamSpec
    from feeder.core.cursor import CursorWriter
    from feeder.pipeline.batcher import block_from_runs
    from feeder.core.planning import PENDING
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
