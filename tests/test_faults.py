"""Faults: feeders killed, stopped and frozen mid-epoch; world size changed mid-epoch.
Real feeder processes, real sockets; the rank's ids and content must stay exact."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from feeder_client import FeederDataset
from feeder.core.sampler import n_samples, per_rank
from tests.helpers import FeederProc, reference_ids
from tests.helpers import check_batches as check, expected_ids as expected

pytestmark = pytest.mark.fault


@pytest.fixture
def two_feeders(dataset):
    feeders = [FeederProc(dataset), FeederProc(dataset)]
    yield feeders
    for f in feeders:
        f.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_rank_fails_over_between_two_feeders_killed_at_20_random_points(two_feeders, stream, sig):
    seq_len, seed = 16, 3
    want = expected(stream, 1, 2, seq_len, seed)
    n_batches = -(-len(want) // 4)
    points = sorted(random.Random(sig).sample(range(5, n_batches - 5), 20))
    ds = FeederDataset([f.address for f in two_feeders], job=f"kill-{sig.name}", rank=1, world_size=2,
                       seq_len=seq_len, micro_batch=4, seed=seed, read_ahead=2, retry_for_s=60)
    got, kills = [], 0
    for k, b in enumerate(ds):
        got.append(b)
        if kills < len(points) and k == points[kills]:
            victim = next(f for f in two_feeders if f.address == ds.client.target)
            victim.signal(sig)
            victim.start()  # back for the next failover, on the same address
            kills += 1
    assert kills == 20
    assert ds.client is not None
    check(got, stream, seq_len, want)


def test_frozen_feeder_is_abandoned_within_the_detection_bound(two_feeders, stream):
    seq_len, seed = 16, 5
    want = expected(stream, 0, 1, seq_len, seed)
    ds = FeederDataset([f.address for f in two_feeders], job="frozen", rank=0, world_size=1, seq_len=seq_len,
                       micro_batch=4, seed=seed, read_ahead=1, idle_timeout_s=3.0, keepalive_s=2.0)
    got, gap = [], None
    it = iter(ds)
    for k, b in enumerate(it):
        got.append(b)
        if k == 30:
            frozen = next(f for f in two_feeders if f.address == ds.client.target)
            frozen.signal(signal.SIGSTOP)
            t0 = time.monotonic()
            got.append(next(it))  # what was already queued or in flight may come first
            while ds.client.target == frozen.address:
                got.append(next(it))
            gap = time.monotonic() - t0
            frozen.signal(signal.SIGCONT)  # the old stream is back: it must not deliver anything twice
    assert gap is not None and gap < 3.0 + 2.0 + 3.0, f"took {gap:.1f}s to abandon a frozen feeder"
    check(got, stream, seq_len, want)


@pytest.mark.parametrize("old,new", [(4, 3), (2, 5)])
def test_world_size_change_mid_epoch_deals_the_rest_once(feeder, stream, old, new):
    seq_len, mb, seed, steps = 32, 4, 9, 10
    n = n_samples(len(stream), seq_len)
    consumed, cursors = [], []
    for rank in range(old):
        it = iter(FeederDataset([feeder.address], job=f"elastic-{old}-{new}", rank=rank, world_size=old,
                                seq_len=seq_len, micro_batch=mb, seed=seed))
        for _ in range(steps):
            b = next(it)
            consumed += b.sample_ids.tolist()
        cursors.append(b.cursor)
        it.close()

    def rest(run):
        out = {}
        for rank in range(new):
            ds = FeederDataset([feeder.address], job=f"elastic-{old}-{new}", rank=rank, world_size=new,
                               seq_len=seq_len, micro_batch=mb, seed=seed, cursor=cursors[0], reshard=True)
            out[rank] = [i for b in ds for i in b.sample_ids.tolist()]
        return out

    first = rest("a")
    assert rest("b") == first, "re-dealing must be deterministic"
    lengths = {len(v) for v in first.values()}
    assert len(lengths) == 1, "every new rank gets the same number of samples"
    redealt = [i for v in first.values() for i in v]
    everything = consumed + redealt
    assert set(everything) == set(range(n)), "no sample lost"
    remaining = n - len(consumed)
    padding = per_rank(remaining, new, False) * new - remaining
    # the only repeats are DistributedSampler's own padding of the re-dealt rest to equal length
    assert len(everything) - len(set(everything)) == padding < new
    assert not set(consumed) & set(redealt[:remaining])
    # the epoch after the change follows DistributedSampler for the new world size
    nxt = FeederDataset([feeder.address], job=f"elastic-next-{old}-{new}", rank=1, world_size=new, seq_len=seq_len,
                        micro_batch=mb, seed=seed, epoch=1)
    assert [i for b in nxt for i in b.sample_ids.tolist()] == reference_ids(
        n, new, 1, shuffle=True, seed=seed, drop_last=False, epoch=1)


def test_ledger_audit_proves_exactly_once_across_failover(dataset, tmp_path):
    import json

    from feeder.core.config import ServeConfig
    from feeder.service.server import ServerThread

    ledgers = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    servers = [ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", region=r, ledger=str(p),
                                        message_bytes=4096)) for r, p in zip("ab", ledgers)]
    try:
        for rank in range(3):
            kw = dict(job="ledger", rank=rank, world_size=3, seq_len=64, micro_batch=4, seed=2, read_ahead=2)
            it = iter(FeederDataset([servers[0].address], **kw))
            for _ in range(10 + rank):
                b = next(it)
            it.close()  # feeder a sent more than the rank took: those batches come again from b
            list(FeederDataset([servers[1].address], cursor=b.cursor, **kw))
    finally:
        for s in servers:
            s.stop()
    run = lambda *paths: subprocess.run([sys.executable, "-m", "feeder.cli", "audit", *map(str, paths), "--json"],
                                        capture_output=True, text=True, timeout=60)
    r = run(*ledgers)
    assert r.returncode == 0, r.stdout + r.stderr
    verdict = json.loads(r.stdout)
    assert verdict["exactly_once"] and verdict["resent_batches"] > 0 and verdict["n_missing"] == 0
    # a batch that never reached training shows up as a gap, named by its ids
    key = lambda rec: (rec.get("rank"), rec.get("step"))
    sent_by_a = {key(json.loads(l)) for l in ledgers[0].read_text().splitlines() if '"ids"' in l}
    lines = ledgers[1].read_text().splitlines()
    victim = next(l for l in lines if '"ids"' in l and key(json.loads(l)) not in sent_by_a)
    ledgers[1].write_text("\n".join(l for l in lines if l != victim) + "\n")
    r = run(*ledgers)
    assert r.returncode == 1
    verdict = json.loads(r.stdout)
    assert not verdict["exactly_once"] and sorted(verdict["missing"]) == sorted(json.loads(victim)["ids"])
