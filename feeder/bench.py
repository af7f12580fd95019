"""`feeder bench`: the feeder against its ceilings and its alternative, in one run, as ratios.

Everything runs on loopback in this invocation: a bare TCP socket and a bare grpc.aio stream
(the ceilings), `feeder serve` processes (the subject), a torch DataLoader with
DistributedSampler over a local np.memmap (what a trainer does without a feeder), and, when
a broker answers, the Kafka source against a bare confluent-kafka consume() loop. Ranks run
as threads spread over client processes, so the client side is not one GIL.

Tokens are counted as delivered values: micro_batch * (seq_len + 1) per batch.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from feeder import __version__
from feeder.malloc import keep_freed_memory
from feeder.net import free_port

CLIENT_PROCS = 2


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    data: str = "bench/data"
    ranks: int = 8
    seq_len: int = 2048
    micro_batch: int = 8
    seconds: float = 4.0
    # 256 batches (the most a message holds) of 8 x 2049 uint16 tokens: half the messages
    # of 4 MiB, so half the per-message GIL handoffs between the builders and the event loop.
    message_bytes: int = 8 << 20
    corpus_bytes: int = 12 << 20
    vocab: int = 32000
    kafka: str = "127.0.0.1:9092"     # "" to skip the Kafka figures
    quick: bool = False
    rounds: int = 3                    # of the ceilings and the feeder, interleaved; medians reported

    def __post_init__(self):
        from feeder.config import _positive

        for name in ("ranks", "seq_len", "micro_batch", "message_bytes", "rounds"):
            _positive(name, getattr(self, name))


def say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- dataset

def dataset(cfg: BenchConfig) -> dict:
    """A BPE tokenizer (vocab < 65536) trained offline on a real corpus, and the corpus
    prepared with it; reused by later runs."""
    from feeder import manifest as mf
    from feeder.config import PrepConfig
    from feeder.corpus import build_corpus
    from feeder.prep import prep

    root = Path(cfg.data)
    root.mkdir(parents=True, exist_ok=True)
    corpus, tok, shards = root / "corpus.jsonl", root / "tokenizer.json", root / "bpe"
    if not corpus.exists():
        say("building the corpus (Python standard library sources and docs)")
        build_corpus(corpus, cfg.corpus_bytes)
    if not tok.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        say(f"training a byte-level BPE tokenizer, vocab {cfg.vocab}, on {corpus}")
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

        def texts():
            with open(corpus, encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)["text"]

        t.train_from_iterator(texts(), trainer)
        t.save(str(tok))
    if not (shards / mf.NAME).exists():
        say("tokenizing the corpus into shards")
        prep(PrepConfig(inputs=(str(corpus),), out=str(shards), tokenizer=str(tok), progress=False), force=True)
    m = mf.read(shards)
    packed = root / "packed.u16"
    if not packed.exists() or packed.stat().st_size != m.n_tokens * 2:
        from feeder.sources.posix import PosixSource

        src = PosixSource(shards)
        out = np.memmap(packed, dtype=np.uint16, mode="w+", shape=(m.n_tokens,))
        src.read(0, out)
        out.flush()
    return {"shards": str(shards), "packed": str(packed), "n_tokens": m.n_tokens, "vocab_size": m.vocab_size,
            "tokenizer": str(tok), "corpus_bytes": corpus.stat().st_size}


# --------------------------------------------------------------------------- ceilings

def _socket_server(port_q, seconds, chunk):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port_q.put(s.getsockname()[1])
    c, _ = s.accept()
    buf = b"\0" * chunk
    end = time.monotonic() + seconds + 1
    try:
        while time.monotonic() < end:
            c.sendall(buf)
    except OSError:
        pass
    c.close()


def _serve_in_process(target, seconds: float, size: int):
    """Start a ceiling server (`target(port_queue, seconds, size)`) in its own process, so it
    does not share this one's GIL; (process, port)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, seconds, size))
    p.start()
    return p, q.get(timeout=60)


def raw_socket_mb_s(seconds: float, chunk: int) -> float:
    p, port = _serve_in_process(_socket_server, seconds, chunk)
    c = socket.create_connection(("127.0.0.1", port))
    buf = bytearray(chunk)
    view = memoryview(buf)
    got, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        n = c.recv_into(view)
        if n == 0:
            break
        got += n
    dt = time.monotonic() - t0
    c.close()
    p.join(10)
    return got / dt / 1e6


def _grpc_server(port_q, seconds, size):
    import asyncio

    import grpc

    from feeder.service.server import SERVER_OPTIONS, new_loop

    keep_freed_memory()   # as `feeder serve` does: the ceiling runs with the feeder's settings
    payload = b"\1" * size

    async def stream(request, context):
        end = time.monotonic() + seconds + 2
        while time.monotonic() < end:
            yield payload

    async def main():
        server = grpc.aio.server(options=SERVER_OPTIONS)
        handler = grpc.method_handlers_generic_handler(
            "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await asyncio.sleep(seconds + 4)
        await server.stop(0)

    loop = new_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(main())


def raw_grpc_shared_mb_s(clients: "Clients", seconds: float, size: int, streams: int, reader: str = "grpcio") -> float:
    """The bare grpc.aio server taken by `streams` counting streams in the client processes,
    as the feeder is: what stock gRPC does when the clients share the cores with it."""
    p, port = _serve_in_process(_grpc_server, seconds + 4, size)
    try:
        got = clients.count([f"127.0.0.1:{port}"], None, streams, seq_len=0, mb=0, seconds=seconds, reader=reader)
        return got["tokens_s"] * 2 / 1e6
    finally:
        p.terminate()   # counted: no need to wait out its streams' margin
        p.join(20)


def raw_grpc_mb_s(seconds: float, size: int) -> float:
    import grpc

    p, port = _serve_in_process(_grpc_server, seconds, size)
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 256 << 20)])
    call = ch.unary_stream("/bench.Raw/Stream")(b"")
    got, t0 = 0, None
    for msg in call:
        if t0 is None:
            t0 = time.monotonic()   # from the first message: connection set-up is not streaming
            continue
        got += len(msg)
        if time.monotonic() - t0 >= seconds:
            break
    dt = time.monotonic() - t0
    call.cancel()
    ch.close()
    p.join(15)
    return got / dt / 1e6


def raw_grpc_h2_mb_s(seconds: float, size: int) -> float:
    """raw_grpc_mb_s's server read by the bench's minimal HTTP/2 reader instead of grpcio: what
    the stock grpc.aio server sends when its reader takes little of the cores."""
    from feeder.h2count import count_stream

    p, port = _serve_in_process(_grpc_server, seconds + 2, size)
    try:
        got = count_stream(f"127.0.0.1:{port}", "/bench.Raw/Stream", b"", seconds=seconds, warm_s=0.5)
        return got.bytes / got.seconds / 1e6
    finally:
        p.terminate()
        p.join(15)


# --------------------------------------------------------------------------- feeder processes

def machine_cpu_s() -> dict[str, float]:
    """The machine's CPU seconds so far (/proc/stat): busy (user, system, interrupts), idle
    (with I/O wait), and steal (taken by other guests of a shared host)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return {"busy": (user + nice + system + irq + softirq) / tick, "idle": (idle + iowait) / tick, "steal": steal / tick}


class Feeder:
    def __init__(self, source: str, port: int = 0, *, message_bytes: int, extra=()):
        port = port or free_port()
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "feeder.cli", "serve", "--source", source, "--listen", self.address,
             "--message-bytes", str(message_bytes), "--grace", "1", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"feeder did not start: {line!r}")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the feeder process has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def status(self):
        from feeder.status import fetch

        return fetch(self.address)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _drive(args) -> dict:
    """In a client process: run `ranks` as threads for `seconds` after a warm-up; each takes
    batches as fast as it can, or 'trains' step_s per batch. Returns totals."""
    (addresses, job, ranks, world, seq_len, mb, compression, seconds, step_s, warm_s, read_ahead) = args
    from client.stream import ClientConfig, FeederClient
    from feeder.config import StreamSpec

    out = {"tokens": 0, "batches": 0, "wait_s": 0.0, "busy_s": 0.0, "errors": [], "cpu_s": 0.0, "first": []}
    lock = threading.Lock()
    t_measure = [0.0]

    def go():  # runs once every rank has its first batch, before any is released
        t_measure[0] = time.monotonic() + warm_s

    start = threading.Barrier(len(ranks) + 1, action=go)

    def rank_loop(r):
        try:
            spec = StreamSpec(job=job, rank=r, world_size=world, seq_len=seq_len, micro_batch=mb, num_epochs=0,
                              compression=compression, seed=1)
            t_open = time.monotonic()
            cli = FeederClient(ClientConfig(targets=tuple(addresses), spec=spec, read_ahead=read_ahead))
            it = iter(cli)
            next(it)
            first = time.monotonic() - t_open
            start.wait(120)
            tokens = batches = 0
            wait = 0.0
            end_warm = t_measure[0]
            while True:
                t0 = time.monotonic()
                b = next(it)
                t1 = time.monotonic()
                if t1 >= end_warm:
                    if t1 - end_warm >= seconds:
                        break
                    tokens += b.tokens.numel()
                    batches += 1
                    wait += t1 - t0
                if step_s:
                    time.sleep(step_s)
            cli.close()
            with lock:
                out["tokens"] += tokens
                out["batches"] += batches
                out["wait_s"] += wait
                out["first"].append(first)
        except BaseException as e:  # a failed rank is a result, not a crash of the bench
            with lock:
                out["errors"].append(f"rank {r}: {e.__class__.__name__}: {e}")
            try:
                start.abort()
            except Exception:
                pass

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    try:
        start.wait(180)
    except threading.BrokenBarrierError:
        pass
    cpu0 = time.process_time()
    for t in threads:
        t.join(seconds + warm_s + 120)
    out["cpu_s"] = time.process_time() - cpu0
    out["wall_s"] = seconds
    return out


def _drive_counting(args) -> dict:
    """In a client process: `ranks` feeder streams that only count what arrives, as the
    ceilings' clients do (tokens per byte taken from each stream's first reply), so the figure
    is what the feeders serve, not what this machine's cores can also decode. job None: the
    bare gRPC server's stream instead (2 bytes a token).

    reader "grpcio": a grpcio channel per rank, as a rank's client has. "h2": the bench's
    minimal HTTP/2 reader (feeder.h2count), which spends a third to a quarter of grpcio's CPU
    per byte, so the readers take fewer of the cores the servers they measure run on.
    "h2-discard": the same reader, the kernel dropping the message bodies it never looks at
    (MSG_TRUNC), so reading costs next to nothing: a stand-in for ranks on other hosts."""
    addresses, job, ranks, world, seq_len, mb, seconds, warm_s, reader = args
    import grpc

    from feeder.h2count import count_stream
    from feeder.v1 import feeder_pb2 as pb

    out = {"tokens": 0.0, "bytes": 0, "total": 0, "errors": []}
    lock = threading.Lock()
    method = "/bench.Raw/Stream" if job is None else "/feeder.v1.Feeder/Stream"

    def request(r: int) -> bytes:
        if job is None:
            return b""
        return pb.StreamRequest(job=job, rank=r, world_size=world, seq_len=seq_len, micro_batch=mb, num_epochs=0,
                                seed=1, compression=pb.COMPRESSION_NONE).SerializeToString()

    def per_byte(first: bytes) -> float:
        if job is None:
            return 0.5
        return sum(b.n * b.sample_len for b in pb.StreamReply.FromString(first).batches) / len(first)

    def with_grpcio(r) -> tuple[float, int, int]:
        ch = grpc.insecure_channel(addresses[0], options=[("grpc.max_receive_message_length", 256 << 20),
                                                          ("grpc.use_local_subchannel_pool", 1)])
        try:
            call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)(request(r))
            t_end, got, total, scale = None, 0, 0, 0.0
            for msg in call:
                total += len(msg)
                if t_end is None:
                    scale = per_byte(msg)
                    t_start = time.monotonic() + warm_s
                    t_end = t_start + seconds
                    continue
                now = time.monotonic()
                if now >= t_end:
                    break
                if now >= t_start:
                    got += len(msg)
            call.cancel()
            return got * scale, got, total
        finally:
            ch.close()

    def with_h2(r) -> tuple[float, int, int]:
        got = count_stream(addresses[0], method, request(r), seconds=seconds, warm_s=warm_s,
                           discard=reader == "h2-discard")
        return got.bytes * per_byte(got.first), got.bytes, got.total

    def rank_loop(r):
        try:
            tokens, nbytes, total = (with_grpcio if reader == "grpcio" else with_h2)(r)
            with lock:
                out["tokens"] += tokens
                out["bytes"] += nbytes
                out["total"] += total
        except Exception as e:
            with lock:
                out["errors"].append(f"rank {r}: {e.__class__.__name__}: {e}")

    cpu0 = time.process_time()
    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + warm_s + 60)
    out["cpu_s"] = time.process_time() - cpu0
    return out


READERS = ("grpcio", "h2", "h2-discard")   # see _drive_counting


class Clients:
    """A pool of client processes (spawned once: each imports torch). Each keeps freed memory
    as a rank's FeederClient makes its process do, from the start: the counting readers, the
    ranks and the local DataLoader all run with the same malloc settings."""

    def __init__(self, n: int = CLIENT_PROCS):
        self.pool = mp.get_context("spawn").Pool(n, initializer=keep_freed_memory)
        self.n = n

    def run(self, addresses, job, world, *, seq_len, mb, compression="none", seconds=4.0, step_s=0.0,
            ranks=None, warm_s=1.0, read_ahead=4) -> dict:
        ranks = list(range(world)) if ranks is None else ranks
        parts = [ranks[i::self.n] for i in range(self.n)]
        args = [(addresses, job, part, world, seq_len, mb, compression, seconds, step_s, warm_s, read_ahead)
                for part in parts if part]
        results = self.pool.map(_drive, args)
        tot = {"tokens": 0, "batches": 0, "wait_s": 0.0, "cpu_s": 0.0, "errors": [], "first": []}
        for r in results:
            for k in ("tokens", "batches", "wait_s", "cpu_s"):
                tot[k] += r[k]
            tot["errors"] += r["errors"]
            tot["first"] += r["first"]
        tot["tokens_s"] = tot["tokens"] / seconds
        tot["wait_share"] = tot["wait_s"] / (seconds * len(ranks))
        return tot

    def count(self, addresses, job, world, *, seq_len, mb, seconds=4.0, warm_s=1.0, reader="grpcio") -> dict:
        """Aggregate tokens/s of `world` counting-only streams (see _drive_counting), and the
        readers' CPU seconds per GB taken (all client processes together)."""
        if reader not in READERS:
            raise ValueError(f"reader {reader!r}: expected one of {', '.join(READERS)}")
        parts = [list(range(world))[i::self.n] for i in range(self.n)]
        results = self.pool.map(_drive_counting, [(addresses, job, p, world, seq_len, mb, seconds, warm_s, reader)
                                                  for p in parts if p])
        errors = [e for r in results for e in r["errors"]]
        if errors:
            raise RuntimeError(f"counting clients ({reader}) failed: {errors[:3]}")
        total = sum(r["total"] for r in results)   # all they read, warm-up included, as their CPU is
        cpu_s = sum(r["cpu_s"] for r in results)
        return {"tokens_s": sum(r["tokens"] for r in results) / seconds, "reader_cpu_s": cpu_s,
                "reader_cpu_s_per_gb": cpu_s / (total / 1e9) if total else None}

    def close(self):
        self.pool.terminate()


# --------------------------------------------------------------------------- local DataLoader

def _local(args) -> dict:
    packed, seq_len, mb, world, seconds = args
    import torch
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    mm = np.memmap(packed, dtype=np.uint16, mode="r")
    n = (len(mm) - 1) // seq_len

    class Packed(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return torch.from_numpy(mm[i * seq_len:i * seq_len + seq_len + 1].astype(np.int64))

    tokens, t0, cpu0 = 0, time.monotonic(), time.process_time()
    epoch = 0
    while time.monotonic() - t0 < seconds:
        sampler = DistributedSampler(Packed(), num_replicas=world, rank=0, shuffle=True, seed=1)
        sampler.set_epoch(epoch)
        for batch in DataLoader(Packed(), batch_size=mb, sampler=sampler, num_workers=0):
            tokens += batch.numel()
            if time.monotonic() - t0 >= seconds:
                break
        epoch += 1
    return {"tokens_s": tokens / (time.monotonic() - t0),
            "cpu_s_per_mtok": (time.process_time() - cpu0) / (tokens / 1e6)}


def _client_cpu(args) -> dict:
    """One rank in its own process: CPU seconds per million tokens taken from the feeder."""
    address, seq_len, mb, compression, seconds = args
    from client.stream import ClientConfig, FeederClient
    from feeder.config import StreamSpec

    spec = StreamSpec(job=f"cpu-{compression}", rank=0, world_size=8, seq_len=seq_len, micro_batch=mb,
                      num_epochs=0, compression=compression, seed=1)
    cli = FeederClient(ClientConfig(targets=(address,), spec=spec))
    it = iter(cli)
    for _ in range(5):
        next(it)
    tokens, t0, cpu0 = 0, time.monotonic(), time.process_time()
    while time.monotonic() - t0 < seconds:
        tokens += next(it).tokens.numel()
    cpu = time.process_time() - cpu0
    dt = time.monotonic() - t0
    cli.close()
    return {"tokens_s": tokens / dt, "cpu_s_per_mtok": cpu / (tokens / 1e6)}


# --------------------------------------------------------------------------- single figures

def ttfb(address: str, seq_len: int, mb: int, tries: int = 5) -> tuple[float, float]:
    """(new stream -> first batch, resume mid-epoch from a cursor -> first batch), medians."""
    from client.stream import ClientConfig, FeederClient
    from feeder.config import StreamSpec

    def first(job, cursor=None):
        spec = StreamSpec(job=job, rank=0, world_size=8, seq_len=seq_len, micro_batch=mb, seed=3, num_epochs=0)
        t0 = time.monotonic()
        cli = FeederClient(ClientConfig(targets=(address,), spec=spec, cursor=cursor))
        b = next(iter(cli))
        dt = time.monotonic() - t0
        cli.close()
        return dt, b

    new, resume = [], []
    for k in range(tries):
        dt, _ = first(f"ttfb-{k}")
        new.append(dt)
    spec = StreamSpec(job="resume", rank=0, world_size=8, seq_len=seq_len, micro_batch=mb, seed=3, num_epochs=0)
    cli = FeederClient(ClientConfig(targets=(address,), spec=spec))
    it = iter(cli)
    cursor = None
    for k in range(20):
        cursor = next(it).cursor
    after = next(it)
    cli.close()
    for _ in range(tries):
        dt, b = first("resume", cursor)
        resume.append(dt)
        assert (b.epoch, b.step) == (after.epoch, after.step), "resume did not continue after its cursor"
    return float(np.median(new)), float(np.median(resume))


def wire_bytes_per_token(address: str, seq_len: int, mb: int) -> float:
    """Bytes on the wire per token with the default compression, from the feeder's counters."""
    from client.stream import ClientConfig, FeederClient
    from feeder.config import StreamSpec

    spec = StreamSpec(job="wire", rank=0, world_size=1, seq_len=seq_len, micro_batch=mb, seed=3, shuffle=True)
    cli = FeederClient(ClientConfig(targets=(address,), spec=spec))
    tokens = sum(b.tokens.numel() for b in cli)
    cli.close()
    from feeder.status import fetch

    r = fetch(address, "wire").jobs[0].ranks[0]
    return r.bytes_sent / tokens


def streams(clients: Clients, feeder: Feeder, n: int, *, seq_len: int, mb: int, seconds: float) -> dict:
    """n ranks streaming at once (small read-ahead): errors, and the feeder's RSS meanwhile."""
    rss = []
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(0.5):
            try:
                rss.append(feeder.status().rss_mb)
            except Exception:
                pass

    t = threading.Thread(target=sample_rss, daemon=True)
    t.start()
    res = clients.run([feeder.address], f"many-{n}", n, seq_len=seq_len, mb=mb, compression="zstd",
                      seconds=seconds, read_ahead=1, warm_s=0.5)
    stop.set()
    t.join(2)
    return {"ok": n - len(res["errors"]), "errors": res["errors"][:5], "rss_max_mb": max(rss) if rss else None,
            "tokens_s": res["tokens_s"]}


def kafka_figures(cfg: BenchConfig, data: dict) -> dict:
    """Kafka source (follow mode's reader, packing and batching) vs a bare consume() loop,
    both reading the same topic from its start, in this process."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    import pyarrow as pa

    from feeder.config import StreamSpec
    from feeder.publish import ensure_topic
    from feeder.sources.kafka import FollowPlan, KafkaSource, KafkaURL, consumer_config, encode_record

    topic = f"bench-{int(time.time())}"
    ensure_topic(cfg.kafka, topic, 3)
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
                                                           tokenizer="bench"), partition=docs % 3)
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
    header = len(encode_record(np.zeros(0, dtype=np.int64), vocab_size=data["vocab_size"], eos_id=0,
                               tokenizer="bench"))

    def bare_consume() -> float:
        c = Consumer(consumer_config(cfg.kafka))
        c.assign([TopicPartition(topic, q, 0) for q in range(3)])
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

    bare = max(bare_consume(), bare_consume())   # the first read may warm the broker's page cache
    src = KafkaSource(KafkaURL.parse(f"kafka://{cfg.kafka}/{topic}?mode=follow&vocab_size={data['vocab_size']}"
                                     f"&eos_id=0"))
    spec = StreamSpec(job="bench", rank=0, world_size=1, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch,
                      num_epochs=0, compression="none")
    plan = FollowPlan(src, spec, None, "fail")
    from feeder.pipeline.batcher import block_from_batches
    from feeder.service.wire import encode_reply

    tokens, t0 = 0, time.monotonic()
    target = produced + docs - 2 * cfg.seq_len * cfg.micro_batch   # all but the last, partial batches
    for planned in plan.batches():
        if planned is None:
            if tokens >= 0.95 * target:
                break
            continue
        b = block_from_batches(src, [planned], seq_len=cfg.seq_len, compression="none", level=0, secret=b"")
        encode_reply(b, "")   # what a feeder does with it, framing included
        tokens += b.n_tokens
        if tokens >= target:
            break
    source = tokens / (time.monotonic() - t0)
    plan.close()
    src.close()
    return {"kafka_topic": topic, "kafka_records": docs, "kafka_bare_consume_tokens_s": bare,
            "kafka_source_tokens_s": source, "kafka_ratio": source / bare}


# --------------------------------------------------------------------------- the run

def run(cfg: BenchConfig, json_path: str = "", plot_path: str = "") -> dict:
    t_start = time.monotonic()
    keep_freed_memory()   # for the bare gRPC reader in this process, as in every client process
    data = dataset(cfg)
    L, mb, N, secs = cfg.seq_len, cfg.micro_batch, cfg.ranks, cfg.seconds
    res: dict = {"config": asdict(cfg), "dataset": data, "versions": versions(), "machine": machine(),
                 "tokens_per_batch": mb * (L + 1), "message_bytes": cfg.message_bytes}
    clients = Clients()
    feeders: list[Feeder] = []
    try:
        f = Feeder(data["shards"], message_bytes=cfg.message_bytes)
        feeders.append(f)
        # The ceilings and what the feeder serves, in rounds, and the median of each: this
        # shared machine's speed drifts (the socket alone read 1.5 to 3.0 GB/s across one
        # afternoon's runs), so a ceiling taken minutes before the feeder can skew their ratio.
        # The feeder is taken by clients that count what arrives, as the ceilings' clients do,
        # so each ratio compares like with like; ranks that decode into tensors follow below.
        # With the minimal HTTP/2 reader too: what it serves when its readers take a third to a
        # quarter of the cores grpcio's do (ranks run elsewhere in production).
        rounds: dict[str, list[float]] = {k: [] for k in (
            "raw_socket_mb_s", "raw_grpc_mb_s", "raw_grpc_h2_mb_s", "feeder_tokens_s", "feeder_h2_tokens_s",
            "reader_grpcio_cpu_s_per_gb", "reader_h2_cpu_s_per_gb")}
        for i in range(cfg.rounds):
            say(f"round {i + 1} of {cfg.rounds}: the socket, bare grpc.aio ({cfg.message_bytes >> 20} MiB messages) "
                f"and the feeder ({N} ranks, compression off)")
            rounds["raw_socket_mb_s"].append(raw_socket_mb_s(secs, cfg.message_bytes))
            rounds["raw_grpc_mb_s"].append(raw_grpc_mb_s(secs, cfg.message_bytes))
            rounds["raw_grpc_h2_mb_s"].append(raw_grpc_h2_mb_s(secs, cfg.message_bytes))
            for reader in ("grpcio", "h2"):
                got = clients.count([f.address], f"agg-count-{reader}-{i}", N, seq_len=L, mb=mb, seconds=secs,
                                    reader=reader)
                rounds["feeder_tokens_s" if reader == "grpcio" else "feeder_h2_tokens_s"].append(got["tokens_s"])
                rounds[f"reader_{reader}_cpu_s_per_gb"].append(got["reader_cpu_s_per_gb"])
        med = {k: statistics.median(v) for k, v in rounds.items()}
        res["rounds"] = rounds
        for k in ("raw_socket_mb_s", "raw_grpc_mb_s", "raw_grpc_h2_mb_s", "feeder_tokens_s", "feeder_h2_tokens_s"):
            res[k] = med[k]
        res["feeder_mb_s"] = res["feeder_tokens_s"] * 2 / 1e6   # uint16 payload; see feeder_wire_mb_s for the envelope
        res["feeder_h2_mb_s"] = res["feeder_h2_tokens_s"] * 2 / 1e6
        res["reader_cpu_s_per_gb"] = {"grpcio": med["reader_grpcio_cpu_s_per_gb"], "h2": med["reader_h2_cpu_s_per_gb"]}
        say(f"the bare grpc.aio stream again, taken by {N} counting streams in {clients.n} client processes")
        res["raw_grpc_shared_mb_s"] = raw_grpc_shared_mb_s(clients, secs, cfg.message_bytes, N)
        res["raw_grpc_shared_h2_mb_s"] = raw_grpc_shared_mb_s(clients, secs, cfg.message_bytes, N, reader="h2")
        say(f"feeder: {N} ranks decoding into tensors, compression off")
        r = clients.run([f.address], "agg-none", N, seq_len=L, mb=mb, compression="none", seconds=secs)
        res["feeder_decoded_tokens_s"] = r["tokens_s"]
        res["feeder_errors"] = r["errors"]
        st = {j.job: j for j in f.status().jobs}["agg-none"]
        res["feeder_wire_mb_s_lifetime"] = sum(x.bytes_sent for x in st.ranks) / 1e6
        say(f"feeder: {N} ranks, zstd")
        r = clients.run([f.address], "agg-zstd", N, seq_len=L, mb=mb, compression="zstd", seconds=secs)
        res["feeder_zstd_tokens_s"] = r["tokens_s"]
        say("per-rank CPU: feeder client vs local DataLoader")
        # Interleaved, three of each, and the medians: a burst of the machine's other load
        # during one of two back-to-back windows moved this ratio by a third.
        runs: dict[str, list[dict]] = {"client": [], "local": []}
        for _ in range(3):
            runs["client"] += clients.pool.map(_client_cpu, [(f.address, L, mb, "zstd", secs / 2)])
            runs["local"] += clients.pool.map(_local, [(data["packed"], L, mb, N, secs / 2)])
        res["client"], res["local"] = (sorted(runs[k], key=lambda x: x["cpu_s_per_mtok"])[1] for k in ("client", "local"))
        res["cpu_runs_s_per_mtok"] = {k: [x["cpu_s_per_mtok"] for x in v] for k, v in runs.items()}
        res["client_none"] = clients.pool.map(_client_cpu, [(f.address, L, mb, "none", secs)])[0]
        res["client_cpu_s_per_mtok"] = res["client"]["cpu_s_per_mtok"]
        res["local_tokens_s"] = res["local"]["tokens_s"]
        res["local_cpu_s_per_mtok"] = res["local"]["cpu_s_per_mtok"]
        say("time to first batch, new and resumed")
        res["ttfb_s"], res["resume_s"] = ttfb(f.address, L, mb)
        res["wire_bytes_per_token"] = wire_bytes_per_token(f.address, L, mb)
        say("ranks 1, 2, 4, 8: throughput, and data-wait for a loop that trains 50 ms per batch")
        curve = []
        for k in (1, 2, 4, 8):
            t = clients.run([f.address], f"curve-{k}", k, seq_len=L, mb=mb, compression="none",
                            seconds=secs / 2)
            w = clients.run([f.address], f"wait-{k}", k, seq_len=L, mb=mb, compression="zstd",
                            seconds=secs / 2, step_s=0.05)
            curve.append({"ranks": k, "tokens_s": t["tokens_s"], "data_wait_share": w["wait_share"]})
        res["curve"] = curve
        f.stop()
        feeders.remove(f)

        f = Feeder(data["shards"], message_bytes=min(cfg.message_bytes, 1 << 20), extra=["--prefetch-messages", "2"])
        feeders.append(f)
        say("64 ranks at once: the feeder's RSS")
        many = streams(clients, f, 64, seq_len=L, mb=mb, seconds=secs)
        res["feeder_rss_mb"] = many["rss_max_mb"]
        res["streams_64"] = many
        n_max = 64 if cfg.quick else 256
        say(f"{n_max} streams at once")
        big = streams(clients, f, n_max, seq_len=256, mb=2, seconds=secs / 2)
        res["max_streams"] = big["ok"]
        res["max_streams_tried"] = n_max
        res["max_streams_errors"] = big["errors"]
        res["feeder_rss_mb_max_streams"] = big["rss_max_mb"]
        f.stop()
        feeders.remove(f)

        say("scaling: 1 and 2 feeder processes on one port (SO_REUSEPORT)")
        port = free_port()
        one = Feeder(data["shards"], port, message_bytes=cfg.message_bytes)
        feeders.append(one)
        # What the feeders serve (counting clients, as for the ceilings), and what ranks that
        # decode into tensors on the same 2 cores take (the cores then run out first).
        # Each feeder's CPU over the counting run too: tokens per feeder CPU-second shows whether
        # a second process costs the first anything, apart from the cores the machine has.
        # And where the machine's cores went meanwhile: busy, idle, taken by other guests (steal).
        def counted(job, reader):
            cpu0, m0, t0 = [f.cpu_s() for f in scaled], machine_cpu_s(), time.monotonic()
            got = clients.count([one.address], job, N, seq_len=L, mb=mb, seconds=secs, reader=reader)
            dt = time.monotonic() - t0
            cores = [(f.cpu_s() - c) / dt for f, c in zip(scaled, cpu0)]
            used = {k: (v - m0[k]) / dt for k, v in machine_cpu_s().items()}
            used["feeders"], used["readers"] = sum(cores), got["reader_cpu_s"] / dt
            used["rest"] = used["busy"] - used["feeders"] - used["readers"]
            return got["tokens_s"], cores, got["reader_cpu_s_per_gb"], {k: round(v, 3) for k, v in used.items()}

        scaled = [one]
        one_proc = {reader: counted(f"scale-1c-{reader}", reader) for reader in READERS}
        s1 = clients.run([one.address], "scale-1", N, seq_len=L, mb=mb, compression="none", seconds=secs)
        scaled.append(Feeder(data["shards"], port, message_bytes=cfg.message_bytes))  # same port
        feeders.append(scaled[-1])
        two_proc = {reader: counted(f"scale-2c-{reader}", reader) for reader in READERS}
        s2 = clients.run([one.address], "scale-2", N, seq_len=L, mb=mb, compression="none", seconds=secs)
        for key, reader in (("scaling", "grpcio"), ("scaling_h2", "h2"), ("scaling_discard", "h2-discard")):
            (t1, cores1, rd1, m1), (t2, cores2, rd2, m2) = one_proc[reader], two_proc[reader]
            res[key] = {"1": t1, "2": t2, "ratio": t2 / t1, "clients": f"counting ({reader} readers)",
                        "feeder_cores_1": cores1, "feeder_cores_2": cores2, "reader_cpu_s_per_gb": [rd1, rd2],
                        "machine_cores_1": m1, "machine_cores_2": m2,
                        "tokens_per_feeder_cpu_s_1": t1 / sum(cores1), "tokens_per_feeder_cpu_s_2": t2 / sum(cores2)}
        res["scaling_decoding_clients"] = {"1": s1["tokens_s"], "2": s2["tokens_s"],
                                           "ratio": s2["tokens_s"] / s1["tokens_s"]}
    finally:
        for f in feeders:
            f.stop()
        clients.close()
    if cfg.kafka:
        say(f"Kafka source vs bare consume() at {cfg.kafka}")
        try:
            res.update(kafka_figures(cfg, data))
        except Exception as e:  # no broker: the rest of the figures still stand
            res["kafka_error"] = f"{e.__class__.__name__}: {e}"
    res["ratios"] = ratios(res)
    res["elapsed_s"] = time.monotonic() - t_start
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2) + "\n")
    if plot_path:
        plot(res, plot_path)
    return res


def ratios(r: dict) -> dict:
    """Each target, taken with grpcio readers (as the issue's figures are) and, marked _h2,
    with the minimal HTTP/2 reader on both sides of the ratio."""
    grpc_tokens_s = r["raw_grpc_mb_s"] * 1e6 / 2      # uint16 tokens the bare stream's bytes would carry
    out = {
        "feeder_vs_grpc_tokens": (r["feeder_tokens_s"] / grpc_tokens_s, 0.6),
        "feeder_vs_grpc_tokens_h2": (r["feeder_h2_tokens_s"] / (r["raw_grpc_h2_mb_s"] * 1e6 / 2), 0.6),
        "feeder_mb_vs_socket": (r["feeder_mb_s"] / r["raw_socket_mb_s"], 0.35),
        "feeder_mb_vs_socket_h2": (r["feeder_h2_mb_s"] / r["raw_socket_mb_s"], 0.35),
        "client_cpu_vs_local": (r["client_cpu_s_per_mtok"] / r["local_cpu_s_per_mtok"], 1.0),
        "ttfb_s": (r["ttfb_s"], 0.2),
        "resume_s": (r["resume_s"], 1.0),
        "wire_bytes_per_token": (r["wire_bytes_per_token"], 1.6),
        "feeder_rss_mb_64_ranks": (r["feeder_rss_mb"], 400),
        "max_streams": (r["max_streams"], 256),
        "scaling_2_vs_1": (r["scaling"]["ratio"], 1.6),
        "scaling_2_vs_1_h2": (r["scaling_h2"]["ratio"], 1.6),
        "scaling_2_vs_1_discard": (r["scaling_discard"]["ratio"], 1.6),
    }
    if "kafka_ratio" in r:
        out["kafka_source_vs_bare_consume"] = (r["kafka_ratio"], 0.5)
    at_least = {"feeder_vs_grpc_tokens", "feeder_vs_grpc_tokens_h2", "feeder_mb_vs_socket", "feeder_mb_vs_socket_h2",
                "max_streams", "scaling_2_vs_1", "scaling_2_vs_1_h2", "scaling_2_vs_1_discard",
                "kafka_source_vs_bare_consume"}
    return {k: {"value": v, "target": t, "met": (v >= t) if k in at_least else (v <= t)}
            for k, (v, t) in out.items() if v is not None}


def table(r: dict) -> str:
    def of_rounds(key: str, scale: float = 1.0) -> str:
        return f"median of {', '.join(f'{x / scale:,.0f}' for x in r['rounds'][key])}"

    rows = [
        ("raw_socket_mb_s", f"{r['raw_socket_mb_s']:,.0f} MB/s ({of_rounds('raw_socket_mb_s')})"),
        ("raw_grpc_mb_s", f"{r['raw_grpc_mb_s']:,.0f} MB/s ({of_rounds('raw_grpc_mb_s')})"),
        ("raw_grpc_shared_mb_s", f"{r.get('raw_grpc_shared_mb_s', 0):,.0f} MB/s ({r['config']['ranks']} counting streams, "
                                 "as the feeder's)"),
        ("raw_grpc_h2_mb_s", f"{r['raw_grpc_h2_mb_s']:,.0f} MB/s ({of_rounds('raw_grpc_h2_mb_s')}); "
                             f"{r['raw_grpc_shared_h2_mb_s']:,.0f} MB/s shared (read by the minimal HTTP/2 reader)"),
        ("feeder_tokens_s", f"{r['feeder_tokens_s'] / 1e6:,.1f} M tok/s ({r['config']['ranks']} ranks, none, served; "
                            f"{of_rounds('feeder_tokens_s', 1e6)})"),
        ("feeder_decoded_tokens_s", f"{r['feeder_decoded_tokens_s'] / 1e6:,.1f} M tok/s (ranks decode into tensors)"),
        ("feeder_mb_s", f"{r['feeder_mb_s']:,.0f} MB/s"),
        ("feeder_h2_tokens_s", f"{r['feeder_h2_tokens_s'] / 1e6:,.1f} M tok/s = {r['feeder_h2_mb_s']:,.0f} MB/s "
                               f"(HTTP/2 readers; {of_rounds('feeder_h2_tokens_s', 1e6)})"),
        ("reader CPU s per GB", f"grpcio {r['reader_cpu_s_per_gb']['grpcio'] or 0:.2f}, "
                                f"HTTP/2 reader {r['reader_cpu_s_per_gb']['h2'] or 0:.2f}"),
        ("feeder_zstd_tokens_s", f"{r['feeder_zstd_tokens_s'] / 1e6:,.1f} M tok/s"),
        ("local_tokens_s", f"{r['local_tokens_s'] / 1e6:,.1f} M tok/s (1 rank)"),
        ("client_cpu_s_per_mtok", f"{r['client_cpu_s_per_mtok']:.4f} s (zstd; median of "
                                  f"{', '.join(f'{x:.4f}' for x in r['cpu_runs_s_per_mtok']['client'])})"),
        ("local_cpu_s_per_mtok", f"{r['local_cpu_s_per_mtok']:.4f} s (median of "
                                 f"{', '.join(f'{x:.4f}' for x in r['cpu_runs_s_per_mtok']['local'])}, interleaved)"),
        ("ttfb_s / resume_s", f"{r['ttfb_s']:.3f} s / {r['resume_s']:.3f} s"),
        ("wire_bytes_per_token", f"{r['wire_bytes_per_token']:.3f}"),
        ("feeder_rss_mb (64 ranks)", f"{r['feeder_rss_mb']:.0f} MB"),
        ("max_streams", f"{r['max_streams']} of {r['max_streams_tried']}"),
        *[row for key in ("scaling", "scaling_h2", "scaling_discard") for row in _scaling_rows(r[key])],
        ("  with decoding clients", f"{r['scaling_decoding_clients']['1'] / 1e6:,.1f} -> "
                                    f"{r['scaling_decoding_clients']['2'] / 1e6:,.1f} M tok/s"),
    ]
    if "kafka_ratio" in r:
        rows.append(("kafka source / bare consume", f"{r['kafka_source_tokens_s'] / 1e6:,.1f} / "
                                                    f"{r['kafka_bare_consume_tokens_s'] / 1e6:,.1f} M tok/s"))
    lines = [f"{k:<30} {v}" for k, v in rows]
    lines.append("")
    lines.append(f"{'target':<30} {'value':>10} {'goal':>8}  met")
    for k, v in r["ratios"].items():
        lines.append(f"{k:<30} {v['value']:>10.3f} {v['target']:>8}  {'yes' if v['met'] else 'NO'}")
    return "\n".join(lines)


def _scaling_rows(sc: dict) -> list[tuple[str, str]]:
    return [("scaling 1 -> 2 processes", f"{sc['1'] / 1e6:,.1f} -> {sc['2'] / 1e6:,.1f} M tok/s ({sc['clients']})"),
            ("  per feeder CPU-second", f"{sc['tokens_per_feeder_cpu_s_1'] / 1e6:,.1f} -> "
                                        f"{sc['tokens_per_feeder_cpu_s_2'] / 1e6:,.1f} M tok "
                                        f"(feeders used {sum(sc['feeder_cores_1']):.2f} -> "
                                        f"{sum(sc['feeder_cores_2']):.2f} cores; readers "
                                        f"{sc['reader_cpu_s_per_gb'][0]:.2f} core-s/GB)"),
            ("  the machine's cores, 2 procs", "busy {busy:.2f} (feeders {feeders:.2f}, readers {readers:.2f}, rest "
                                              "{rest:.2f}), idle {idle:.2f}, steal {steal:.2f}".format(
                                                  **sc["machine_cores_2"]))]


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [c["ranks"] for c in r["curve"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ks, [c["tokens_s"] / 1e6 for c in r["curve"]], "o-", label="feeder (aggregate)")
    a.axhline(r["raw_grpc_mb_s"] / 2, color="grey", ls="--", label="bare gRPC stream (uint16 tokens)")
    a.axhline(r["local_tokens_s"] / 1e6, color="tab:orange", ls=":", label="local DataLoader, 1 rank")
    a.set_xlabel("ranks")
    a.set_ylabel("M tokens/s")
    a.set_xticks(ks)
    a.set_title("Throughput against ranks (loopback)")
    a.legend(fontsize=8)
    b.bar([str(k) for k in ks], [100 * c["data_wait_share"] for c in r["curve"]])
    b.set_xlabel("ranks")
    b.set_ylabel("% of time waiting for data")
    b.set_title("Data-wait share, 50 ms train step per batch")
    fig.suptitle(f"feeder {r['versions']['feeder']} on {r['machine']['cpus']} CPUs; "
                 f"seq_len {r['config']['seq_len']}, micro_batch {r['config']['micro_batch']}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def versions() -> dict:
    import grpc
    import pyarrow

    out = {"feeder": __version__, "python": platform.python_version(), "grpcio": grpc.__version__,
           "pyarrow": pyarrow.__version__, "numpy": np.__version__}
    try:
        import confluent_kafka

        out["confluent_kafka"] = confluent_kafka.version()[0]
    except ImportError:
        pass
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "maxrss_mb_bench": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
