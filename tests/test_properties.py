"""Property tests (Hypothesis) for the pure parts: sampler, planning, cursor, elastic re-dealing.

The example-based tests (test_sampler.py, test_cursor.py) pin chosen cases; these draw the inputs,
so a case nobody thought of (n < world, a seed above 2^32, a cursor of odd length) is tried too.

Deterministic by default: the "feeder-ci" profile derandomizes (the same examples on every run and
every machine, so a red CI run is reproducible by rerunning it) and keeps no database. To hunt for
new failures with fresh random examples, run with FEEDER_HYPOTHESIS_PROFILE=feeder-explore; a
failure prints the falsifying example and a @reproduce_failure blob to pin it with.
"""
from __future__ import annotations

import dataclasses
import os
import struct
import sys
from collections import Counter
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from feeder.core import cursor as cursor_mod
from feeder.core import sampler
from feeder.core.config import StreamSpec
from feeder.core.cursor import Cursor, CursorWriter
from feeder.sources.kafka_positions import KafkaEpoch, KafkaFollow, KafkaFollowMix
from feeder.core.errors import FailedPrecondition, InvalidArgument
from feeder.core.planning import StreamPlan
from tests.helpers import reference_ids

settings.register_profile(
    "feeder-ci", derandomize=True, database=None, deadline=None, print_blob=True, max_examples=60,
    # the planning and elastic properties build several plans per example: slow by design
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "feeder-explore", derandomize=False, database=None, deadline=None, print_blob=True, max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Loaded here, not in conftest: only this module uses Hypothesis, and the env var lets one run
# explore without editing the file.
settings.load_profile(os.environ.get("FEEDER_HYPOTHESIS_PROFILE", "feeder-ci"))

SECRET = b"property-secret"
U32, U64 = 2**32 - 1, 2**64 - 1

# Seeds: the low 32 bits are what MT19937 sees, so both small seeds and seeds beyond 2^32 matter.
seeds = st.one_of(st.integers(0, 2**33), st.integers(0, 2**63 - 1))
epochs = st.integers(0, 2**31)


def _examples(n: int):
    """max_examples scaled from the loaded profile (explore runs each property proportionally more)."""
    return settings(max_examples=max(1, settings.default.max_examples * n // 60))


# ----------------------------------------------------------------------------- 1. sampler vs torch

@st.composite
def sampler_cases(draw):
    n = draw(st.one_of(st.integers(1, 70), st.integers(1, 5000)))   # small n: often n < world
    world = draw(st.integers(1, 64))
    rank = draw(st.integers(0, world - 1))
    return dict(n=n, world=world, rank=rank, seed=draw(seeds), epoch=draw(epochs), shuffle=draw(st.booleans()),
                drop_last=draw(st.booleans()))


@st.composite
def windows(draw, length: int):
    """[start, stop) of a list of `length`: anywhere in it (deep ones too), empty, reversed, or past its end."""
    start = draw(st.integers(0, length + 2))
    return start, draw(st.one_of(st.integers(start, length + 2), st.integers(0, length + 2)))


@_examples(400)
@given(case=sampler_cases(), data=st.data())
@example(case=dict(n=3, world=64, rank=63, seed=2**32 + 1, epoch=2**31, shuffle=True, drop_last=False),
         data=None)
@example(case=dict(n=1, world=1, rank=0, seed=2**63 - 1, epoch=0, shuffle=True, drop_last=True), data=None)
def test_rank_ids_equal_distributed_sampler_id_by_id(case, data):
    want = reference_ids(case["n"], case["world"], case["rank"], shuffle=case["shuffle"], seed=case["seed"],
                         drop_last=case["drop_last"], epoch=case["epoch"])
    per = sampler.per_rank(case["n"], case["world"], case["drop_last"])
    assert per == len(want)
    order = sampler.epoch_order(case["n"], case["seed"], case["epoch"], case["shuffle"])
    kw = dict(base=0, world=case["world"], rank=case["rank"], drop_last=case["drop_last"])
    # stop past the end is clamped to the rank's list, as a caller asking for "the rest" relies on
    assert sampler.rank_ids(order, start=0, stop=per + 7, **kw).tolist() == want
    # any window of the list, empty and out-of-range ones included (both the strided and the padded path)
    start, stop = data.draw(windows(per), label="window") if data else (0, 1)
    assert sampler.rank_ids(order, start=start, stop=stop, **kw).tolist() == want[start:stop]


@_examples(200)
@given(case=sampler_cases(), data=st.data())
def test_segment_is_distributed_sampler_over_the_rest_of_the_order(case, data):
    """A segment (base, world) deals order[base:] exactly as DistributedSampler deals a dataset of
    n - base samples without shuffling: the same padding by cycling, the same dropped tail."""
    from torch.utils.data import DistributedSampler

    n, world, rank, drop_last = case["n"], case["world"], case["rank"], case["drop_last"]
    base = data.draw(st.integers(0, n - 1), label="base")
    order = sampler.epoch_order(n, case["seed"], case["epoch"], case["shuffle"])
    local = list(DistributedSampler(range(n - base), num_replicas=world, rank=rank, shuffle=False,
                                    drop_last=drop_last))
    want = [int(order[base + i]) for i in local]
    per = sampler.per_rank(n - base, world, drop_last)
    assert per == len(want)
    kw = dict(base=base, world=world, rank=rank, drop_last=drop_last)
    assert sampler.rank_ids(order, start=0, stop=per + 1, **kw).tolist() == want
    start, stop = data.draw(windows(per), label="window")
    assert sampler.rank_ids(order, start=start, stop=stop, **kw).tolist() == want[start:stop]


@_examples(100)
@given(n=st.integers(0, 3000), seed=st.one_of(st.integers(0, 2**33), st.integers(0, U64)))
def test_randperm_of_both_torch_loops_equals_torch(n, seed):
    """The C forward loop gives torch.randperm's permutation; in uint32 and uint64 alike."""
    import torch

    from feeder.core import order

    g = torch.Generator()
    g.manual_seed(seed)
    want = torch.randperm(n, generator=g).numpy()
    assert np.array_equal(sampler.randperm(n, seed), want)
    assert np.array_equal(order.torch_randperm(n, seed, "torch", out=np.empty(n, dtype=np.uint64))[0], want)


# ----------------------------------------------------------------------------- 2. planning

def _spec(**kw) -> StreamSpec:
    kw.setdefault("job", "props")
    return StreamSpec(compression="", **kw)


@st.composite
def plan_cases(draw):
    n = draw(st.integers(1, 240))
    drop_last = draw(st.booleans())
    world = draw(st.integers(1, min(8, n) if drop_last else 8))
    seq_len = draw(st.integers(1, 5))
    return dict(n=n, n_tokens=n * seq_len + 1 + draw(st.integers(0, seq_len - 1)),
                spec=dict(world_size=world, seq_len=seq_len, micro_batch=draw(st.integers(1, 12)), seed=draw(seeds),
                          shuffle=draw(st.booleans()), drop_last=drop_last, epoch=draw(epochs),
                          num_epochs=draw(st.integers(1, 3))))


def _key(b):
    return b.epoch, b.step, b.ids.tolist(), b.cursor, b.samples_in_epoch


@_examples(150)
@given(case=plan_cases(), picks=st.lists(st.integers(0, 10**6), max_size=6), max_batches=st.integers(1, 9))
def test_plan_is_distributed_sampler_and_resumes_from_any_batch(case, picks, max_batches):
    n, sp = case["n"], case["spec"]
    per_epoch_counts = []
    for rank in range(sp["world_size"]):
        spec = _spec(rank=rank, **sp)
        plan = StreamPlan(spec, n_tokens=case["n_tokens"], fingerprint="f" * 64, cursor=None)
        assert plan.n == n
        batches = list(plan.batches())
        counts = []
        for epoch in range(spec.epoch, spec.end_epoch):
            mine = [b for b in batches if b.epoch == epoch]
            want = reference_ids(n, spec.world_size, rank, shuffle=spec.shuffle, seed=spec.seed,
                                 drop_last=spec.drop_last, epoch=epoch)
            assert [i for b in mine for i in b.ids.tolist()] == want, epoch
            assert [b.step for b in mine] == list(range(len(mine)))
            # full micro-batches; only an epoch's last may be short
            assert all(len(b.ids) == spec.micro_batch for b in mine[:-1])
            assert 0 < len(mine[-1].ids) <= spec.micro_batch
            counts.append(len(mine))
        assert [b.epoch for b in batches] == sorted(b.epoch for b in batches)
        per_epoch_counts.append(counts)
        # runs of any length are the same batches, cut differently
        flat = [i for r in plan.runs(max_batches=max_batches) for i in r.ids.tolist()]
        assert flat == [i for b in batches for i in b.ids.tolist()]

        # resume from the cursor of a batch: every batch when few, else the first, the last, the
        # last of each epoch (resume lands in the next epoch) and Hypothesis' picks
        if len(batches) <= 24:
            at = range(len(batches))
        else:
            ends = [i for i, b in enumerate(batches) if i + 1 == len(batches) or batches[i + 1].epoch != b.epoch]
            at = sorted({0, *ends, *(p % len(batches) for p in picks)})
        for i in at:
            c = Cursor.decode(batches[i].cursor.encode(SECRET), SECRET)
            assert c == batches[i].cursor
            rest = list(StreamPlan(spec, n_tokens=case["n_tokens"], fingerprint="f" * 64, cursor=c).batches())
            assert [_key(b) for b in rest] == [_key(b) for b in batches[i + 1:]], i
    # DDP hangs when ranks see different batch counts: every rank the same, every epoch
    assert all(c == per_epoch_counts[0] for c in per_epoch_counts)


@_examples(20)
@given(nw=st.integers(2, 64).flatmap(lambda w: st.tuples(st.integers(1, w - 1), st.just(w))))
def test_plan_refuses_drop_last_when_every_rank_would_get_nothing(nw):
    n, world = nw
    with pytest.raises(FailedPrecondition, match="fewer than world_size"):
        StreamPlan(_spec(rank=0, world_size=world, seq_len=1, micro_batch=1, drop_last=True), n_tokens=n + 1,
                   fingerprint="f", cursor=None)


@_examples(20)
@given(epoch=st.integers(U32 - 3, U32), num_epochs=st.integers(1, 5))
@example(epoch=U32, num_epochs=2)   # the minimal case
def test_regression_accepted_spec_writes_only_encodable_cursors(epoch, num_epochs):
    """Either the spec is refused as invalid, or every cursor its plan writes can be encoded."""
    try:
        spec = _spec(rank=0, world_size=1, seq_len=1, micro_batch=1, epoch=epoch, num_epochs=num_epochs)
    except InvalidArgument:
        return
    plan = StreamPlan(spec, n_tokens=3, fingerprint="f", cursor=None)
    writer = CursorWriter(plan.cursor_template(), SECRET)
    for run in plan.runs():
        writer.many(world=run.world, epoch=run.epoch, base=run.base, stops=run.stops.tolist(), first_step=run.step)
    for b in plan.batches():
        b.cursor.encode(SECRET)


# ----------------------------------------------------------------------------- 3. cursor

small_text = st.text(max_size=24)   # any unicode but surrogates (which no str.encode accepts)


@st.composite
def cursors(draw, text=small_text):
    u32, u64 = st.integers(0, U32), st.integers(0, U64)
    return Cursor(job=draw(text), fingerprint=draw(text), seed=draw(u64), shuffle=draw(st.booleans()),
                  drop_last=draw(st.booleans()), seq_len=draw(u32), world_size=draw(u32), rank=draw(u32),
                  epoch=draw(u32), base=draw(u64), pos=draw(u64), step=draw(u64), src=draw(positions(text)))


def positions(text):
    """Every kind of source position a cursor carries (none: a dataset on disk)."""
    u64 = st.integers(0, U64)
    follow = st.integers(0, 40).flatmap(lambda p: st.builds(
        KafkaFollow, partitions=st.just(p), next=st.tuples(*[u64] * p), turn=st.integers(0, max(p, 1) - 1), k=u64,
        skip=u64, i=u64))
    topic = st.integers(0, 4).flatmap(lambda p: st.builds(
        KafkaFollow, partitions=st.just(p), next=st.tuples(*[u64] * p), turn=st.integers(0, max(p, 1) - 1), k=u64,
        skip=st.just(0), i=st.just(0)))
    follow_mix = st.integers(1, 3).flatmap(lambda n: st.builds(
        KafkaFollowMix, names=st.tuples(*[text] * n), weights=st.tuples(*[st.floats(0, 1)] * n),
        topics=st.tuples(*[topic] * n), k=u64, skip=u64, i=u64))
    return st.one_of(st.none(), st.builds(KafkaEpoch, text), follow, follow_mix)


secrets_ = st.one_of(st.just(b""), st.binary(min_size=1, max_size=100))   # b"": the dev secret


@_examples(60)
@given(c=cursors(text=st.text(max_size=3000)), secret=secrets_)
@example(c=Cursor(job="ジョブ-🚀", fingerprint="e" * 65535, seed=U64, shuffle=True, drop_last=True, seq_len=U32,
                  world_size=U32, rank=U32, epoch=U32, base=U64, pos=U64, step=U64,
                  src=KafkaEpoch("t:0-" + "9" * 5000)),
         secret=b"k" * 65)
def test_cursor_round_trips(c, secret):
    assert Cursor.decode(c.encode(secret), secret) == c


@_examples(100)
@given(c=cursors(), secret=secrets_)
def test_cursor_any_single_bit_flip_or_truncation_is_refused(c, secret):
    """Every bit of every byte, and every shorter prefix: FailedPrecondition, never another
    exception (a struct.error or UnicodeDecodeError would be a 500), never a cursor."""
    blob = c.encode(secret)
    for i in range(len(blob)):
        for bit in range(8):
            bad = blob[:i] + bytes([blob[i] ^ (1 << bit)]) + blob[i + 1:]
            with pytest.raises(FailedPrecondition):
                Cursor.decode(bad, secret)
    for k in range(len(blob)):
        with pytest.raises(FailedPrecondition):
            Cursor.decode(blob[:k], secret)
    with pytest.raises(FailedPrecondition):   # and a byte too many
        Cursor.decode(blob + b"\0", secret)


@st.composite
def writer_runs(draw):
    """A stream's successive runs: its world size may change (re-dealt), its epoch and base move."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        stops = draw(st.lists(st.integers(0, U64 // 2), max_size=8))
        out.append(dict(world=draw(st.integers(1, U32)), epoch=draw(st.integers(0, U32)),
                        base=draw(st.integers(0, U64)), stops=stops,
                        first_step=draw(st.integers(0, U64 // 2))))
    return out


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
@_examples(150)
@given(template=cursors(), secret=secrets_, runs=writer_runs())
def test_cursor_writer_many_equals_encode(native, template, secret, runs):
    if native:
        assert cursor_mod._native_cursors is not None, "the C extension is built by make env"
    with mock.patch.object(cursor_mod, "_native_cursors", cursor_mod._native_cursors if native else None):
        w = CursorWriter(template, secret)
        for r in runs:
            got = w.many(**r)
            want = [dataclasses.replace(template, world_size=r["world"], epoch=r["epoch"], base=r["base"], pos=pos,
                                        step=r["first_step"] + j + 1).encode(secret)
                    for j, pos in enumerate(r["stops"])]
            assert got == want


# ----------------------------------------------------------------------------- 4. elastic re-dealing

@st.composite
def elastic_cases(draw):
    n = draw(st.integers(1, 400))
    drop_last = draw(st.booleans())
    worlds = st.integers(1, min(32, n) if drop_last else 32)   # drop_last with n < world: refused (above)
    changes = draw(st.lists(st.tuples(st.integers(0, 10**6), worlds), max_size=4))
    return dict(n=n, drop_last=drop_last, world=draw(worlds), changes=changes, mb=draw(st.integers(1, 6)),
                seed=draw(seeds), epoch=draw(epochs), shuffle=draw(st.booleans()),
                # which old rank's cursor new rank r resumes from: (r * a + b) % old world
                pick=(draw(st.integers(1, 97)), draw(st.integers(0, 97))))


def _simulate(case, pick):
    """All ranks of a job run in lockstep; at each change every rank stops after the same number of
    batches and the job restarts with another world size, each new rank resuming (reshard) from the
    cursor of some old rank, as a restarted trainer hands them out. Returns the batches delivered per
    segment as [(world, per-rank [(step, ids)]), ...], the segments' (base, world) dealings, and
    whether every restart came strictly inside the epoch."""
    n, mb = case["n"], case["mb"]
    segments, dealings, cursors_ = [], [], None
    inside = True   # every restart strictly inside the epoch (not after its last batch)
    worlds = [case["world"]] + [w for _, w in case["changes"]]
    stops = [k for k, _ in case["changes"]] + [None]   # None: the last segment runs to the epoch's end
    delivered_steps = 0
    for world, k in zip(worlds, stops):
        per_rank = []
        for rank in range(world):
            spec = _spec(rank=rank, world_size=world, seq_len=1, micro_batch=mb, seed=case["seed"],
                         shuffle=case["shuffle"], drop_last=case["drop_last"], epoch=case["epoch"], num_epochs=2,
                         reshard=True)
            c = None
            if cursors_ is not None:
                a, b = pick
                c = Cursor.decode(cursors_[(rank * a + b) % len(cursors_)].encode(SECRET), SECRET)
            plan = StreamPlan(spec, n_tokens=n + 1, fingerprint="fp", cursor=c)
            bs = list(plan.batches())
            this = [b for b in bs if b.epoch == case["epoch"]]
            per_rank.append((plan.start, this))
            if k is None:
                # the epoch after a re-dealt one is DistributedSampler's again, over the new world size
                after = [b for b in bs if b.epoch != case["epoch"]]
                assert [b.step for b in after] == list(range(len(after)))
                assert [i for b in after for i in b.ids.tolist()] == reference_ids(
                    n, world, rank, shuffle=case["shuffle"], seed=case["seed"], drop_last=case["drop_last"],
                    epoch=case["epoch"] + 1)
        left = [len(bs) for _, bs in per_rank]
        assert len(set(left)) == 1, f"ranks of world {world} would get {left} batches: DDP hangs"
        start = per_rank[0][0]
        dealings.append((start.base, start.world))
        if k is not None:
            # 0: restarted before a batch arrived; left[0]: right after the epoch's last batch
            k = k % (left[0] + 1)
            inside = inside and k < left[0]
        took = [bs if k is None else bs[:k] for _, bs in per_rank]
        for bs in took:   # steps run on across restarts: a rank's steps in the epoch are 0, 1, 2, ...
            assert [b.step for b in bs] == list(range(delivered_steps, delivered_steps + len(bs)))
        delivered_steps += len(took[0])
        segments.append((world, [[(b.step, b.ids.tolist()) for b in bs] for bs in took]))
        if took[0]:
            cursors_ = [bs[-1].cursor for bs in took]
        # k == 0: nobody moved; the next world resumes from the same cursors as this one did
    return segments, dealings, inside


@_examples(300)
@given(case=elastic_cases())
def test_elastic_redealing_delivers_each_id_once_up_to_padding(case):
    n, drop_last = case["n"], case["drop_last"]
    segments, dealings, inside = _simulate(case, case["pick"])
    got = Counter(i for _, ranks in segments for bs in ranks for _, ids in bs for i in ids)
    assert set(got) <= set(range(n))
    # DistributedSampler's own slack per dealing (padding for drop_last=False, the dropped tail for True)
    slack = [abs(w * sampler.per_rank(n - base, w, drop_last) - (n - base)) for base, w in dealings]
    repeats = sum(c - 1 for c in got.values())
    missing = n - len(got)
    if drop_last:
        assert repeats == 0, f"{repeats} ids delivered twice: {[i for i, c in got.items() if c > 1][:10]}"
        assert missing <= sum(slack), f"{missing} ids never delivered, slack {slack}"
        if inside:   # tighter: only the last dealing runs to its end, so only its tail is dropped
            assert missing == slack[-1]
    else:
        assert missing == 0, f"never delivered: {sorted(set(range(n)) - set(got))[:10]}"
        assert repeats <= sum(slack), f"{repeats} repeats, slack {slack}"
        if inside:   # only the last dealing reaches its padding
            assert repeats == slack[-1]
    # deterministic: the same run again, and with new ranks handed other old ranks' cursors
    assert _simulate(case, case["pick"]) == (segments, dealings, inside)
    assert _simulate(case, (1, 0)) == (segments, dealings, inside)


# ----------------------------------------------------------------------------- 5. mixtures

class _Tokens:
    """A source of `size` samples of seq_len 1 (the seam's Source, in memory)."""

    def __init__(self, name: str, size: int):
        self.name, self.fingerprint = name, f"fp-{name}-{size}"
        self.tokens = np.arange(size + 1, dtype=np.uint16)
        self.n_tokens, self.n_documents = size + 1, 1
        self.vocab_size, self.eos_id, self.dtype = 1 << 16, 0, np.dtype(np.uint16)

    # A chunk table of one chunk (feeder.sources.posix.locate_rows), as a mixture's parts are
    @property
    def chunk_starts(self):
        return np.asarray([0, self.n_tokens], dtype=np.int64)

    def chunk(self, k):
        return self.tokens

    def read(self, start, out):
        out[:] = self.tokens[start:start + len(out)]


@st.composite
def mixture_cases(draw):
    k = draw(st.integers(1, 4))
    names = [f"s{i}" for i in range(k)]
    sizes = [draw(st.integers(1, 30)) for _ in range(k)]
    weights = [draw(st.sampled_from([0.0, 1e-3, 0.25, 1.0, 2.5, 7.0, 1e3])) for _ in range(k)]
    if not any(weights):
        weights[0] = 1.0
    drop_last = draw(st.booleans())
    n = draw(st.integers(1, 120))
    world = draw(st.integers(1, min(8, n) if drop_last else 8))
    return dict(names=names, sizes=sizes, weights=weights, n=n, world=world, drop_last=drop_last,
                shuffle=draw(st.booleans()), seed=draw(st.integers(0, 2**40)), mb=draw(st.integers(1, 5)),
                epoch=draw(st.integers(0, 3)), epochs=draw(st.integers(1, 3)))


def _mixture_plan(case, rank, *, world=None, weights=None, cursor=None, remix=False, names=None):
    from feeder.sources.mixture import MixtureSource

    names = names or case["names"]
    sources = {nm: _Tokens(nm, size) for nm, size in zip(case["names"] + ["new"], case["sizes"] + [7])}
    mix = tuple(zip(names, weights or case["weights"]))
    spec = StreamSpec(job="mix", rank=rank, world_size=world or case["world"], seq_len=1, micro_batch=case["mb"],
                      seed=case["seed"], shuffle=case["shuffle"], drop_last=case["drop_last"], epoch=case["epoch"],
                      num_epochs=case["epochs"], mixture=mix, epoch_samples=case["n"], remix=remix,
                      reshard=cursor is not None)
    c = None if cursor is None else Cursor.decode(cursor.encode(SECRET), SECRET)
    return MixtureSource(mix, sources).plan(spec, c)


def _mixture_batches(plan):
    """[(epoch, step, [(source, id)], cursor)] of a whole plan, cursors written as the pipeline does."""
    out = []
    for run in plan.runs(7):
        at = run.start
        for j, stop in enumerate(run.stops.tolist()):
            a, b = at - run.start, stop - run.start
            cur = dataclasses.replace(plan.cursor_template(), world_size=run.world, epoch=run.epoch, base=run.base,
                                      pos=stop, step=run.step + j + 1)
            out.append((run.epoch, run.step + j, list(zip(run.sources[a:b].tolist(), run.ids[a:b].tolist())), cur,
                        run.positions[a:b].tolist(), run.base))
            at = stop
    return out


@_examples(120)
@given(case=mixture_cases())
def test_a_mixture_is_the_oracles_for_every_rank_and_epoch(case):
    """Positions by DistributedSampler, sources by Megatron's rule, draws by each source's
    permutations: the oracle (tests/mixture_oracle.py) written from the README, on random
    sizes, weights (zeros and extremes), worlds, drop_last, shuffle and start epochs."""
    from tests.mixture_oracle import Oracle

    oracle = Oracle(case["names"], case["sizes"], case["weights"], case["n"], seed=case["seed"],
                    shuffle=case["shuffle"], drop_last=case["drop_last"])
    counts = set()
    for rank in range(case["world"]):
        got = _mixture_batches(_mixture_plan(case, rank))
        counts.add(len(got))
        for e in range(case["epoch"], case["epoch"] + case["epochs"]):
            assert [p for ep, _, ps, *_ in got if ep == e for p in ps] == oracle.rank(case["world"], rank, e)
        # resumed from any of its cursors, the rest is the same
        if got:
            cut = case["seed"] % len(got)
            rest = _mixture_batches(_mixture_plan(case, rank, cursor=got[cut][3]))
            assert [b[:3] for b in rest] == [b[:3] for b in got[cut + 1:]]
    assert len(counts) == 1, "ranks would get different numbers of batches"


@_examples(120)
@given(case=mixture_cases(), changes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 8), st.booleans(),
                                                        st.sampled_from([0.1, 1.0, 4.0])), min_size=1, max_size=3))
def test_remixes_and_reshards_in_any_order_deliver_each_position_once_and_only_real_samples(case, changes):
    """Lockstep ranks stop after k batches and resume with another world size and/or new weights
    (remix; sometimes adding a source): every world's ranks get equal batches, each position of
    an epoch is delivered once up to DistributedSampler's slack per dealing, every sample is one
    its source has, and the same changes give the same batches."""
    n, drop_last = case["n"], case["drop_last"]

    def run():
        world, weights, names = case["world"], case["weights"], case["names"]
        cursors, delivered, dealings, positions, slack = None, [], [], Counter(), Counter()
        for k, new_world, add, w in [*changes, (None, None, None, None)]:
            if drop_last and world > n:
                world = n
            plans = [_mixture_plan(case, r, world=world, weights=weights, names=names,
                                   cursor=None if cursors is None else cursors[r % len(cursors)],
                                   remix=cursors is not None) for r in range(world)]
            got = [_mixture_batches(p) for p in plans]
            assert len({len(g) for g in got}) == 1, "DDP would hang"
            dealings.append((plans[0].start.epoch, plans[0].start.base, world))
            take = len(got[0]) if k is None else min(k, len(got[0]))
            for g in got:
                delivered += [(e, p) for e, _, ps, *_ in g[:take] for p in ps]
                positions.update((e, p) for e, _, _, _, pos, _ in g[:take] for p in pos)
            # DistributedSampler's slack of each dealing this world took part in (the last world's
            # run to the end, even where its share is empty)
            st = plans[0].start
            eps = range(st.epoch, case["epoch"] + case["epochs"]) if k is None else \
                {b[0] for b in got[0][:take]} | ({st.epoch} if take else set())
            for e in eps:
                base = st.base if e == st.epoch else 0
                slack[e] += abs(world * sampler.per_rank(n - base, world, drop_last) - (n - base))
            if k is None:
                break
            if take:
                cursors = [g[take - 1][3] for g in got]
            world = new_world
            names = case["names"] + (["new"] if add else [])
            weights = [*case["weights"][:len(case["names"])], w][:len(names)]
            if not any(weights):
                weights[0] = 1.0
        return delivered, dealings, positions, slack

    delivered, dealings, positions, slack = run()
    for e in range(case["epoch"], case["epoch"] + case["epochs"]):   # every epoch ran to its end
        got = Counter({p: c for (ep, p), c in positions.items() if ep == e})
        missing, repeats = n - len(got), sum(c - 1 for c in got.values())
        assert set(got) <= set(range(n))
        if drop_last:
            assert repeats == 0 and missing <= slack[e], (e, missing, slack[e])
        else:
            assert missing == 0 and repeats <= slack[e], (e, repeats, slack[e])
    sizes = dict(zip(case["names"] + ["new"], case["sizes"] + [7]))
    assert all(0 <= i < list(sizes.values())[d] for _, (d, i) in delivered)
    assert run() == (delivered, dealings, positions, slack)


def test_a_source_dropped_by_a_remix_and_mixed_in_again_goes_on_where_it_stood():
    """Found by the outside review of mixtures: web+code, then web alone, then web+code again.
    The re-added source started at its first draw again, so samples consumed before it was
    dropped came back within the same pass over it. A dropped source now keeps its counter."""
    case = dict(names=["s0", "s1"], sizes=[50, 50], weights=[1.0, 1.0], n=60, world=1, drop_last=False,
                shuffle=True, seed=7, mb=5, epoch=0, epochs=1)
    first = _mixture_batches(_mixture_plan(case, 0))[:2]
    alone = _mixture_batches(_mixture_plan(case, 0, weights=[1.0], names=["s0"], cursor=first[-1][3], remix=True))[:2]
    again = _mixture_batches(_mixture_plan(case, 0, weights=[1.0, 1.0], names=["s0", "s1"], cursor=alone[-1][3],
                                           remix=True))
    s1 = [i for b in first + alone + again for d, i in b[2] if d == 1]
    assert 0 < len(s1) < 50 and len(set(s1)) == len(s1), f"code repeated {len(s1) - len(set(s1))} samples early"
    assert again[0][3].src.offsets[1] == 30   # all 30 draws its first mixture assigned in epoch 0 skipped


@_examples(60)
@given(case=mixture_cases(), changes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 8), st.booleans(),
                                                        st.sampled_from([0.1, 1.0, 4.0])), max_size=2))
def test_a_mixtures_fill_table_and_its_run_by_run_fill_agree(case, changes):
    """Epochs up to FILL_TABLE_MAX positions are filled from a table per epoch, larger ones run
    by run: both give the same batches, through remixes too."""
    from feeder.core import blend as mx

    def all_batches():
        out, cursors, names, weights, world = [], None, case["names"], case["weights"], case["world"]
        for k, new_world, add, w in [*changes, (None, None, None, None)]:
            if case["drop_last"] and world > case["n"]:
                world = case["n"]
            got = [_mixture_batches(_mixture_plan(case, r, world=world, weights=weights, names=names,
                                                  cursor=None if cursors is None else cursors[r % len(cursors)],
                                                  remix=cursors is not None)) for r in range(world)]
            take = len(got[0]) if k is None else min(k, len(got[0]))
            out += [b[:3] for g in got for b in g[:take]]
            if k is None:
                break
            if take:
                cursors = [g[take - 1][3] for g in got]
            world, names = new_world, case["names"] + (["new"] if add else [])
            weights = [*case["weights"], w][:len(names)]
        return out

    table = all_batches()
    saved = mx.FILL_TABLE_MAX
    try:
        mx.FILL_TABLE_MAX = 0
        assert all_batches() == table
    finally:
        mx.FILL_TABLE_MAX = saved
