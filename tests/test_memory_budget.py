"""Memory per held stream is bounded over the whole process (issue 44.5): one peer opening 50,
100, 200 streams and never reading past the first reply grew the feeder by ~10.7 MB a stream;
now every stream together holds at most --memory-budget-mb built ahead (past 3/4 of it each
stream queues one message), new streams past all of it are refused with RESOURCE_EXHAUSTED
saying what to do, and another job is served throughout. A real `feeder serve`, small messages."""
from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import psutil
import pytest

from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc
from tests.helpers import FeederProc

pytestmark = pytest.mark.fault
SEQ, MB = 255, 4   # 2 KiB batches; messages of up to 64 KiB, up to 64 of them per stream


def request(job: str) -> pb.StreamRequest:
    return pb.StreamRequest(job=job, rank=0, world_size=1, seq_len=SEQ, micro_batch=MB, num_epochs=0,
                            compression=pb.COMPRESSION_NONE)


def rss_mb(feeder: FeederProc) -> float:
    return psutil.Process(feeder.proc.pid).memory_info().rss / 2**20


def settled_rss_mb(feeder: FeederProc, limit_s: float = 10.0) -> float:
    """The feeder's RSS once the streams' producers stopped filling their queues (two
    successive looks 0.3 s apart within 1 MB of it)."""
    deadline, seen = time.monotonic() + limit_s, [rss_mb(feeder)]
    while time.monotonic() < deadline:
        time.sleep(0.3)
        seen.append(rss_mb(feeder))
        if len(seen) >= 3 and max(seen[-3:]) - min(seen[-3:]) < 1.0:
            break
    return seen[-1]


class Reader:
    """Another job's stream, read all along on its own connection: when each reply came."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.call = pb_grpc.FeederStub(self.channel).Stream(request("other-team"))
        self.times: list[float] = []
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for reply in self.call:
                self.times.append(time.monotonic())
                time.sleep(0.02)   # a training loop's pace, not a tight loop on 2 cores
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e

    def served_since(self, t: float, n: int = 5, within_s: float = 10.0) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.error is None and sum(1 for x in self.times if x >= t) >= n:
                return True
            time.sleep(0.05)
        return False

    def close(self):
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()


def hold(stub, jobs: list[str]) -> list:
    """Streams opened together and each read to its first reply, then never read again."""
    calls = [stub.Stream(request(job)) for job in jobs]
    for call in calls:
        next(call)
    return calls


def test_200_streams_held_unread_by_one_peer_stay_within_the_budget_and_another_job_is_served(dataset):
    feeder = FeederProc(dataset, extra=["--message-bytes", "65536", "--prefetch-messages", "64",
                                        "--memory-budget-mb", "32"])
    reader, held = Reader(feeder.address), []
    peer = grpc.insecure_channel(feeder.address)   # one peer: every held stream on one connection
    stub = pb_grpc.FeederStub(peer)
    try:
        assert reader.served_since(0)
        rss = {}
        for total in (50, 100, 200):
            t = time.monotonic()
            held += hold(stub, [f"held-{i}" for i in range(len(held), total)])
            rss[total] = settled_rss_mb(feeder)
            assert reader.served_since(t), f"the other job got nothing while {total} streams were held"
        print(f"feeder RSS with 50/100/200 streams held: {rss[50]:.0f} / {rss[100]:.0f} / {rss[200]:.0f} MB")
        assert rss[200] <= 1.8 * rss[50], rss
        assert reader.error is None
        with grpc.insecure_channel(feeder.address) as ch:
            st = pb_grpc.FeederStub(ch).Status(pb.StatusRequest(), timeout=10)
        assert st.streams_open == 201
    finally:
        for call in held:
            call.cancel()
        peer.close()
        reader.close()
        feeder.stop()


def test_past_the_budget_new_streams_are_refused_with_what_to_do_and_open_ones_keep_their_service(dataset):
    feeder = FeederProc(dataset, extra=["--message-bytes", "65536", "--prefetch-messages", "64",
                                        "--memory-budget-mb", "1", "--metrics-port", "0"])
    reader, held = Reader(feeder.address), []
    peer = grpc.insecure_channel(feeder.address)
    stub = pb_grpc.FeederStub(peer)
    try:
        assert reader.served_since(0)
        refused = None
        for i in range(200):
            try:
                held += hold(stub, [f"held-{i}"])
            except grpc.RpcError as e:
                refused = e
                break
            time.sleep(0.01)   # (the producers fill what they may)
        assert refused is not None, "200 streams held within a 1 MiB budget"
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "memory budget" in refused.details() and "--memory-budget-mb" in refused.details()
        assert reader.served_since(time.monotonic()), "the open stream of another job lost its service"
        metrics = urllib.request.urlopen(f"http://{feeder.metrics}/metrics", timeout=10).read().decode()
        assert "feeder_memory_budget_refused_total 1.0" in metrics and "feeder_memory_budget_bytes 1.048576e+06" in metrics
        # Streams let go give their room back: new streams are served again.
        for call in held:
            call.cancel()
        time.sleep(0.5)
        assert next(stub.Stream(request("after"), timeout=10)).batches
    finally:
        for call in held:
            call.cancel()
        peer.close()
        reader.close()
        feeder.stop()


def test_the_budget_shrinks_read_aheads_past_half_refuses_past_all_and_wakes_a_few_at_a_time():
    from feeder.core.config import StreamSpec
    from feeder.core.errors import ResourceExhausted
    from feeder.pipeline.stream import WAKE_AT_ONCE, MemoryBudget

    b, woken = MemoryBudget(100), []
    b.charge(40)
    assert b.more(10) and not b.more(11)          # past half: no second message
    b.charge(60)
    with pytest.raises(ResourceExhausted, match="--memory-budget-mb"):
        b.admit(StreamSpec(job="j", rank=0, world_size=1, seq_len=1, micro_batch=1))
    assert b.refused == 1
    for i in range(10):
        b.wait(lambda i=i: woken.append(i))
    b.release(10)                                  # 90 held: no room, nobody asked again
    assert woken == []
    b.release(60)                                  # 30 held: the ones held back longest, a few
    assert woken == list(range(WAKE_AT_ONCE))
    b.charge(5)                                    # 35: room left, the next one is asked
    assert woken == list(range(WAKE_AT_ONCE + 1))
