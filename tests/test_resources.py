"""Bounded resources under misbehaving peers: a reader that stops, thousands of abrupt cancels."""
from __future__ import annotations

import time

import grpc
import psutil
import pytest

from feeder.core.tool_config import PrepConfig
from feeder.ops.prep import prep
from feeder.ops.status import fetch
from feeder.v1 import feeder_pb2 as pb
from feeder.v1 import feeder_pb2_grpc as pb_grpc
from tests.test_faults import FeederProc

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory):
    """~64 M tokens: far more than any budget, so a leak or an unbounded queue would show."""
    root = tmp_path_factory.mktemp("big")
    line = ('{"text": "' + "tokens for the feeder to stream " * 120 + '"}\n').encode()
    with open(root / "big.jsonl", "wb") as f:
        for _ in range(64_000_000 // len(line)):
            f.write(line)
    prep(PrepConfig(inputs=(str(root / "big.jsonl"),), out=str(root / "ds"), progress=False))
    return root / "ds"


def rss_mb(proc: FeederProc) -> float:
    return psutil.Process(proc.proc.pid).memory_info().rss / 2**20


def anon_rss_mb(proc: FeederProc) -> float:
    """Resident anonymous memory: what a leak grows. File-backed pages of the memory-mapped
    shards also count in RSS, but they are page cache the kernel reclaims at will."""
    with open(f"/proc/{proc.proc.pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) / 1024


def test_paused_reader_keeps_feeder_memory_within_the_prefetch_budget(big_dataset):
    feeder = FeederProc(big_dataset)
    try:
        budget_mb = 32  # --prefetch-bytes default
        # The client's own channel settings, pinging every 5 s: over the pause below nothing
        # flows, so a server that did not accept those pings would answer GOAWAY too_many_pings.
        from feeder_client.stream import ClientConfig, channel_options
        from feeder.core.config import StreamSpec

        opts = channel_options(ClientConfig(targets=(feeder.address,), keepalive_s=5, spec=StreamSpec(
            job="x", rank=0, world_size=1, seq_len=1, micro_batch=1)))
        ch = grpc.insecure_channel(feeder.address, options=opts)
        stub = pb_grpc.FeederStub(ch)
        list(stub.Stream(pb.StreamRequest(job="warm", rank=0, world_size=64, seq_len=512, micro_batch=4,
                                          num_epochs=1, compression=pb.COMPRESSION_NONE), timeout=60))
        base = rss_mb(feeder)
        call = stub.Stream(pb.StreamRequest(job="paused", rank=0, world_size=1, seq_len=2048, micro_batch=64,
                                            num_epochs=1, compression=pb.COMPRESSION_NONE))
        next(call)
        peak = base
        for _ in range(60):  # the reader takes nothing for 60 s (issue 4's criterion)
            time.sleep(1)
            peak = max(peak, rss_mb(feeder))
        assert peak - base < budget_mb + 100, f"feeder RSS grew {peak - base:.0f} MB while the reader paused"
        st = fetch(feeder.address)
        rank = st.jobs[[j.job for j in st.jobs].index("paused")].ranks[0]
        assert rank.connected and rank.queue_depth <= 8
        assert next(call).batches  # the same stream goes on after 60 s of keepalive pings and no data
        call.cancel()
        ch.close()
    finally:
        feeder.stop()


@pytest.mark.parametrize("auth", [False, True], ids=["plain", "token-interceptor"])
def test_a_thousand_abrupt_cancels_leave_nothing_behind(big_dataset, auth, tmp_path):
    # With tokens every call also passes the auth interceptor, which wraps the streaming
    # handler (interceptors on aio streams have leaked before: grpc#25449).
    from feeder.service.security import ClientSecurity

    extra, sec = [], ClientSecurity()
    if auth:
        (tmp_path / "tokens.toml").write_text('[[token]]\njobs = ["*"]\ntoken = "storm-token"\n')
        extra, sec = ["--tokens-file", str(tmp_path / "tokens.toml")], ClientSecurity(token="storm-token")
    feeder = FeederProc(big_dataset, extra=extra)
    try:
        def storm(count):
            for i in range(count // 50):
                chans = [grpc.insecure_channel(feeder.address, options=[("grpc.use_local_subchannel_pool", 1)])
                         for _ in range(50)]
                calls = [pb_grpc.FeederStub(c).Stream(pb.StreamRequest(
                    job=f"storm{i}", rank=k, world_size=50, seq_len=1024, micro_batch=8, num_epochs=1),
                    metadata=sec.metadata())
                    for k, c in enumerate(chans)]
                for c in calls:
                    next(c)          # streaming for real...
                for ch in chans:
                    ch.close()       # ...then the peer vanishes without a word

        storm(100)  # warm up the allocator, thread pool and caches
        time.sleep(2)
        base_rss, base_anon, base = rss_mb(feeder), anon_rss_mb(feeder), fetch(feeder.address, security=sec)
        storm(1000)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = fetch(feeder.address, security=sec)
            if st.streams_open == 0 and st.tasks <= base.tasks:
                break
            time.sleep(0.5)
        assert st.streams_open == 0
        assert st.tasks <= base.tasks, f"{st.tasks - base.tasks} asyncio tasks leaked"
        assert st.threads <= base.threads
        growth, mapped = anon_rss_mb(feeder) - base_anon, rss_mb(feeder) - base_rss
        assert growth < 20, f"anonymous RSS grew {growth:.1f} MB over 1000 abrupt cancels (RSS {mapped:.1f} MB)"
        print(f"1000 abrupt cancels ({'with' if auth else 'without'} the auth interceptor): anonymous RSS {growth:+.1f} MB, RSS incl. mapped shard pages {mapped:+.1f} MB")
    finally:
        feeder.stop()
