"""The gRPC side of a client: channels, the Stream call, health probes, reports, Info."""
from __future__ import annotations

import time

import grpc

from feeder.core.errors import FeederError, Unavailable
from feeder.service.security import ClientSecurity, explain
from feeder.service.convert import CODES
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc

PLAIN = ClientSecurity()


# The HTTP/2 receive window's bounds (see window_bytes).
MIN_WINDOW, MAX_WINDOW = 64 << 10, 64 << 20


def window_bytes(cfg) -> int:
    """The HTTP/2 stream window a rank announces: its read-ahead budget in bytes (max_read_ahead
    batches of micro_batch x (seq_len + 1) tokens, counted at 4 bytes a token), 64 KiB to 64 MiB.
    What the feeder has sent and the loop has not taken is then bounded by the read-ahead, not
    by gRPC: with its default window and BDP probing, 6 MiB (thousands of small batches) sat in
    a slow loop's receive window, and status took them for progress."""
    spec = cfg.spec
    return int(min(MAX_WINDOW, max(MIN_WINDOW, cfg.max_read_ahead * spec.micro_batch * (spec.seq_len + 1) * 4)))


def channel_options(cfg) -> list[tuple[str, int]]:
    """gRPC channel options for a ClientConfig: keepalive, and a receive window of the
    read-ahead budget (window_bytes)."""
    return [
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.lookahead_bytes", window_bytes(cfg)),
        # BDP probing grows the window past lookahead_bytes as throughput allows (to ~6 MiB on
        # loopback): off, so the window stays the read-ahead budget.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.enable_retries", 0),  # streams are resumed from the cursor, not retried by gRPC
        # Each client gets its own connection: ranks in one process must not share (and stall) one.
        ("grpc.use_local_subchannel_pool", 1),
    ]


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


class Transport:
    """One channel per target, made on first use and kept until close()."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.channels: dict[str, grpc.Channel] = {}

    def channel(self, target: str) -> grpc.Channel:
        ch = self.channels.get(target)
        if ch is None:
            ch = self.channels[target] = self.cfg.security.channel(target, options=channel_options(self.cfg))
        return ch

    def stub(self, target: str) -> pb_grpc.FeederStub:
        return pb_grpc.FeederStub(self.channel(target))

    def open(self, stub: pb_grpc.FeederStub, request: pb.StreamRequest):
        """The Stream call: iterate it for replies; cancel() ends it."""
        return stub.Stream(request, wait_for_ready=False, metadata=self.cfg.security.metadata())

    def rtt(self, target: str, probes: int = 3, timeout: float = 3.0) -> float:
        return measure_rtt(self.channel(target), probes=probes, timeout=timeout)

    def report(self, stub: pb_grpc.FeederStub, request: pb.ReportRequest) -> None:
        """Best effort: reporting must not hurt the data path."""
        try:
            stub.Report(request, timeout=2, metadata=self.cfg.security.metadata())
        except (grpc.RpcError, ValueError):   # ValueError: the channel closed under it (close())
            pass

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


def feeder_info(targets, dataset: str = "", timeout: float = 10.0, security: ClientSecurity = PLAIN) -> pb.InfoReply:
    """Dataset facts (fingerprint, vocab size, region, peers, ...) from the first feeder that answers.

    Args:
        targets: "HOST:PORT" or a list of them, asked in order.
        dataset: the dataset's name on a feeder serving several ("": its default).
        timeout: seconds per feeder.
        security: TLS and bearer token (as the stream's).

    Raises:
        FeederError: at once, with the feeder's code, when a feeder refuses the credentials
            (UNAUTHENTICATED, PERMISSION_DENIED).
        Unavailable: when no feeder answers (the last one's reason in the message).

    Threads and processes: a blocking call with a channel of its own, closed on return; call
    it from any thread (the reference trainer calls it on every rank and keeps rank 0's
    fingerprint, which every rank then expects).
    """
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
