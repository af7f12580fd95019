"""Issue 34: nothing the cache directory holds is trusted. An entry (an epoch order, a Kafka
epoch's snapshot, a packing) that is damaged is found before any of it is served, said once,
counted, removed and built again; the ranks get exactly torch's DistributedSampler's ids."""
from __future__ import annotations

import logging
import os
import signal
import time
import urllib.request

import numpy as np
import pytest
import torch

from feeder.core import order, sampler
from feeder.domain import order_store as store
from feeder.sources import cache
from feeder_client import FeederDataset
from tests.helpers import FeederProc
from tests.test_order import VOCAB, flat_corpus, torch_rank_ids, wait_for_build


def built_order(cache_dir, n: int, seed: int) -> tuple[store.OrderStore, str]:
    """An order built by the store into cache_dir (as a feeder would), and its file's path."""
    st = store.OrderStore(str(cache_dir))
    wait_for(st, n, seed)
    return st, os.path.join(st.dir, st.name(n, seed, "torch"))


def wait_for(st: store.OrderStore, n: int, seed: int, limit_s: float = 60) -> np.ndarray:
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return np.asarray(st.get(n, seed, "torch"))
        except sampler.OrderPending:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def damage(path: str, how: str, n: int) -> None:
    """Damage an order file as disks, hosts and hands do (the file keeps its size but where said)."""
    ids = np.memmap(path, dtype=np.uint32, mode="r+", shape=(n,))
    if how == "swapped":          # two entries exchanged: every sum of the ids is kept
        ids[[10, n - 7]] = ids[[n - 7, 10]]
    elif how == "overwritten":    # 32 entries overwritten with ids found elsewhere (the review's)
        ids[100:132] = ids[5000:5032]
    elif how == "out-of-range":   # an id past n (served as INVALID_ARGUMENT, no failover, before)
        ids[3] = 2**32 - 16
    ids.flush()
    del ids
    if how == "zeroed":           # what a host crash leaves of a file renamed before it was on disk
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(b"\0" * size)
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "no-trailer":     # the ids only: written without its checks (a crash, an older build)
        os.truncate(path, 4 * n)


HOW = ("swapped", "overwritten", "zeroed", "truncated", "out-of-range", "no-trailer")


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_order_file_is_found_counted_rebuilt_and_never_served(tmp_path, caplog, how):
    """A new process (a fresh store) on a cache whose order file is damaged: the check finds it
    before any id is handed out, says so once, counts it, and the order is built again: the ids
    are torch's."""
    n, seed = 200_003, 7
    _, path = built_order(tmp_path, n, seed)
    damage(path, how, n)
    before = cache.damaged_counts()["order"]
    st = store.OrderStore(str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="feeder.cache"):
        with pytest.raises(sampler.OrderPending):   # (removed: being built again, the ranks wait)
            st.get(n, seed, "torch")
        got = wait_for(st, n, seed)
    want = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    assert np.array_equal(got, want)
    assert cache.damaged_counts()["order"] == before + 1
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and os.path.basename(path) in said[0], said
    assert os.path.getsize(path) == 4 * n + store.TRAILER.size
    assert st.build_seconds > 0 and st.built == 1


def test_order_checks_catch_what_each_is_for():
    """What each check catches (docs/guarantees.md): the sums a permutation must have catch any
    change of which ids the order holds, not a swap; the position digests catch a swap."""
    n = 100_000
    ids = np.random.default_rng(3).permutation(n).astype(np.uint32)
    built = order.order_checks(ids)
    assert order.not_a_permutation(n, built) == ""
    swapped = ids.copy()
    swapped[[1, 99_000]] = swapped[[99_000, 1]]
    got = order.order_checks(swapped)
    assert order.not_a_permutation(n, got) == "" and got[4] != built[4] and got[5] != built[5]
    for i, j in ((0, 1), (5, n - 1), (40_000, 40_002)):   # Σ (i+1)·x_i moves by (i - j)(x_j - x_i) ≠ 0
        s = ids.copy()
        s[[i, j]] = s[[j, i]]
        assert order.order_checks(s)[4] != built[4]
    for bad in (np.zeros(n, np.uint32), np.where(np.arange(n) == 7, ids[8], ids).astype(np.uint32),
                np.where(np.arange(n) == 7, n, ids).astype(np.uint32)):
        assert order.not_a_permutation(n, order.order_checks(bad))
    wide = ids.astype(np.uint64)   # orders past 2^32 ids are uint64: the same sums
    assert order.order_checks(wide)[:5] == built[:5]


def metric(feeder, name: str) -> float:
    text = urllib.request.urlopen(f"http://{feeder.metrics}/metrics", timeout=10).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("how", ["swapped", "zeroed"])
def test_failover_mid_epoch_from_a_feeder_whose_order_was_damaged_is_exact(tmp_path, how):
    """Feeder A's cache holds a damaged order (the review: 1,984 of 6,400 ids of a rank's epoch
    wrong or repeated after failing over from such a cache); B's is sound. The rank starts on A
    (which finds the damage, counts it, builds the order again and serves torch's ids), A is
    killed mid-epoch, the rank resumes on B: every id is DistributedSampler's."""
    n = sampler.SMALL_ORDER + 12_345          # past what is drawn in memory: a stored order
    data = flat_corpus(tmp_path, n)
    cache_a, cache_b = tmp_path / "a", tmp_path / "b"
    _, path = built_order(cache_a, n, 5)
    damage(path, how, n)
    a = FeederProc(data, extra=[*VOCAB, "--cache-dir", str(cache_a), "--metrics-port", "0"])
    b = None
    try:
        b = FeederProc(data, extra=[*VOCAB, "--cache-dir", str(cache_b)])
        want = torch_rank_ids(n, 2, 1, 5)
        ds = FeederDataset([a.address, b.address], job="fo", rank=1, world_size=2, seq_len=1, micro_batch=16,
                           seed=5, idle_timeout_s=10, retry_for_s=60, prefer="order", read_ahead=2, max_read_ahead=2)
        got = []
        for batch in ds:
            got += batch.sample_ids.tolist()
            if len(got) == 64:   # (served from the early part of A's order: the whole is rebuilt meanwhile)
                wait_for_build(cache_a / "orders")
                assert metric(a, "feeder_cache_damaged_total{kind=\"order\"}") == 1.0
                assert metric(a, "feeder_orders_built_total") == 1.0
                a.signal(signal.SIGKILL)
            if len(got) >= 16 * 400:   # (~120 KB: more than A could have sent ahead into the client's window)
                break
        failovers = ds.client.failovers
        ds.client.close()
        assert got == want[:len(got)] and failovers >= 1
        assert os.path.getsize(path) == 4 * n + store.TRAILER.size   # A's rebuilt order, sound
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()


def test_a_sample_outside_the_data_is_a_failover_not_the_callers_mistake():
    """An id ≥ n (a damaged order, index or packing) named rows past the data: INVALID_ARGUMENT,
    and the rank gave up. It is UNAVAILABLE marked for elsewhere: the rank resumes elsewhere."""
    from types import SimpleNamespace

    from feeder.core.errors import Code, FeederError
    from feeder.sources.posix import locate_rows

    with pytest.raises(FeederError) as e:
        locate_rows(SimpleNamespace(n_tokens=100), np.array([4, 2**32 - 16]), 2)
    assert e.value.code is Code.UNAVAILABLE and e.value.elsewhere
    assert "outside the dataset" in str(e.value)


# -- Kafka snapshots -----------------------------------------------------------------------------

def flip_a_byte(path, at: float = 0.5) -> None:
    """One byte of `path` inverted, `at` of the way in."""
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.kafka
@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_a_kafka_snapshot_with_a_flipped_byte_is_read_again_from_the_topic(kafka_broker, tmp_path, caplog, where):
    """A byte flipped in a snapshot shard (or its manifest) in the shared cache was DATA_LOSS for
    every job of that epoch, forever, though the topic still holds the records. Now a new feeder
    on that cache finds it (the chunk's sha256, or the manifest's fingerprint), says it once,
    counts it, removes it and reads the epoch again: both ranks get exactly the epoch's ids and
    tokens, and the cache holds one sound snapshot."""
    from feeder.core.config import ServeConfig
    from feeder.core.sampler import n_samples
    from feeder.service.server import ServerThread
    from tests.helpers import check_batches, reference_ids
    from tests.test_kafka_regressions import EPOCH_SEED, EPOCH_SEQ, Trickle, epoch_of, epoch_stream
    from tests.test_kafka_snapshots import builds, rank_batches

    caplog.set_level(logging.INFO)
    topic = f"snap-damage-{os.getpid()}-{time.time_ns() % 10**6}"
    Trickle(kafka_broker, topic, partitions=3, n0=600, trickle=False).stop()
    region = tmp_path / "region-cache"
    cfg = dict(source=f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256", listen="127.0.0.1:0",
               cache_dir=str(region))
    with ServerThread(ServeConfig(**cfg)) as a:
        first = rank_batches(a.address, "first", 0)
    ranges = epoch_of(first[0])
    (snap,) = [p for p in (region / "kafka").iterdir() if p.is_dir()]
    if where == "shard":
        target = max((p for p in snap.iterdir() if p.name not in ("manifest.json", "kafka.json")),
                     key=lambda p: p.stat().st_size)
    else:
        target = snap / "manifest.json"
    flip_a_byte(target)
    before = cache.damaged_counts()["snapshot"]
    with ServerThread(ServeConfig(**cfg)) as b:   # a new process on the region's cache
        got = {r: rank_batches(b.address, "again", r, ranges) for r in (0, 1)}
        from feeder.ops.status import fetch, render

        status = fetch(b.address)   # (the status field counts what this process found: in-process, all so far)
        assert status.cache_damaged >= 1
        from io import StringIO

        from rich.console import Console

        out = StringIO()
        Console(file=out, width=300).print(render(status, b.address))
        assert "cache damaged=" in out.getvalue()
    assert cache.damaged_counts()["snapshot"] == before + 1
    assert len(builds(caplog)) == 2, builds(caplog)
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and ranges in said[0], said
    stream = epoch_stream(kafka_broker, ranges)
    n = n_samples(len(stream), EPOCH_SEQ)
    for r in (0, 1):
        check_batches(got[r], stream, EPOCH_SEQ,
                      reference_ids(n, 2, r, shuffle=True, seed=EPOCH_SEED, drop_last=False, epoch=0))
        assert {epoch_of(x) for x in got[r]} == {ranges}
    assert [p.name for p in (region / "kafka").iterdir() if p.is_dir()] == [snap.name]


@pytest.mark.kafka
def test_a_kafka_snapshot_of_another_identity_under_this_ones_name_is_read_again(kafka_broker, tmp_path, caplog):
    """The same topic and ranges read under another eos_id (or vocabulary, record limit, a
    recreated topic): another snapshot, whose manifest and chunks are sound. Copied under this
    epoch's name, it is found at open (its kafka.json names its whole identity), counted,
    removed and read again from the topic; the ranks get the epoch's ids and tokens."""
    import shutil

    from feeder.core.config import ServeConfig
    from feeder.core.sampler import n_samples
    from feeder.service.server import ServerThread
    from tests.helpers import check_batches, reference_ids
    from tests.test_kafka_regressions import EPOCH_SEED, EPOCH_SEQ, Trickle, epoch_of, epoch_stream
    from tests.test_kafka_snapshots import builds, rank_batches

    caplog.set_level(logging.INFO)
    topic = f"snap-identity-{os.getpid()}-{time.time_ns() % 10**6}"
    Trickle(kafka_broker, topic, partitions=3, n0=600, trickle=False).stop()
    region = tmp_path / "region-cache"
    url = f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256"
    other = dict(source=f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=0", listen="127.0.0.1:0",
                 cache_dir=str(region))
    with ServerThread(ServeConfig(**other)) as a:   # the epoch read with another eos_id
        rank_batches(a.address, "other", 0)
    (theirs,) = [p for p in (region / "kafka").iterdir() if p.is_dir()]
    cfg = dict(source=url, listen="127.0.0.1:0", cache_dir=str(region))
    with ServerThread(ServeConfig(**cfg)) as a:
        first = rank_batches(a.address, "first", 0)
    ranges = epoch_of(first[0])
    (ours,) = [p for p in (region / "kafka").iterdir() if p.is_dir() and p != theirs]
    shutil.rmtree(ours)
    shutil.copytree(theirs, ours)   # the bad sync: the other eos_id's snapshot under this one's name
    before = cache.damaged_counts()["snapshot"]
    with ServerThread(ServeConfig(**cfg)) as b:
        got = {r: rank_batches(b.address, "again", r, ranges) for r in (0, 1)}
    assert cache.damaged_counts()["snapshot"] == before + 1
    assert len(builds(caplog)) == 3, builds(caplog)   # theirs, ours, and ours again
    stream = epoch_stream(kafka_broker, ranges)
    n = n_samples(len(stream), EPOCH_SEQ)
    for r in (0, 1):
        check_batches(got[r], stream, EPOCH_SEQ,
                      reference_ids(n, 2, r, shuffle=True, seed=EPOCH_SEED, drop_last=False, epoch=0))


def test_a_builder_sigkilled_mid_build_leaves_no_part_and_no_stale_lock_after_a_restart(tmp_path):
    """A feeder SIGKILLed while it draws an order left its `.part` (0.86 GB in the review) until a
    feeder next started on that host, and its lock and progress files for good. The next store
    on that cache removes all three, and counts none of them as an order."""
    import subprocess
    import sys

    n = 60_000_000
    script = ("import sys, time\n"
              "import feeder.domain.order_store as store\n"
              "store.huge_pages_for = lambda size: False\n"   # drawn straight into the cache directory
              "store.shm_dir = lambda size: None\n"
              "st = store.OrderStore(sys.argv[1])\n"
              f"st.prepare({n}, 1, 'torch')\n"
              "time.sleep(60)\n")
    builder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    orders = tmp_path / "orders"
    deadline = time.monotonic() + 30
    while not list(orders.glob(".randperm-*.part")) or not list(orders.glob("*.lock")):
        assert time.monotonic() < deadline and builder.poll() is None
        time.sleep(0.01)
    builder.kill()
    builder.wait(10)
    left = sorted(p.name for p in orders.iterdir())
    assert any(p.endswith(".part") for p in left) and any(p.endswith(".lock") for p in left), left
    name = store.OrderStore.name(n, 1, "torch")
    assert name not in left   # (killed mid-draw: never renamed into place)
    store.OrderStore(str(tmp_path))   # a feeder starting on the cache
    assert sorted(p.name for p in orders.iterdir()) == []


def test_a_build_under_way_counts_against_the_cache_budget(tmp_path):
    """--cache-max-gb did not count the part files of builds under way (here a live one of 40 MiB,
    this process's): an older order is now removed to make room for the new one beside it. The
    budget, read as GiB, is said in GiB (it said GB)."""
    st = store.OrderStore(str(tmp_path), max_bytes=64 << 20)
    old = tmp_path / "orders" / "randperm-fwd-n5000000-s1.u32"
    old.write_bytes(b"\0" * (20 << 20))
    part = tmp_path / "orders" / f".randperm-fwd-n9-s9.u32.{store.HOST}.{os.getpid()}.part"
    with open(part, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 40 << 20)
    st._make_room(8 << 20)
    assert not old.exists() and part.exists()
    from feeder.core.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match=r"0\.1 GiB.*--cache-max-gb 0\.0625 GiB"):
        st.get(30_000_000, 1, "torch")


@pytest.mark.kafka
def test_failover_mid_epoch_to_a_feeder_whose_snapshot_is_damaged_is_exact(kafka_broker, tmp_path):
    """Feeder A (a sound snapshot) goes away mid-epoch; the rank resumes on feeder B, whose cache
    holds the epoch's snapshot with a flipped byte (copied from another region's cache). B finds
    it, counts it, reads the epoch again from the topic, and the rank's epoch is exact."""
    import shutil

    from feeder.core.config import ServeConfig
    from feeder.core.sampler import n_samples
    from feeder.service.server import ServerThread
    from tests.helpers import check_batches, reference_ids
    from tests.test_kafka_regressions import EPOCH_MB, EPOCH_SEED, EPOCH_SEQ, Trickle, epoch_of, epoch_stream
    from tests.test_kafka_snapshots import rank_batches

    topic = f"snap-fo-{os.getpid()}-{time.time_ns() % 10**6}"
    # (rank 1's half of the epoch, ~300 KB, is more than the client's 64 KiB HTTP/2 window: A cannot
    # have sent all of it before it stops)
    Trickle(kafka_broker, topic, partitions=3, n0=12000, trickle=False).stop()
    url = f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256"
    cache_a, cache_b = tmp_path / "a", tmp_path / "b"
    a = ServerThread(ServeConfig(source=url, listen="127.0.0.1:0", cache_dir=str(cache_a)))
    b = ServerThread(ServeConfig(source=url, listen="127.0.0.1:0", cache_dir=str(cache_b)))
    try:
        ranges = epoch_of(rank_batches(a.address, "warm", 0)[0])   # A builds the epoch's snapshot
        (snap,) = [p for p in (cache_a / "kafka").iterdir() if p.is_dir()]
        shutil.copytree(snap, cache_b / "kafka" / snap.name)
        shard = max((p for p in (cache_b / "kafka" / snap.name).glob("*.arrow")), key=lambda p: p.stat().st_size)
        flip_a_byte(shard, 0.6)
        before = cache.damaged_counts()["snapshot"]
        ds = FeederDataset([a.address, b.address], job="fo", rank=1, world_size=2, seq_len=EPOCH_SEQ,
                           micro_batch=EPOCH_MB, seed=EPOCH_SEED, read_ahead=1, max_read_ahead=1, retry_for_s=60,
                           prefer="order", expected_fingerprint=ranges)
        got = []
        for batch in ds:
            got.append(batch)
            if len(got) == 3:
                a.stop()   # mid-epoch: the rank resumes on B from its cursor
        stream = epoch_stream(kafka_broker, ranges)
        want = reference_ids(n_samples(len(stream), EPOCH_SEQ), 2, 1, shuffle=True, seed=EPOCH_SEED,
                             drop_last=False, epoch=0)
        check_batches(got, stream, EPOCH_SEQ, want)
        assert len(got) > 3 and cache.damaged_counts()["snapshot"] == before + 1 and ds.client.failovers >= 1
    finally:
        a.stop()
        b.stop()


def test_failover_mid_epoch_to_a_feeder_whose_packing_is_damaged_is_exact(tmp_path):
    """Feeder A is killed mid-epoch of a packed stream; feeder B's cache holds the packing with a
    flipped byte (copied from A's, as a shared cache would hold it). B finds it, counts it, packs
    again, and the rank's bins are DistributedSampler's ids over the bins the rule makes."""
    import shutil

    from tests.helpers import make_docs, packed_bins, prep_docs, reference_ids

    seq = 16
    docs = make_docs(600, seed=34)   # (~6,000 bins: rank 1's half, ~100 KB, is more than the client's 64 KiB window)
    (tmp_path / "data").mkdir()
    data = prep_docs(tmp_path / "data", docs, shard_tokens=3000, chunk_tokens=700)
    bins = packed_bins(docs, seq)
    cache_a, cache_b = tmp_path / "a", tmp_path / "b"
    a = FeederProc(data, extra=["--cache-dir", str(cache_a)])
    b = None
    try:
        b = FeederProc(data, extra=["--cache-dir", str(cache_b), "--metrics-port", "0"])
        ds = FeederDataset([a.address, b.address], job="pk", rank=1, world_size=2, seq_len=seq, micro_batch=4,
                           seed=5, packing="best_fit", prefer="order", read_ahead=1, max_read_ahead=1,
                           idle_timeout_s=10, retry_for_s=60, num_epochs=1)
        got = []
        for batch in ds:
            for row, i in zip(batch.tokens.numpy().tolist(), batch.sample_ids.tolist()):
                assert row == bins[i].tolist(), i
                got.append(i)
            if len(got) == 8:
                shutil.copytree(cache_a / "packing", cache_b / "packing", dirs_exist_ok=True)
                flip_a_byte(next((cache_b / "packing").glob("*/start.npy")), 0.7)
                a.signal(signal.SIGKILL)
        assert got == reference_ids(len(bins), 2, 1, shuffle=True, seed=5, drop_last=False, epoch=0)
        assert metric(b, 'feeder_cache_damaged_total{kind="packing"}') == 1.0 and ds.client.failovers >= 1
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()


def test_another_jobs_order_copied_over_this_ones_is_refused_counted_and_rebuilt(tmp_path):
    """The outside review's (issue 44.1): two jobs of one dataset (same n) with seeds 10 and 20
    share a cache; seed 20's order file is copied over seed 10's name. It is a sound permutation
    with sound checks, and was served to the seed-10 job as verified (358,400 of 358,400 ids of
    a rank were seed 20's). Its trailer now names its seed: a real feeder refuses it as damage,
    counts it, builds seed 10's order again, and the rank gets DistributedSampler's ids."""
    import shutil

    n = sampler.SMALL_ORDER + 777
    data = flat_corpus(tmp_path, n)
    cache_dir = tmp_path / "cache"
    st10, path10 = built_order(cache_dir, n, 10)
    _, path20 = built_order(cache_dir, n, 20)
    shutil.copyfile(path20, path10)   # the bad sync: the same size, another order
    a = FeederProc(data, extra=[*VOCAB, "--cache-dir", str(cache_dir), "--metrics-port", "0"])
    try:
        ds = FeederDataset([a.address], job="seed10", rank=0, world_size=4, seq_len=1, micro_batch=64, seed=10,
                           retry_for_s=60, read_ahead=2, max_read_ahead=2)
        got = []
        for batch in ds:
            got += batch.sample_ids.tolist()
            if len(got) >= 64 * 40:
                break
        ds.client.close()
        wait_for_build(cache_dir / "orders")
        assert got == torch_rank_ids(n, 4, 0, 10)[:len(got)]
        assert metric(a, "feeder_cache_damaged_total{kind=\"order\"}") == 1.0
    finally:
        a.stop()
    fresh = store.OrderStore(str(cache_dir))   # the rebuilt file is seed 10's, and says so
    assert np.array_equal(wait_for(fresh, n, 10),
                          torch.randperm(n, generator=torch.Generator().manual_seed(10)).numpy())


@pytest.mark.parametrize("other", ["seed", "size"])
def test_an_order_file_of_another_identity_is_not_served(tmp_path, other):
    """Whatever differs (the seed, or n with the file cut to this n's size), the store refuses it."""
    n = 200_003
    _, path = built_order(tmp_path, n, 7)
    if other == "seed":
        _, src = built_order(tmp_path / "o", n, 8)
    else:   # an order of another n, made to this one's size: its trailer still says its own n
        m = n + 5
        _, src = built_order(tmp_path / "o", m, 7)
        with open(src, "rb") as f:
            body = f.read()
        cut = body[:4 * n] + body[4 * m:]
        src = str(tmp_path / "cut")
        with open(src, "wb") as f:
            f.write(cut)
    os.replace(src, path)
    before = cache.damaged_counts()["order"]
    st = store.OrderStore(str(tmp_path))
    with pytest.raises(sampler.OrderPending):
        st.get(n, 7, "torch")
    assert cache.damaged_counts()["order"] == before + 1
    assert np.array_equal(wait_for(st, n, 7), torch.randperm(n, generator=torch.Generator().manual_seed(7)).numpy())


# -- a cache directory the feeder cannot use (issue 44.2) --------------------------------------

AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _open_dir(path):
    """A directory another user can enter (pytest's own are root's alone)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o755)
    return path


@pytest.mark.parametrize("how", ["unreadable", "read-only", "full"])
def test_a_cache_the_feeder_cannot_use_still_serves_the_rank_at_once(how):
    """An order file this user cannot read (chmod 000; the feeder not root), a cache directory it
    cannot write, a full one (a real tmpfs of 1 MiB): the rank waited in silence (or got
    INTERNAL: PermissionError) while the feeder logged "build failed" every 5 s. The data is
    sound: the order is drawn in the feeder's memory and served, the rank's ids are torch's, and
    `feeder status` (and the metric) says what the cache cannot do and what to fix."""
    import subprocess
    import tempfile
    from pathlib import Path

    from feeder.ops.status import fetch

    n = sampler.SMALL_ORDER + 4_321
    root = _open_dir(Path(tempfile.mkdtemp(prefix="cache-unusable-")))
    data = flat_corpus(root, n)
    os.chmod(data, 0o644)
    cache_dir = _open_dir(root / "cache")
    mounted = False
    prefix = AS_NOBODY
    if how == "unreadable":   # built by root, then not this user's to read (nor its directory to write)
        _, path = built_order(cache_dir, n, 3)
        os.chmod(path, 0)
        os.chmod(cache_dir / "orders", 0o755)
    elif how == "read-only":
        _open_dir(cache_dir / "orders")
        os.chmod(cache_dir / "orders", 0o555)
    else:                     # full: room for nothing the size of an order
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(cache_dir)], check=True)
        mounted, prefix = True, []
    a = None
    try:
        a = FeederProc(data, extra=[*VOCAB, "--cache-dir", str(cache_dir), "--metrics-port", "0"], prefix=prefix)
        t0 = time.monotonic()
        ds = FeederDataset([a.address], job=f"unusable-{how}", rank=1, world_size=2, seq_len=1, micro_batch=64,
                           seed=3, retry_for_s=30, read_ahead=2, max_read_ahead=2)
        got = []
        for batch in ds:
            got += batch.sample_ids.tolist()
            if len(got) >= 64 * 20:
                break
        first_s = time.monotonic() - t0
        ds.client.close()
        assert got == torch_rank_ids(n, 2, 1, 3)[:len(got)]
        assert first_s < 30, first_s
        said = fetch(a.address).cache_problems
        assert said and "drawn in each feeder process's memory" in said[0] and "--cache-dir" in said[0], said
        assert metric(a, "feeder_cache_unusable") == 1.0
    finally:
        if a is not None:
            a.stop()
        if mounted:
            subprocess.run(["umount", str(cache_dir)], check=False)
        import shutil

        for p in root.rglob("*"):
            try:
                os.chmod(p, 0o700)
            except OSError:
                pass
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_a_packing_the_cache_cannot_hold_is_built_elsewhere_and_served(how, dataset, tmp_path):
    """Best-fit bins on a cache directory this user cannot write, or a full one: every stream
    failed UNKNOWN ("9482 requested and 8160 written") until the rank gave up. The process packs
    in a directory of its own instead: the rank gets the same bins as from a sound cache, and
    `feeder status` says what to fix."""
    import subprocess
    import tempfile
    from pathlib import Path

    from feeder.core.config import ServeConfig
    from feeder.ops.status import fetch
    from feeder.service.server import ServerThread

    root = _open_dir(Path(tempfile.mkdtemp(prefix="packing-unusable-")))
    data = root / "ds"
    subprocess.run(["cp", "-r", str(dataset), str(data)], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    cache_dir = _open_dir(root / "cache")
    mounted, prefix = False, AS_NOBODY
    if how == "read-only":
        os.chmod(cache_dir, 0o555)
    else:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0755", "tmpfs", str(cache_dir)], check=True)
        mounted, prefix = True, []

    def take(address, job):
        ds = FeederDataset([address], job=job, rank=0, world_size=2, seq_len=64, micro_batch=4, seed=1,
                           packing="best_fit", retry_for_s=20, num_epochs=1)
        return [(b.sample_ids.tolist(), b.tokens.tolist()) for b in ds]

    a = None
    try:
        a = FeederProc(data, extra=["--cache-dir", str(cache_dir)], prefix=prefix)
        got = take(a.address, f"pack-{how}")
        said = fetch(a.address).cache_problems
        assert any("packings cannot be kept in" in p and "--cache-dir" in p for p in said), said
    finally:
        if a is not None:
            a.stop()
        if mounted:
            subprocess.run(["umount", str(cache_dir)], check=False)
        os.chmod(cache_dir, 0o755)
    with ServerThread(ServeConfig(source=str(data), listen="127.0.0.1:0", cache_dir=str(tmp_path))) as sound:
        assert got == take(sound.address, "pack-sound") and got


@pytest.mark.kafka
def test_a_kafka_epoch_the_cache_cannot_hold_is_read_into_the_process_own_and_served(kafka_broker):
    """A bounded topic's epoch on a full cache directory (a real tmpfs of 16 KiB): the snapshot
    is read into a directory of the process's own and served exactly; status says what to fix."""
    import subprocess
    import tempfile
    from pathlib import Path

    from feeder.core.config import ServeConfig
    from feeder.core.sampler import n_samples
    from feeder.ops.status import fetch
    from feeder.service.server import ServerThread
    from tests.helpers import check_batches, reference_ids
    from tests.test_kafka_regressions import EPOCH_SEED, EPOCH_SEQ, Trickle, epoch_of, epoch_stream
    from tests.test_kafka_snapshots import rank_batches

    topic = f"snap-full-{os.getpid()}-{time.time_ns() % 10**6}"
    Trickle(kafka_broker, topic, partitions=3, n0=600, trickle=False).stop()
    full = _open_dir(Path(tempfile.mkdtemp(prefix="kafka-full-")))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], check=True)
    try:
        cfg = dict(source=f"kafka://{kafka_broker}/{topic}?vocab_size=257&eos_id=256", listen="127.0.0.1:0",
                   cache_dir=str(full))
        with ServerThread(ServeConfig(**cfg)) as a:
            got = rank_batches(a.address, "full", 0)
            said = fetch(a.address).cache_problems
        assert any("Kafka snapshots cannot be kept in" in p and "--cache-dir" in p for p in said), said
    finally:
        subprocess.run(["umount", str(full)], check=False)
    ranges = epoch_of(got[0])
    stream = epoch_stream(kafka_broker, ranges)
    check_batches(got, stream, EPOCH_SEQ, reference_ids(n_samples(len(stream), EPOCH_SEQ), 2, 0, shuffle=True,
                                                         seed=EPOCH_SEED, drop_last=False, epoch=0))
