"""WAN: ranks reach feeders through a latency / bandwidth / fault proxy (Toxiproxy, or the
user-space proxy where Go is absent). Data-wait is measured the way a trainer feels it: time
spent in next() between steps, after the first batch."""
from __future__ import annotations

import signal
import time

import pytest

from feeder_client import FeederDataset
from feeder.ops.status import fetch
from tests.helpers import FeederProc, byte_stream, check_batches, expected_ids, make_docs, prep_docs, sample
from feeder_bench.wanproxy import PyProxies, start_proxies

pytestmark = pytest.mark.wan
FEEDER_FLAGS = ["--message-bytes", "1048576", "--prefetch-messages", "8"]


@pytest.fixture(scope="module")
def wan_docs():
    return make_docs(2500, seed=7, max_words=150)


@pytest.fixture(scope="module")
def wan_stream(wan_docs):
    return byte_stream(wan_docs)


@pytest.fixture(scope="module")
def wan_dataset(tmp_path_factory, wan_docs):
    return prep_docs(tmp_path_factory.mktemp("wan"), wan_docs, shard_tokens=400_000, chunk_tokens=100_000)


@pytest.fixture(scope="module")
def proxies():
    p = start_proxies()
    yield p
    p.close()


def train(ds, steps: int, step_s: float):
    """Take `steps` batches, 'training' step_s on each; returns (batches, data-wait fraction
    after the first batch, seconds to the first batch)."""
    it = iter(ds)
    t0 = time.monotonic()
    got = [next(it)]
    t_first = time.monotonic()
    waited = 0.0
    for _ in range(steps - 1):
        time.sleep(step_s)
        a = time.monotonic()
        got.append(next(it))
        waited += time.monotonic() - a
    time.sleep(step_s)
    total = time.monotonic() - t_first
    ds.client.close()
    return got, waited / total, t_first - t0


def check_prefix(got, stream, seq_len, rank, world, seed):
    """The batches are the start of the rank's endless stream: epoch 0, 1, ... in order."""
    want, epoch, n = [], 0, sum(len(b.sample_ids) for b in got)
    while len(want) < n:
        want += expected_ids(stream, rank, world, seq_len, seed, epoch=epoch)
        epoch += 1
    check_batches(got, stream, seq_len, want[:n])


def test_150ms_rtt_with_jitter_keeps_a_16k_token_step_fed(wan_dataset, wan_stream, proxies):
    feeder = FeederProc(wan_dataset, extra=[*FEEDER_FLAGS, "--compression", "none", "--region", "far"])
    link = proxies.proxy(feeder.address)
    link.latency(150, jitter_ms=20)
    try:
        seq_len, mb = 2048, 8  # 16 k tokens per step
        ds = FeederDataset([link.listen], job="wan-rtt", rank=0, world_size=1, seq_len=seq_len, micro_batch=mb,
                           seed=2, num_epochs=0, read_ahead=2, keepalive_s=5)
        got, wait, ttfb = train(ds, steps=40, step_s=0.2)
        print(f"[{proxies.kind}] 150 ms RTT: data-wait {100 * wait:.2f}% after the first batch (ttfb {ttfb:.2f}s), "
              f"rtt measured {ds.client.rtt_s[link.listen] * 1e3:.0f} ms, read-ahead {ds.client.read_ahead}")
        assert wait < 0.01
        check_prefix(got, wan_stream, seq_len, 0, 1, 2)
        assert 0.12 < ds.client.rtt_s[link.listen] < 0.5
        assert ds.client.read_ahead > 2  # sized from RTT and step time, past what was asked
        assert ds.client.failovers == 0  # no GOAWAY (too_many_pings) nor anything else over ~9 s
        # Left to choose, the remote rank got zstd although this feeder's default is none.
        rank = fetch(feeder.address, "wan-rtt").jobs[0].ranks[0]
        assert rank.bytes_sent < 0.5 * 2 * rank.tokens_sent
    finally:
        feeder.stop()


def test_2mb_s_link_compression_keeps_the_rank_fed_where_raw_tokens_do_not(wan_dataset, wan_stream, proxies):
    feeder = FeederProc(wan_dataset, extra=[*FEEDER_FLAGS, "--region", "thin"])
    link = proxies.proxy(feeder.address)
    link.latency(40)
    link.bandwidth(2048)  # 2 MB/s toward the rank
    try:
        seq_len, mb, steps, step_s = 2048, 8, 150, 0.01  # 16 k tokens per 10 ms: 3.2 MB/s as uint16
        waits = {}
        for compression in ("", "none"):  # "": the feeder's choice for a remote rank (zstd)
            ds = FeederDataset([link.listen], job=f"wan-bw-{compression or 'auto'}", rank=0, world_size=1,
                               seq_len=seq_len, micro_batch=mb, seed=4, num_epochs=0, compression=compression)
            got, waits[compression or "zstd"], _ = train(ds, steps, step_s)
            check_prefix(got, wan_stream, seq_len, 0, 1, 4)
        print(f"[{proxies.kind}] 2 MB/s: data-wait zstd {100 * waits['zstd']:.1f}%, none {100 * waits['none']:.1f}%")
        assert waits["zstd"] < 0.05
        assert waits["none"] > 0.2  # 3.2 MB/s of raw tokens cannot cross 2 MB/s
    finally:
        feeder.stop()


def test_connection_reset_and_blackhole_fail_over_and_resume_exactly(wan_dataset, wan_stream, proxies):
    feeders = [FeederProc(wan_dataset, extra=[*FEEDER_FLAGS, "--region", r]) for r in ("a", "b")]
    links = [proxies.proxy(f.address) for f in feeders]
    for link in links:
        link.latency(60, jitter_ms=10)
    try:
        seq_len, mb, world, rank, seed = 256, 8, 2, 1, 6
        # An endless stream: a fault must land while data is still to come (a whole epoch
        # fits in the HTTP/2 window and the proxy's buffers).
        ds = FeederDataset({"a": links[0].listen, "b": links[1].listen}, job="wan-faults", rank=rank,
                           world_size=world, seq_len=seq_len, micro_batch=mb, seed=seed, prefer="order",
                           num_epochs=0, read_ahead=4, keepalive_s=1, idle_timeout_s=6, retry_for_s=60)
        got, regions, faults = [], [], []
        for k, b in enumerate(ds):
            got.append(b)
            regions.append(b.region)
            time.sleep(0.003)
            if k == 100:  # reset the link in use mid-stream
                links[0].reset()
                faults.append(("reset", k))
            if faults and faults[-1][0] == "reset" and b.region == "b" and k > 400:
                links[0].clear()  # region a's link is back for later
                links[1].blackhole()  # silent link: no RST, no FIN, nothing
                faults.append(("blackhole", k))
            if faults[-1:] and faults[-1][0] == "blackhole" and b.region == "a":
                links[1].clear()
                faults.append(("recovered", k))
            if len(faults) == 3 and k >= faults[-1][1] + 100:
                break
        ds.client.close()
        want, epoch = [], 0
        while len(want) < len(got) * mb:
            want += expected_ids(wan_stream, rank, world, seq_len, seed, epoch=epoch)
            epoch += 1
        want = want[:sum(len(b.sample_ids) for b in got)]
        check_batches(got, wan_stream, seq_len, want)
        assert [f[0] for f in faults] == ["reset", "blackhole", "recovered"], faults
        assert regions[0] == "a" and "b" in regions and regions[-1] == "a"
        # each fault moved the rank: a failover on the reset, and on the blackhole a failover (the
        # idle timeout) or, sooner, a move off a feeder that stopped delivering (client/gray.py)
        moves = ds.client.failovers + ds.client.policy.moves
        assert moves >= 2
        print(f"[{proxies.kind}] faults at batches {faults}, {ds.client.failovers} failovers and "
              f"{ds.client.policy.moves} moves, {len(got)} batches exact")
    finally:
        for f in feeders:
            f.stop()


def test_the_user_space_proxy_adds_the_latency_it_is_asked_for(wan_dataset):
    """The fallback for machines without Go: same toxics, checked against a real feeder."""
    p = PyProxies()
    feeder = FeederProc(wan_dataset)
    try:
        link = p.proxy(feeder.address)
        link.latency(100)
        ds = FeederDataset([link.listen], job="py-proxy", rank=0, world_size=1, seq_len=64, micro_batch=2)
        first = next(iter(ds))
        assert 0.09 < ds.client.rtt_s[link.listen] < 0.4
        assert sample(byte_stream(make_docs(2500, seed=7, max_words=150)), int(first.sample_ids[0]), 64).tolist() == \
            first.tokens[0].tolist()
        ds.client.close()
    finally:
        feeder.stop()
        p.close()


def test_the_nearest_region_feeds_the_rank_unless_the_order_is_asked_for(wan_dataset, proxies):
    feeders = {r: FeederProc(wan_dataset, extra=["--region", r]) for r in ("far", "near")}
    far = proxies.proxy(feeders["far"].address)
    far.latency(80)
    try:
        targets = {"far": far.listen, "near": feeders["near"].address}  # the far one given first
        for prefer, region in (("rtt", "near"), ("order", "far")):
            ds = FeederDataset(targets, job=f"pick-{prefer}", rank=0, world_size=1, seq_len=64, micro_batch=2,
                               prefer=prefer)
            b = next(iter(ds))
            assert b.region == ds.region == region
            assert ds.client.rtt_s[far.listen] > 0.07 > ds.client.rtt_s[feeders["near"].address]
            ds.client.close()
    finally:
        for f in feeders.values():
            f.stop()


def test_a_rank_moves_back_to_its_own_region_once_it_answers_again(wan_dataset, wan_stream, proxies):
    """After a failover to a far region, the rank returns to its own region when that one is
    back (failback), resuming exactly from its cursor both times."""
    near = FeederProc(wan_dataset, extra=["--region", "near"])
    far_feeder = FeederProc(wan_dataset, extra=["--region", "far"])
    far = proxies.proxy(far_feeder.address)
    far.latency(60)
    try:
        seq_len, mb, seed = 256, 8, 9
        ds = FeederDataset({"near": near.address, "far": far.listen}, job="failback", rank=0, world_size=1,
                           seq_len=seq_len, micro_batch=mb, seed=seed, num_epochs=0, read_ahead=4,
                           failback_s=1.0, retry_for_s=60)
        got, marks = [], []
        deadline = time.monotonic() + 60
        for k, b in enumerate(ds):
            got.append(b)
            time.sleep(0.002)
            if time.monotonic() > deadline:
                break
            if k == 50:
                near.signal(signal.SIGKILL)  # the rank's own region goes down...
                marks.append(("killed", k))
            if len(marks) == 1 and b.region == "far":
                near.start()  # ...and comes back on the same address
                marks.append(("restarted", k))
            if len(marks) == 2 and b.region == "near":
                marks.append(("back", k))
            if len(marks) == 3 and k > marks[2][1] + 50:
                break
        ds.client.close()
        assert [m[0] for m in marks] == ["killed", "restarted", "back"], marks
        assert ds.client.failovers >= 1 and ds.client.failbacks == 1
        check_prefix(got, wan_stream, seq_len, 0, 1, seed)
    finally:
        near.stop()
        far_feeder.stop()
