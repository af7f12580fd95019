"""FeederClient: one rank's stream of batches, with bounded read-ahead and failover.

A background thread reads the gRPC stream, decodes each batch into torch tensors and puts
it in a queue of at most `read_ahead` batches. When a stream breaks (feeder killed,
connection reset, feeder silent past `idle_timeout_s`), the thread reopens it on the next
target from the cursor of the last batch it queued, so the consumer sees every batch once,
in order, and never an error for a failure another feeder can cover.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import google_crc32c
import grpc
import numpy as np
import torch

from feeder.config import StreamSpec
from feeder.errors import COMPLETE, ELSEWHERE, END, Code, FeederError, Unavailable
from feeder.malloc import keep_freed_memory
from feeder.security import ClientSecurity, explain
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc

log = logging.getLogger("client")

DTYPES = {pb.DTYPE_UINT16: np.dtype("<u2"), pb.DTYPE_UINT32: np.dtype("<u4")}
COMPRESSION = {"": pb.COMPRESSION_UNSPECIFIED, "none": pb.COMPRESSION_NONE, "zstd": pb.COMPRESSION_ZSTD}
# Failures another feeder (or the same one, later) can cover; anything else is the
# caller's mistake or corrupt data, and is raised.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.RESOURCE_EXHAUSTED}
PLAIN = ClientSecurity()
_LOCAL = threading.local()


def _zstd():
    """zstandard's decompressor (~30% faster than pyarrow's codec on 32 KB batches here);
    one per thread, as a ZstdDecompressor must not be shared between threads."""
    d = getattr(_LOCAL, "zstd", None)
    if d is None:
        import zstandard

        d = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return d


CODES = {s: c for c in Code for s in grpc.StatusCode if s.name == c.name}


@dataclass(frozen=True, slots=True)
class FeederBatch:
    tokens: torch.Tensor      # int64 [n, seq_len + 1]
    sample_ids: torch.Tensor  # int64 [n]
    epoch: int
    step: int
    cursor: bytes             # pass as cursor= to resume right after this batch
    region: str = ""


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    targets: tuple[str, ...]
    spec: StreamSpec
    cursor: bytes | None = None
    read_ahead: int = 8               # batches decoded ahead of the consumer
    idle_timeout_s: float = 30.0      # a feeder silent this long while we wait is abandoned
    keepalive_s: float = 10.0         # HTTP/2 pings detect a dead link within keepalive + timeout
    keepalive_timeout_s: float = 5.0
    retry_for_s: float = 300.0        # give up after failing this long without a batch
    report_every_s: float = 5.0
    # After a failover, look this often for a more preferred feeder that answers again, and
    # move back to it (resuming from the cursor): a rank does not stay on a far region for
    # weeks because its own region once restarted. 0: never.
    failback_s: float = 60.0
    security: ClientSecurity = PLAIN  # TLS, client certificate, bearer token
    regions: tuple[str, ...] = ()     # names of targets, in the same order (for logs; the feeder says too)
    prefer: str = "rtt"               # "rtt": nearest first (measured); "order": as given
    # Read-ahead grows past read_ahead to cover the round trip at the rate the loop takes batches,
    # so a far region keeps the loop fed; at most this many batches.
    max_read_ahead: int = 64
    # Decode tokens straight into page-locked memory, so `.to("cuda", non_blocking=True)` is a
    # true asynchronous copy. None: when CUDA is available (never in a DataLoader worker).
    pin_memory: bool | None = None
    # Let this process's malloc reuse freed multi-MiB buffers (feeder.malloc): gRPC's receive
    # buffers and messages otherwise come from fresh pages, faulted in one by one (~30 % of
    # the client's CPU per byte). Process-wide; False leaves malloc as it is.
    keep_freed_memory: bool = True

    def __post_init__(self):
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise FeederError(f"targets must be a non-empty list of HOST:PORT strings, got {self.targets!r}",
                              code=Code.INVALID_ARGUMENT)
        if self.read_ahead < 1:
            raise FeederError(f"read_ahead must be >= 1, got {self.read_ahead}", code=Code.INVALID_ARGUMENT)
        if self.prefer not in ("rtt", "order"):
            raise FeederError(f"prefer must be 'rtt' or 'order', got {self.prefer!r}", code=Code.INVALID_ARGUMENT)
        if self.regions and len(self.regions) != len(self.targets):
            raise FeederError(f"regions names {len(self.regions)} targets but there are {len(self.targets)}",
                              code=Code.INVALID_ARGUMENT)
        if self.pin_memory and not torch.cuda.is_available():
            raise FeederError("pin_memory=True needs CUDA, and torch finds no GPU here; leave it unset "
                              "(None) to pin only where there is one", code=Code.INVALID_ARGUMENT)


def channel_options(cfg: ClientConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.lookahead_bytes", 4 << 20),
        ("grpc.enable_retries", 0),  # streams are resumed from the cursor, not retried by gRPC
        # Each client gets its own connection: ranks in one process must not share (and stall) one.
        ("grpc.use_local_subchannel_pool", 1),
    ]


def pinned(n: int, sample_len: int) -> torch.Tensor:
    """A page-locked int64 [n, sample_len] tensor to decode into.
    torch's caching host allocator is the pool: it hands a freed block out again only once
    the copies that read it have finished. The trainer's `.to(device, non_blocking=True)` is
    then a true asynchronous copy, and no batch is copied once more to pin it (as
    DataLoader(pin_memory=True) does)."""
    return torch.empty((n, sample_len), dtype=torch.int64, pin_memory=True)


def decode(b: pb.Batch, region: str = "",
           alloc: Callable[[int, int], torch.Tensor] | None = None) -> FeederBatch:
    """One batch's tensors. The tokens are widened from the reply into their int64 tensor in
    one pass: into a fresh array, or into the one `alloc(n, sample_len)` gives (`pinned`)."""
    dtype = DTYPES.get(b.dtype)
    if dtype is None:
        raise FeederError(f"batch has unknown dtype {b.dtype}", code=Code.DATA_LOSS)
    if b.compression == pb.COMPRESSION_ZSTD:
        raw = _zstd().decompress(b.tokens, max_output_size=b.raw_size)
    else:
        raw = b.tokens
    if google_crc32c.value(raw) != b.crc32c:
        raise FeederError(f"batch epoch {b.epoch} step {b.step} failed its crc32c check", code=Code.DATA_LOSS)
    if len(raw) != b.n * b.sample_len * dtype.itemsize:
        raise FeederError(f"batch epoch {b.epoch} step {b.step} has {len(raw)} bytes of tokens, expected "
                          f"{b.n} samples x {b.sample_len} tokens x {dtype.itemsize} bytes", code=Code.DATA_LOSS)
    src = np.frombuffer(raw, dtype=dtype).reshape(b.n, b.sample_len)
    if alloc is None:   # numpy's astype: half the cost of a fresh torch.empty, whose pages fault in
        tokens = torch.from_numpy(src.astype(np.int64))
    else:
        tokens = alloc(b.n, b.sample_len)
        np.copyto(tokens.numpy(), src)
    ids = torch.from_numpy(np.frombuffer(b.sample_ids, dtype="<i8").astype(np.int64))
    return FeederBatch(tokens=tokens, sample_ids=ids, epoch=b.epoch, step=b.step, cursor=b.cursor, region=region)


_END = object()


class Incomplete(Exception):
    """A stream closed with status OK but without the feeder's end marker."""


class Handoff:
    """The bounded FIFO between the stream thread and the training loop. The stream thread
    adds runs of batches and the loop wakes it only once the queue is down to half, so the two
    threads trade the GIL once per run, not once per batch (per-batch hand-offs cost ~80 us a
    batch, more than decoding it). The end of the stream or an error stays at the head, so
    every later take sees it too."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: deque = deque()
        self.cv = threading.Condition()

    def put_many(self, items: list, stop: threading.Event) -> bool:
        i = 0
        with self.cv:
            while i < len(items):
                room = self.capacity - len(self.items)
                if room <= 0:
                    if stop.is_set():
                        return False
                    self.cv.wait(0.2)
                    continue
                self.items.extend(items[i:i + room])
                i += room
                self.cv.notify_all()
        return True

    def get(self):
        with self.cv:
            while not self.items:
                self.cv.wait()
            item = self.items[0]
            if item is _END or isinstance(item, BaseException):
                return item
            self.items.popleft()
            if len(self.items) <= self.capacity // 2:
                self.cv.notify_all()
            return item

    def resize(self, capacity: int) -> None:
        with self.cv:
            self.capacity = capacity
            self.cv.notify_all()

    def clear(self) -> None:
        with self.cv:
            self.items.clear()
            self.cv.notify_all()


def rtt_step(rtt_s: float) -> float:
    if rtt_s == float("inf"):
        return rtt_s
    return math.floor(math.log(max(rtt_s, 2e-3) / 2e-3, 1.5))


def measure_rtt(channel: grpc.Channel, probes: int = 3, timeout: float = 3.0) -> float:
    """Round-trip time to a feeder in seconds (inf when it does not answer): the fastest of
    a few health checks after the first, which also pays for connecting and the handshake."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    best = float("inf")
    try:
        stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        for _ in range(probes - 1):
            t0 = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            best = min(best, time.perf_counter() - t0)
    except (grpc.RpcError, ValueError):   # ValueError: the channel was closed
        return float("inf")
    return best


class FeederClient:
    """Iterate to get one rank's batches. Create it in the process that uses it (after fork)."""

    def __init__(self, cfg: ClientConfig):
        self.cfg = cfg
        if cfg.keep_freed_memory:
            keep_freed_memory()
        self.cursor = cfg.cursor          # of the last batch queued (where a reopened stream starts)
        self._phase = cfg.spec.worker_phase   # round-robin index of the batch after self.cursor
        self.region = ""                  # the region feeding this rank now (from the feeder's replies)
        self.targets = list(cfg.targets)  # nearest first once measured
        self.rtt_s: dict[str, float] = {}
        self.target_index = 0
        self.failovers = 0
        self._refused: dict[str, FeederError] = {}
        self._step_ema: float | None = None
        self._taken = 0
        self.failbacks = 0
        self._failback: int | None = None   # index of the nearer target to move back to
        self._failback_checked = time.monotonic()
        self.wait_s = 0.0                 # time the consumer spent waiting in __next__
        self._q = Handoff(cfg.read_ahead)
        # Without CUDA, numpy's allocator: a pool of reused arrays was measured here and was no
        # faster (its freed blocks are reused already).
        self._alloc = pinned if (torch.cuda.is_available() if cfg.pin_memory is None else cfg.pin_memory) else None
        # The device of the thread that made this client (a rank's own GPU): the stream thread
        # pins on it too, rather than open a context on GPU 0 (as DataLoader's pin thread does).
        self._device = torch.cuda.current_device() if self._alloc is not None else None
        self._stop = threading.Event()
        self._call = None
        self._lock = threading.Lock()
        self._waiting_since: float | None = None
        self._idle_cancelled = False
        self._channels: dict[str, grpc.Channel] = {}
        self._report = [0.0, 0.0, 0, time.monotonic()]  # wait, step, batches, since
        self._last_next = None
        self._position: tuple[int, int] | None = None   # (epoch, step) of the last batch taken
        self._after_break = False
        self._stub = None
        self._report_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"feeder-client-r{cfg.spec.rank}", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="feeder-client-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    # consumer side
    def __iter__(self):
        return self

    def __next__(self) -> FeederBatch:
        t0 = time.monotonic()
        item = self._q.get()
        t1 = time.monotonic()
        self.wait_s += t1 - t0
        if self._last_next is not None:
            step = t1 - self._last_next
            with self._report_lock:
                r = self._report
                r[0] += t1 - t0
                r[1] += step
                r[2] += 1
            self._step_ema = step if self._step_ema is None else 0.8 * self._step_ema + 0.2 * step
        self._last_next = t1
        self._taken += 1
        if self._taken % 8 == 0:
            self._size_read_ahead()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        self._position = (item.epoch, item.step)
        return item

    def _size_read_ahead(self) -> None:
        """Enough batches in hand to ride out 2.5 round trips (a reopened stream, jitter, a slow
        message) at the rate the loop takes them: a far region then feeds as if it were near.
        On a near link this stays at read_ahead: a deeper queue only costs cache and memory."""
        step, rtt = self._step_ema, self.rtt_s.get(self.target, 0.0)
        if not step or rtt == float("inf"):
            return
        want = min(self.cfg.max_read_ahead, max(self.cfg.read_ahead, int(2.5 * rtt / max(step, 1e-5)) + 2))
        if want != self._q.capacity:
            self._q.resize(want)

    @property
    def target(self) -> str:
        """The feeder this rank streams from now (or will try next)."""
        return self.targets[self.target_index % len(self.targets)]

    @property
    def read_ahead(self) -> int:
        return self._q.capacity

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._q.clear()  # unblock a reader waiting for room
        self._thread.join(5)
        if self._watchdog.ident is not None:   # it may be mid-report: let it finish before its channel goes
            self._watchdog.join(5)
        for ch in self._channels.values():
            ch.close()

    def __del__(self):
        try:
            self._stop.set()
        except Exception:
            pass

    # reader side
    def _request(self, target: str) -> pb.StreamRequest:
        s = self.cfg.spec
        return pb.StreamRequest(
            job=s.job, rank=s.rank, world_size=s.world_size, seq_len=s.seq_len, micro_batch=s.micro_batch,
            seed=s.seed, shuffle=s.shuffle, drop_last=s.drop_last, epoch=s.epoch, num_epochs=s.num_epochs,
            cursor=self.cursor or b"", compression=COMPRESSION[s.compression],
            compression_level=s.compression_level, worker_index=s.worker_index, num_workers=s.num_workers,
            worker_phase=self._phase,
            reshard=s.reshard and self.cursor == self.cfg.cursor, expected_fingerprint=s.expected_fingerprint,
            dataset=s.dataset, failover=self._after_break, bad_records=s.bad_records,
            rtt_us=min(int(rtt * 1e6), 2**32 - 1) if (rtt := self.rtt_s.get(target, 0.0)) != float("inf") else 0)

    def _channel(self, target: str) -> grpc.Channel:
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = self.cfg.security.channel(target, options=channel_options(self.cfg))
        return ch

    def _put(self, item) -> bool:
        return self._q.put_many([item], self._stop)

    def _hand(self, batches: list) -> bool:
        """Queue decoded batches; the stream resumes after the last one queued, and a worker's
        stream with the batch after its own in the round-robin."""
        if not self._q.put_many(batches, self._stop):
            return False
        self.cursor = batches[-1].cursor
        s = self.cfg.spec
        self._phase = (s.worker_index + 1) % s.num_workers
        return True

    def _order_targets(self) -> None:
        """Nearest first: every target's RTT measured at once (unreachable ones go last). The
        RTT also sizes read-ahead and tells the feeder whether this rank is remote."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.targets)) as ex:
            rtts = list(ex.map(lambda t: measure_rtt(self._channel(t)), self.targets))
        self.rtt_s = dict(zip(self.targets, rtts))
        if self.cfg.prefer == "rtt":
            # Stable sort on RTT in steps of 1.5x above 2 ms: feeders of one datacenter (or
            # about equally far) keep the order given, a clearly nearer region goes first.
            self.targets.sort(key=lambda t: rtt_step(self.rtt_s[t]))
        names = dict(zip(self.cfg.targets, self.cfg.regions or self.cfg.targets))
        log.info("rank %d targets, in order: %s", self.cfg.spec.rank, ", ".join(
            f"{names[t]} {self.rtt_s[t] * 1e3:.1f} ms" if self.rtt_s[t] != float("inf") else f"{names[t]} (down)"
            for t in self.targets))

    def _run(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        targets = self.targets
        failing_since: float | None = None
        last_error = ""
        attempt = 0
        self._order_targets()
        while not self._stop.is_set():
            target = targets[self.target_index % len(targets)]
            try:
                stub = self._stub = pb_grpc.FeederStub(self._channel(target))
                call = stub.Stream(self._request(target), wait_for_ready=False,
                                   metadata=self.cfg.security.metadata())
                with self._lock:
                    self._call, self._idle_cancelled = call, False
                got_any = False
                while True:
                    self._waiting_since = time.monotonic()
                    try:
                        reply = next(call)
                    except StopIteration:
                        if (END, COMPLETE) in tuple(call.trailing_metadata() or ()):
                            self._put(_END)
                            return
                        # OK but not complete: whatever closed the call, the rest of the
                        # stream is still owed; resume it from the cursor like any break.
                        raise Incomplete() from None
                    finally:
                        self._waiting_since = None
                    if reply.region != self.region:
                        log.info("rank %d fed by region %s (%s)", self.cfg.spec.rank, reply.region, target)
                        self.region = reply.region
                    # Decode in runs of up to half the read-ahead, handed over at once.
                    run, size = [], max(1, self._q.capacity // 2)
                    try:
                        for b in reply.batches:
                            run.append(decode(b, reply.region, self._alloc))
                            if len(run) >= size:
                                if not self._hand(run):
                                    return
                                run = []
                    finally:  # the good batches before a corrupt one are still delivered
                        if run and not self._hand(run):
                            return
                    if not got_any:
                        got_any, failing_since, attempt = True, None, 0
                        self._after_break = False
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                if self._failback is not None:  # ended by us, to move back to a nearer feeder
                    log.info("rank %d: %s answers again; moving back to it from %s", self.cfg.spec.rank,
                             targets[self._failback], target)
                    self.target_index, self._failback = self._failback, None
                    self.failbacks += 1
                    continue
                code = e.code()
                if any(k == ELSEWHERE for k, _ in e.trailing_metadata() or ()):
                    # This feeder cannot serve us (another replica, dataset not here); others may.
                    self._refused.setdefault(target, FeederError(f"feeder {target}: {e.details()}",
                                                                 code=CODES.get(code, Code.INTERNAL)))
                    if len(self._refused) == len(set(targets)):
                        self._put(next(iter(self._refused.values())))
                        return
                    log.error("feeder %s refused rank %d: %s; trying the next region", target,
                              self.cfg.spec.rank, e.details())
                    self._skip_refused(targets)
                    continue
                if code not in RETRYABLE:
                    self._put(FeederError(f"feeder {target}: {e.details()}", code=CODES.get(code, Code.INTERNAL)))
                    return
                why = ("silent past the idle timeout" if self._idle_cancelled
                       else explain(e, target, self.cfg.security).partition(": ")[2])
                last_error = f"{target}: {why}"
            except Incomplete:
                last_error = f"{target}: the stream ended without its end marker"
            except FeederError as e:  # corrupt batch: never served; another feeder may have good data
                last_error = f"{target}: {e}"
                if e.code != Code.DATA_LOSS:
                    self._put(e)
                    return
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since > self.cfg.retry_for_s:
                self._put(Unavailable(f"no feeder could serve rank {self.cfg.spec.rank} for "
                                      f"{self.cfg.retry_for_s:.0f}s; last error: {last_error}"))
                return
            self.target_index += 1
            self._skip_refused(targets)
            self.failovers += 1
            self._after_break = True
            attempt += 1
            log.warning("stream broke (%s); failing over to %s", last_error,
                        targets[self.target_index % len(targets)])
            if attempt >= len(targets):  # a whole round failed: back off before the next
                self._stop.wait(min(2.0, 0.05 * 2 ** min(attempt - len(targets), 6)))

    def _skip_refused(self, targets) -> None:
        """Move to the next target that has not refused this rank (there is one)."""
        for _ in range(len(targets)):
            if targets[self.target_index % len(targets)] not in self._refused:
                return
            self.target_index += 1

    def _watch(self) -> None:
        """Abandons a silent feeder, and reports data-wait to the feeder feeding us."""
        while not self._stop.wait(min(1.0, self.cfg.idle_timeout_s / 4, self.cfg.report_every_s)):
            if self._stub is not None:
                self._maybe_report(self._stub)
            self._maybe_fail_back()
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self.cfg.idle_timeout_s:
                with self._lock:
                    if self._call is not None and self._waiting_since == since:
                        self._idle_cancelled = True
                        self._call.cancel()

    def _maybe_fail_back(self) -> None:
        """On a less preferred target, every failback_s: if a more preferred one answers its
        health check, end the current stream so the reader reopens there from the cursor."""
        if not self.cfg.failback_s or self._failback is not None:
            return
        now = time.monotonic()
        current = self.target_index % len(self.targets)
        if current == 0 or now - self._failback_checked < self.cfg.failback_s:
            return
        self._failback_checked = now
        for i in range(current):
            t = self.targets[i]
            if t not in self._refused and measure_rtt(self._channel(t), probes=2, timeout=2.0) != float("inf"):
                with self._lock:
                    if self._call is not None and self.target_index % len(self.targets) == current:
                        self._failback = i
                        self._call.cancel()
                return

    def _maybe_report(self, stub) -> None:
        with self._report_lock:
            r = self._report
            if time.monotonic() - r[3] < self.cfg.report_every_s or r[2] == 0:
                return
            wait, step, n = r[0], r[1], r[2]
            self._report = [0.0, 0.0, 0, time.monotonic()]
        pos = self._position
        try:
            stub.Report(pb.ReportRequest(job=self.cfg.spec.job, rank=self.cfg.spec.rank, wait_s=wait,
                                         step_s=step, batches=n, has_position=pos is not None,
                                         epoch=pos[0] if pos else 0, step=pos[1] if pos else 0), timeout=2,
                        metadata=self.cfg.security.metadata())
        except (grpc.RpcError, ValueError):   # ValueError: the channel closed under it (close())
            pass  # reporting is best effort; the data path must not suffer for it


def feeder_info(targets, dataset: str = "", timeout: float = 10.0, security: ClientSecurity = PLAIN) -> pb.InfoReply:
    """Dataset facts (fingerprint, vocab size, peers, ...) from the first feeder that answers."""
    last = None
    for target in ([targets] if isinstance(targets, str) else targets):
        with security.channel(target) as ch:
            try:
                return pb_grpc.FeederStub(ch).Info(pb.InfoRequest(dataset=dataset), timeout=timeout,
                                                   metadata=security.metadata())
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise FeederError(f"feeder {target}: {e.details()}", code=CODES[e.code()]) from None
                last = explain(e, target, security)
    raise Unavailable(f"no feeder answered ({last})")
