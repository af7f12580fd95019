"""The early part of torch's large orders (served while the whole is built): its ids against the
whole and torch's, streams planned with it against those without it in seeded scenarios, and the
outside review's findings on it. Real processes for the early part live in tests/test_order.py
(the failover across it, the 10^9 status test)."""
from __future__ import annotations

import dataclasses
import random
import time

import numpy as np
import pytest
import torch

from feeder.core import order, sampler
from feeder.core.cursor import Cursor
from feeder.core.order import TORCH_INSIDE_OUT_FROM as T
from feeder.domain.order_store import EARLY_POSITIONS
from tests.helpers import reference_ids
from tests.test_order import hold_lock


def test_an_orders_early_part_is_its_first_positions_for_both_loops_at_any_n():
    """What a rank is served while a large order is built (feeder.order.torch_prefix, the order
    store's early part) is the whole order's first positions: against the whole, drawn, for both
    loops (inside-out forced at small n), both widths, n from 1, k from 0 to n, any seed; against
    torch.randperm itself; against the legacy loop's golden values at the threshold. A stop flag
    set ends it at once, and says so."""
    rng = random.Random(36)
    for _ in range(2000):
        n = rng.choice([1, 2, 3, 64, 65, 1000, rng.randrange(1, 40_000)])
        k = rng.choice([0, 1, n, rng.randrange(0, n + 1)])
        seed, io = rng.randrange(2**64), rng.random() < 0.5
        dtype = np.dtype(np.uint32 if rng.random() < 0.7 else np.uint64)
        whole, part = np.empty(n, dtype), np.empty(k, dtype)
        order._c.randperm(whole, seed, io)
        assert order._c.prefix(part, n, seed, io) is False
        assert np.array_equal(part, whole[:k]), (n, k, seed, io)
    for n in (10, 4097, 123_457):
        g = torch.Generator()
        g.manual_seed(9)
        assert order.torch_prefix(n, 500, 9, "torch")[0].tolist() == torch.randperm(n, generator=g)[:500].tolist()
    assert order.torch_prefix(T, 8, 5, "torch-legacy")[0].tolist() == \
        [94459955, 22248452, 89044615, 134552112, 28858570, 58999562, 79933354, 126465457]
    for kind in ("torch", "torch-legacy"):   # (inside-out, then forward, at T)
        t0 = time.monotonic()
        ids, stopped = order.torch_prefix(T, 1 << 20, 5, kind, progress=np.array([0, 1], dtype=np.int64))
        assert stopped and time.monotonic() - t0 < 2


class _EarlyThenWhole:
    """An order store whose builds take `slow` asks each: until then get(early=True) gives the
    first `known` positions (none: OrderPending), get() OrderPending; then the whole order."""

    def __init__(self, known: int, slow: int):
        self.known, self.slow, self.asked = known, slow, {}

    def prepare(self, n, seed, kind):
        pass

    def get(self, n, seed, kind, early=False):
        whole = order.torch_randperm(n, seed, kind)[0]
        asks = self.asked[n, seed] = self.asked.get((n, seed), 0) + 1
        if asks > self.slow:
            return whole
        if early and self.known:
            return sampler.Early(whole[:self.known], n, lambda: "building")
        raise sampler.OrderPending("building")


def _planned(spec, n, cursor, orders, stop_after=None):
    """(ids of each batch, the cursor after each) of a stream's plan, PENDING waited through (as
    the pipeline does), up to `stop_after` batches."""
    from feeder.core.planning import PENDING, StreamPlan

    plan = StreamPlan(spec, n_tokens=n * spec.seq_len + 1, fingerprint="f", cursor=cursor, orders=orders)
    out = []
    for run in plan.runs(max_batches=5):
        if run is PENDING:
            continue
        at = run.start
        for j, stop in enumerate(run.stops.tolist()):
            c = Cursor(job=spec.job, fingerprint="f", seed=spec.seed, shuffle=True, drop_last=spec.drop_last,
                       seq_len=spec.seq_len, world_size=run.world, rank=spec.rank, epoch=run.epoch, base=run.base,
                       pos=stop, step=run.step + j + 1, permutation=plan.spec.permutation)
            out.append((run.ids[at - run.start:stop - run.start].tolist(), c))
            at = stop
            if stop_after is not None and len(out) >= stop_after:
                return out
    return out


def test_streams_served_an_early_part_are_the_streams_of_the_whole_order_in_every_combination(monkeypatch):
    """Seeded scenarios (n, world, rank, micro_batch, drop_last, epochs; a resume from a cursor
    anywhere, with or without a reshard to another world size; an early part of any length, none
    included, and builds that take any number of asks) planned with the early part and without:
    every batch the same ids at the same steps, the stream without it being DistributedSampler's
    (checked against torch's own class where nothing is resumed)."""
    from feeder.core.config import StreamSpec

    monkeypatch.setattr(sampler, "SMALL_ORDER", 8)   # every order here is the order store's
    rng = random.Random(3601)
    for case in range(300):
        n, world = rng.randrange(9, 700), rng.randrange(1, 9)
        spec = StreamSpec(job="e", rank=rng.randrange(world), world_size=world, seq_len=1,
                          micro_batch=rng.randrange(1, 7), seed=rng.randrange(100), drop_last=rng.random() < 0.5,
                          num_epochs=rng.randrange(1, 4), permutation="torch")
        if sampler.per_rank(n, world, spec.drop_last) == 0:
            continue
        early = _EarlyThenWhole(rng.choice([0, 1, rng.randrange(1, n), n - 1]), rng.randrange(0, 6))
        want = _planned(spec, n, None, _EarlyThenWhole(0, 0))
        got = _planned(spec, n, None, early)
        assert [b for b, _ in got] == [b for b, _ in want], case
        if rng.random() < 0.3:
            ref = [i for e in range(spec.num_epochs) for i in reference_ids(
                n, world, spec.rank, shuffle=True, seed=spec.seed, drop_last=spec.drop_last, epoch=e)]
            assert [i for b, _ in want for i in b] == ref, case
        if len(want) < 2:
            continue
        _, cursor = want[rng.randrange(len(want) - 1)]   # resumed there (all ranks: a reshard is lockstep)
        if rng.random() < 0.5:
            spec = dataclasses.replace(spec, world_size=(w := rng.randrange(1, 9)), rank=rng.randrange(w), reshard=True)
            if sampler.per_rank(n, w, spec.drop_last) == 0:
                continue
        early = _EarlyThenWhole(rng.choice([0, 1, rng.randrange(1, n), n - 1]), rng.randrange(0, 6))
        assert [b for b, _ in _planned(spec, n, cursor, early)] == \
            [b for b, _ in _planned(spec, n, cursor, _EarlyThenWhole(0, 0))], case


def test_review_the_next_epochs_order_is_built_once_this_ones_is_whole_not_beside_it(monkeypatch):
    """Outside review: with the early part served at once, the next epoch's order was asked for
    at once too, and the two O(n) builds ran side by side (7.2 GB anonymous at 10^9, against the
    3.9 GB documented). The stream now asks for it once its epoch's order is whole, and takes the
    whole over from the early part as soon as it is built, without waiting to exhaust it."""
    from feeder.core.config import StreamSpec

    monkeypatch.setattr(sampler, "SMALL_ORDER", 8)
    calls = []

    class Store(_EarlyThenWhole):
        def prepare(self, n, seed, kind):
            calls.append(("prepare", seed))

        def get(self, n, seed, kind, early=False):
            got = super().get(n, seed, kind, early)
            calls.append(("whole" if not isinstance(got, sampler.Early) else "early", seed))
            return got

    spec = StreamSpec(job="e", rank=1, world_size=2, seq_len=1, micro_batch=2, seed=10, num_epochs=3,
                      permutation="torch")
    got = _planned(spec, 400, None, Store(known=300, slow=3))
    assert [b for b, _ in got] == [b for b, _ in _planned(spec, 400, None, _EarlyThenWhole(0, 0))]
    for seed in (11, 12):   # epochs 1 and 2: asked for ahead, each after the epoch before was whole
        assert calls.index(("prepare", seed)) > calls.index(("whole", seed - 1))
    assert calls[:4] == [("early", 10)] * 3 + [("whole", 10)]   # (the whole taken over at its first ask)


def test_review_only_the_first_rank_to_ask_waits_for_an_early_part(tmp_path, monkeypatch):
    """Outside review: every rank asking for a new large order waited up to a second on a thread
    of the feeder's shared pool for its early part (a job of 8 ranks held all 4, and another
    job's first batch waited 0.8 s). Now the first to ask waits (up to EARLY_WAIT_S); the others
    are told to ask again at once. A build tried again after a failure keeps the early part."""
    import threading

    from feeder.domain import order_store as store

    n = sampler.SMALL_ORDER + 7
    st = store.OrderStore(str(tmp_path))
    name = st.name(n, 5, "torch")
    holder = hold_lock(tmp_path / "orders" / (name + ".lock"), 30)   # (the whole: built elsewhere)
    real = store.order.torch_prefix

    def slow(*a, **k):   # (drawn more slowly than the first asker waits)
        time.sleep(store.EARLY_WAIT_S + 0.5)
        return real(*a, **k)

    monkeypatch.setattr(store.order, "torch_prefix", slow)
    try:
        first = []

        def ask():
            t0 = time.monotonic()
            try:
                first.append(st.get(n, 5, "torch", early=True))
            except sampler.OrderPending as e:
                first.append(e)
            first.append(time.monotonic() - t0)

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 10
        while not (name in st._builds and st._builds[name].early_started) and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(sampler.OrderPending, match="waiting for another process"):
            st.get(n, 5, "torch", early=True)   # (another rank: told at once)
        assert time.monotonic() - t0 < 0.5
        t.join(10)
        assert isinstance(first[0], sampler.OrderPending) and first[1] >= store.EARLY_WAIT_S - 0.05   # (it waited)
        b = st._builds[name]
        assert b.early_done.wait(10)
        got = st.get(n, 5, "torch", early=True)
        assert isinstance(got, sampler.Early) and got.known == EARLY_POSITIONS
        assert np.array_equal(got.ids, real(n, EARLY_POSITIONS, 5, "torch")[0])
        b.error, b.failed_at = "disk full", time.monotonic() - store.RETRY_S
        again = st.get(n, 5, "torch", early=True)   # (a new build: the early part carried over, not drawn again)
        assert st._builds[name] is not b and again.ids is got.ids
    finally:
        holder.kill()
        st.stop()
