"""The bench's processes: `feeder serve` subprocesses (the subject), and a pool of client
processes that run ranks as threads against them, the counting readers, and the local
DataLoader the feeder is compared with."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import numpy as np

from feeder.core.malloc import keep_freed_memory
from feeder.core.net import free_port

from .config import CLIENT_PROCS


def machine_cpu_s() -> dict[str, float]:
    """The machine's CPU seconds so far (/proc/stat): busy (user, system, interrupts), idle
    (with I/O wait), and steal (taken by other guests of a shared host)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return {"busy": (user + nice + system + irq + softirq) / tick, "idle": (idle + iowait) / tick, "steal": steal / tick}


class Feeder:
    """A `feeder serve` subprocess on loopback (port 0: a free one), started and ready."""

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
        """The feeder's `feeder status` answer (jobs, ranks, RSS)."""
        from feeder.ops.status import fetch

        return fetch(self.address)

    def stop(self):
        """SIGTERM, then SIGKILL after 15 s."""
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _drive(args) -> dict:
    """In a client process: run `ranks` as threads for `seconds` after a warm-up; each takes
    batches as fast as it can, or 'trains' step_s per batch. Returns totals."""
    (addresses, job, ranks, world, seq_len, mb, compression, seconds, step_s, warm_s, read_ahead, *layout) = args
    boundaries, packing, members = (list(layout) + [0])[:3] if layout else (False, "concat", 0)
    from feeder_client import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec

    out = {"tokens": 0, "batches": 0, "wait_s": 0.0, "busy_s": 0.0, "errors": [], "cpu_s": 0.0, "first": []}
    lock = threading.Lock()
    t_measure = [0.0]

    def go():  # runs once every rank has its first batch, before any is released
        t_measure[0] = time.monotonic() + warm_s

    start = threading.Barrier(len(ranks) + 1, action=go)

    def rank_loop(r):
        try:
            # members: every "rank" here is a member of rank 0 (a model-parallel rank's processes)
            who = dict(rank=0, member=r, members=members) if members else dict(rank=r)
            spec = StreamSpec(job=job, world_size=world, seq_len=seq_len, micro_batch=mb, num_epochs=0,
                              compression=compression, seed=1, boundaries=boundaries, packing=packing, **who)
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
    minimal HTTP/2 reader (bench.h2count), which spends a third to a quarter of grpcio's CPU
    per byte, so the readers take fewer of the cores the servers they measure run on.
    "h2-discard": the same reader, the kernel dropping the message bodies it never looks at
    (MSG_TRUNC), so reading costs next to nothing: a stand-in for ranks on other hosts."""
    addresses, job, ranks, world, seq_len, mb, seconds, warm_s, reader, mixture, permutation = args
    from feeder.v1 import feeder_pb2 as pb

    from .h2count import count_stream

    out = {"tokens": 0.0, "bytes": 0, "total": 0, "errors": []}
    lock = threading.Lock()
    method = "/bench.Raw/Stream" if job is None else "/feeder.v1.Feeder/Stream"

    def request(r: int) -> bytes:
        if job is None:
            return b""
        return pb.StreamRequest(job=job, rank=r, world_size=world, seq_len=seq_len, micro_batch=mb, num_epochs=0,
                                seed=1, compression=pb.COMPRESSION_NONE,
                                mixture=[pb.MixtureSource(source=n, weight=w) for n, w in mixture],
                                permutation=permutation).SerializeToString()

    def per_byte(first: bytes) -> float:
        if job is None:
            return 0.5
        return sum(b.n * b.sample_len for b in pb.StreamReply.FromString(first).batches) / len(first)

    def with_h2(r) -> tuple[float, int, int]:
        got = count_stream(addresses[0], method, request(r), seconds=seconds, warm_s=warm_s,
                           discard=reader == "h2-discard")
        return got.bytes * per_byte(got.first), got.bytes, got.total

    def rank_loop(r):
        try:
            tokens, nbytes, total = (_count_with_grpcio(addresses[0], method, request(r), per_byte, seconds, warm_s)
                                    if reader == "grpcio" else with_h2(r))
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


def _count_with_grpcio(address: str, method: str, request: bytes, per_byte, seconds: float,
                       warm_s: float) -> tuple[float, int, int]:
    """One counting stream on a grpcio channel of its own, as a rank's client has: (tokens,
    bytes counted after the warm-up, all bytes read)."""
    import grpc

    ch = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20),
                                                 ("grpc.use_local_subchannel_pool", 1)])
    try:
        call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)(request)
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


READERS = ("grpcio", "h2", "h2-discard")   # see _drive_counting


class Clients:
    """A pool of client processes (spawned once: each imports torch). Each keeps freed memory
    as a rank's FeederClient makes its process do, from the start: the counting readers, the
    ranks and the local DataLoader all run with the same malloc settings."""

    def __init__(self, n: int = CLIENT_PROCS):
        self.pool = mp.get_context("spawn").Pool(n, initializer=keep_freed_memory)
        self.n = n

    def run(self, addresses, job, world, *, seq_len, mb, compression="none", seconds=4.0, step_s=0.0,
            ranks=None, warm_s=1.0, read_ahead=4, boundaries=False, packing="concat", members=0) -> dict:
        """`world` ranks (or just `ranks`) of FeederClients spread over the client processes,
        taking batches for `seconds` after a warm-up (`step_s`: a training step per batch):
        their totals, tokens/s and the share of time they waited for data. `boundaries`,
        `packing`: document-aware samples (the client then also makes position_ids and cu_seqlens).
        `members`: the ranks are instead that many members of rank 0 (model parallelism)."""
        ranks = list(range(world)) if ranks is None else ranks
        parts = [ranks[i::self.n] for i in range(self.n)]
        args = [(addresses, job, part, world, seq_len, mb, compression, seconds, step_s, warm_s, read_ahead,
                 boundaries, packing, members) for part in parts if part]
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

    def count(self, addresses, job, world, *, seq_len, mb, seconds=4.0, warm_s=1.0, reader="grpcio",
              mixture=(), permutation="torch") -> dict:
        """Aggregate tokens/s of `world` counting-only streams (see _drive_counting), and the
        readers' CPU seconds per GB taken (all client processes together). `mixture`: ((name,
        weight), ...) to stream a mixture of the feeder's named sources."""
        if reader not in READERS:
            raise ValueError(f"reader {reader!r}: expected one of {', '.join(READERS)}")
        parts = [list(range(world))[i::self.n] for i in range(self.n)]
        results = self.pool.map(_drive_counting, [(addresses, job, p, world, seq_len, mb, seconds, warm_s, reader,
                                                   mixture, permutation) for p in parts if p])
        errors = [e for r in results for e in r["errors"]]
        if errors:
            raise RuntimeError(f"counting clients ({reader}) failed: {errors[:3]}")
        total = sum(r["total"] for r in results)   # all they read, warm-up included, as their CPU is
        cpu_s = sum(r["cpu_s"] for r in results)
        return {"tokens_s": sum(r["tokens"] for r in results) / seconds, "reader_cpu_s": cpu_s,
                "reader_cpu_s_per_gb": cpu_s / (total / 1e9) if total else None}

    def close(self):
        """Stop the client processes."""
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
    from feeder_client import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec

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

