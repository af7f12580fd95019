"""The pure sampler against torch's DistributedSampler, and elastic re-dealing."""
import itertools

import numpy as np
import pytest

from feeder.core import sampler
from tests.helpers import reference_ids


@pytest.mark.parametrize("n", [1, 2, 7, 10, 33, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_rank_ids_equal_distributed_sampler(n, world):
    for shuffle, drop_last, epoch, seed in itertools.product([True, False], [True, False], [0, 1, 5], [0, 42]):
        order = sampler.epoch_order(n, seed, epoch, shuffle)
        for rank in range(world):
            want = reference_ids(n, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last, epoch=epoch)
            assert sampler.per_rank(n, world, drop_last) == len(want)
            got = sampler.rank_ids(order, base=0, world=world, rank=rank, drop_last=drop_last, start=0,
                                   stop=len(want) + 5)
            assert got.tolist() == want, (n, world, rank, shuffle, drop_last, epoch, seed)
            # any window equals the same slice of the full list
            mid = sampler.rank_ids(order, base=0, world=world, rank=rank, drop_last=drop_last, start=1, stop=4)
            assert mid.tolist() == want[1:4]


def test_n_samples_packing_arithmetic():
    assert sampler.n_samples(0, 4) == 0
    assert sampler.n_samples(4, 4) == 0       # needs seq_len + 1 tokens
    assert sampler.n_samples(5, 4) == 1
    assert sampler.n_samples(9, 4) == 2
    assert sampler.n_samples(8, 4) == 1


@pytest.mark.parametrize("n,old,new,steps,mb", [(120, 4, 3, 5, 2), (100, 2, 5, 7, 3), (60, 3, 3, 4, 1)])
def test_reshard_deals_remaining_samples_once(n, old, new, steps, mb):
    """World size changes at a step boundary: consumed + re-dealt = every id exactly once."""
    order = sampler.epoch_order(n, 7, 0, True)
    consumed = []
    for r in range(old):
        consumed += sampler.rank_ids(order, base=0, world=old, rank=r, drop_last=False, start=0,
                                     stop=steps * mb).tolist()
    base = sampler.reshard_base(n=n, base=0, world=old, pos=steps * mb)
    rest = []
    per = sampler.per_rank(n - base, new, True)
    for r in range(new):
        rest += sampler.rank_ids(order, base=base, world=new, rank=r, drop_last=True, start=0, stop=per).tolist()
    assert not set(consumed) & set(rest)
    everything = consumed + rest
    assert len(everything) == len(set(everything))
    # what drop_last leaves out of the re-deal is fewer than one id per new rank
    assert n - len(everything) < new
    # deterministic: the same inputs give the same deal
    again = sampler.rank_ids(order, base=base, world=new, rank=0, drop_last=True, start=0, stop=per)
    assert again.tolist() == rest[:per]


@pytest.mark.parametrize("n,seed", [(0, 1), (1, 1), (2, 5), (97, 0), (10_000, 7), (123_457, 2**33 + 5),
                                    (1_000_003, 2**40 + 17)])
def test_randperm_without_torch_is_torchs_randperm(n, seed):
    import feeder._shuffle  # noqa: F401  (built at install; the torch-free path is what is tested)
    import numpy as np
    import torch

    from feeder.core.sampler import randperm

    g = torch.Generator()
    g.manual_seed(seed)
    assert np.array_equal(randperm(n, seed), torch.randperm(n, generator=g).numpy())


def test_the_feeder_process_does_not_import_torch(tmp_path):
    """torch costs ~500 MB of resident memory; the feeder's shuffle must not pull it in."""
    import subprocess
    import sys

    code = ("import sys; from feeder.core.sampler import epoch_order; from feeder.service import server; "
            "epoch_order(1000, 3, 1, True); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_randperm_is_torchs_from_many_threads_at_once():
    """Each thread reseeds its own generator: concurrent draws must not mix their states."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch

    def torch_perm(seed):
        g = torch.Generator()
        g.manual_seed(seed)
        return torch.randperm(5000, generator=g).numpy()

    seeds = list(range(40))
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda s: sampler.randperm(5000, s), seeds))
    assert all(np.array_equal(g, torch_perm(s)) for g, s in zip(got, seeds))


def test_epoch_orders_stay_cached_across_many_epochs_within_a_byte_budget(monkeypatch):
    """Ranks drift apart by their prefetch, which on a small dataset spans many epochs: their
    orders stay shared. A budget in bytes evicts the oldest, keeping the newest two."""
    monkeypatch.setattr(sampler, "_ORDER_CACHE", type(sampler._ORDER_CACHE)())
    monkeypatch.setattr(sampler, "_order_bytes", 0)
    first = [sampler.epoch_order(1000, 9, e, True) for e in range(50)]
    assert all(sampler.epoch_order(1000, 9, e, True) is first[e] for e in range(50))   # 50 epochs, all hits
    monkeypatch.setattr(sampler, "_ORDER_CACHE_BYTES", 10_000)    # room for two 4000-byte orders
    sampler.epoch_order(1000, 9, 50, True)
    assert len(sampler._ORDER_CACHE) == 2 and sampler._order_bytes == 8000
    assert sampler.epoch_order(1000, 9, 49, True) is first[49]
    assert sampler.epoch_order(1000, 9, 0, True) is not first[0]   # evicted, drawn again


def test_reach_keeps_a_stream_in_whole_batches_of_an_early_order_and_no_further():
    """While a large order is built a stream is served its early part (sampler.Early: the first
    `known` positions). `reach` gives how far: whole batches only (the last of an epoch may be
    short), every id in them the whole order's, and the next batch needs a position it lacks
    (Early then raises OrderPending: the stream waits for the whole). Any segment (base, world),
    rank, drop_last, start, batch size."""
    import random

    rng = random.Random(11)
    for _ in range(4000):
        n = rng.randrange(1, 3000)
        world, base, drop = rng.randrange(1, 40), rng.randrange(0, n), rng.random() < 0.5
        rank, mb = rng.randrange(world), rng.randrange(1, 9)
        per = sampler.per_rank(n - base, world, drop)
        if per == 0:
            continue
        start = rng.randrange(per)
        stop = rng.randrange(start + 1, per + 1)
        whole = np.random.default_rng(rng.randrange(1 << 30)).permutation(n).astype(np.uint32)
        early = sampler.Early(whole[:rng.randrange(0, n)], n, lambda: "building")
        seg = dict(base=base, world=world, rank=rank)
        got = sampler.reach(early, **seg, start=start, stop=stop, per_batch=mb)
        assert sampler.reach(whole, **seg, start=start, stop=stop, per_batch=mb) == stop
        assert start <= got <= stop and (got == stop or (got - start) % mb == 0)
        if got > start:
            assert np.array_equal(sampler.rank_ids(early, **seg, drop_last=drop, start=start, stop=got),
                                  sampler.rank_ids(whole, **seg, drop_last=drop, start=start, stop=got))
        nxt = min(got + mb, stop)
        if got < stop and rank + (nxt - 1) * world < n - base:   # (past the epoch's end the list cycles: conservative there)
            with pytest.raises(sampler.OrderPending, match="building"):
                sampler.rank_ids(early, **seg, drop_last=drop, start=got, stop=nxt)
