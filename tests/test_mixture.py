"""Mixtures (issue 18): one job drawn from several named sources by weight.

Everything served is checked against an oracle written here from the README's rules, not from
the feeder's code: DistributedSampler (torch's own) for the positions, Megatron-LM's blending
loop (transcribed from megatron/core/datasets/helpers.cpp) for each position's source, and
torch.randperm for each source's permutations. Real `feeder serve` processes, real gRPC.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from feeder.core.errors import Code
from feeder.core.errors import FeederError
from feeder_client import FeederDataset
from tests.helpers import FeederProc, byte_stream, make_docs, prep_docs, reference_ids
from tests.mixture_oracle import Oracle, megatron_blend, remixed_rank, source_perm

SEQ = 16
NAMES = ("web", "code", "news")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three datasets of different sizes, and their packed streams computed without the feeder."""
    out = {}
    for name, (n, seed) in zip(NAMES, ((160, 11), (50, 12), (90, 13))):
        docs = make_docs(n, seed=seed)
        out[name] = (prep_docs(tmp_path_factory.mktemp(name), docs, shard_tokens=2000, chunk_tokens=500),
                     byte_stream(docs))
    return out


def sizes_of(corpora, names, seq=SEQ):
    return tuple((len(corpora[n][1]) - 1) // seq for n in names)


def source_flags(corpora, names=NAMES):
    flags = []
    for n in names:
        flags += ["--source", f"{n}={corpora[n][0]}"]
    return flags


@pytest.fixture(scope="module")
def mixfeeder(corpora):
    f = FeederProc(None, source=f"{NAMES[0]}={corpora[NAMES[0]][0]}", extra=source_flags(corpora, NAMES[1:]))
    yield f
    f.stop()


def take(ds, limit=None):
    """[(epoch, step, [(source, id)], tokens, cursor)] of a pass (up to `limit` batches)."""
    out = []
    for b in ds:
        out.append((b.epoch, b.step, list(zip(b.sources.tolist(), b.sample_ids.tolist())), b.tokens.numpy(),
                    b.cursor))
        if limit and len(out) >= limit:
            break
    return out


def by_epoch(batches):
    got = {}
    for e, _, pairs, _, _ in batches:
        got.setdefault(e, []).extend(pairs)
    return got


def check_tokens(corpora, names, batches, seq=SEQ):
    for _, _, pairs, tokens, _ in batches:
        for (d, i), row in zip(pairs, tokens):
            stream = corpora[names[d]][1]
            assert (row == stream[i * seq:i * seq + seq + 1]).all(), f"sample {i} of {names[d]} differs"


def ds(feeder, job, world, rank, mixture, **kw):
    kw = {"seq_len": SEQ, "micro_batch": 4, "seed": 5, "num_epochs": 1, "retry_for_s": 20, **kw}
    return FeederDataset([feeder.address] if hasattr(feeder, "address") else feeder, job=job, rank=rank,
                         world_size=world, mixture=mixture, **kw)


# -- the rules, against the oracle --------------------------------------------------------------

def test_blending_is_megatrons_bit_for_bit():
    """The feeder's blending (C, and its Python fallback) against the transcription above, over
    weights that make ties and tiny shares."""
    from feeder.core import blend as mx

    rng = random.Random(0)
    cases = [[1, 1], [0.7, 0.3], [1, 2, 3], [1e-3, 1, 5], [0.25, 0.25, 0.5], [3, 0, 1]]
    cases += [[rng.random() for _ in range(rng.randint(1, 6))] for _ in range(10)]
    for weights in cases:
        size = rng.randint(1, 3000)
        want = megatron_blend(weights, size)
        index, draw, counts = mx.blend(mx.normalized(weights), size)
        assert (index.tolist(), draw.tolist()) == want
        assert counts.tolist() == [want[0].count(d) for d in range(len(weights))]
    saved = mx._native_blend
    try:
        mx._native_blend, mx._BLEND_CACHE = None, type(mx._BLEND_CACHE)()
        index, draw, _ = mx.blend(mx.normalized([0.5, 0.2, 0.3]), 999)
        assert (index.tolist(), draw.tolist()) == megatron_blend([0.5, 0.2, 0.3], 999)
    finally:
        mx._native_blend, mx._BLEND_CACHE = saved, type(mx._BLEND_CACHE)()


def test_follow_mode_interleave_is_megatrons_rule_from_any_slot():
    """A follow-mode mixture of topics (issue 26): slot k's topic, and which of its records fills
    it, are Megatron's blending rule run on without end, the same from whatever slot a stream
    resumes at (a pure function of the weights and the slot)."""
    from feeder.core import blend as mx

    rng = random.Random(2)
    for weights in ([0.7, 0.3], [1, 2, 3], [3, 0, 1], [1e-3, 1, 5], [rng.random() for _ in range(7)]):
        index, _ = megatron_blend(weights, 6000)
        for start in [0, 1, 2, *rng.sample(range(5500), 5)]:
            counts = [index[:start].count(d) for d in range(len(weights))]   # each topic's records taken before
            got = mx.interleave(mx.normalized(weights), start, counts, 500)
            assert got == index[start:start + 500], (weights, start)
            assert counts == [index[:start + 500].count(d) for d in range(len(weights))]


def test_draws_spanning_many_permutations_are_each_permutations_own():
    """A small source upsampled in a large epoch spans thousands of its permutations in one fill
    (the outside review: a one-sample source at weight 0.5 took 92 s to a first batch over 10^6
    positions; grouping by a mask per permutation was quadratic). Draws in any order, sources of
    1, 2, 3 samples and one above SMALL_SOURCE (cached orders), against torch.randperm."""
    from feeder.core import blend as mx
    from feeder.core.cursor import Mixture

    sizes = (1, 2, 3, mx.SMALL_SOURCE + 5)
    names = ("one", "two", "three", "big")
    mix = Mixture(names=names, fingerprints=("a", "b", "c", "d"), weights=mx.normalized([1, 1, 1, 1]),
                  offsets=(0, 0, 0, 0), epoch_samples=1)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 4, 3000)
    draws = np.where(src == 3, rng.integers(0, 3 * sizes[3], 3000), rng.integers(0, 600, 3000))
    for shuffle in (True, False):
        got = mx.sample_ids(mix, sizes, src, draws, seed=9, shuffle=shuffle).tolist()
        want = [source_perm(sizes[d], 9, names[d], k // sizes[d], shuffle)[k % sizes[d]]
                for d, k in zip(src.tolist(), draws.tolist())]
        assert got == want


def test_megatron_cores_own_blending_agrees_where_it_installs():
    """Against megatron-core's own C++ helper where it imports here; otherwise against the
    transcription (test above), and the output says which."""
    from feeder.core import blend as mx

    try:
        from megatron.core.datasets import helpers_cpp
    except Exception:   # noqa: BLE001 - not installed, or its C++ helper not built on this machine
        helpers_cpp = None
    rng = random.Random(1)
    cases = [([0.5, 0.3, 0.2], 5000), ([0.7, 0.3], 2849), ([1, 1], 999), ([3, 0, 1], 777), ([1e-3, 1, 5], 4000)]
    cases += [([rng.random() for _ in range(rng.randint(1, 8))], rng.randint(1, 20000)) for _ in range(10)]
    for weights, size in cases:
        index, draw, _ = mx.blend(mx.normalized(weights), size)
        if helpers_cpp is None:
            print("megatron-core not importable here: checked against the transcription only")
            assert (index.tolist(), draw.tolist()) == megatron_blend(weights, size)
            continue
        # megatron-core's own normalize() and C++ blending (what its BlendedDataset runs)
        di = np.zeros(size, dtype=np.int16)
        dsi = np.zeros(size, dtype=np.int64)
        from megatron.core.datasets.utils import normalize

        assert tuple(normalize(weights)) == mx.normalized(weights)
        helpers_cpp.build_blending_indices(di, dsi, np.array(normalize(weights)), len(weights), size, False)
        assert (index == di).all() and (draw == dsi).all(), weights


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (False, True), (True, True), (False, False)])
def test_every_rank_gets_distributed_sampler_positions_filled_by_megatrons_rule(corpora, mixfeeder, world, shuffle,
                                                                                  drop_last):
    names, weights = ("web", "code"), (0.7, 0.3)
    sizes = sizes_of(corpora, names)
    n = sum(sizes)
    oracle = Oracle(names, sizes, weights, n, seed=5, shuffle=shuffle, drop_last=drop_last)
    job = f"grid-{world}-{shuffle}-{drop_last}"
    per_source = Counter()
    for rank in range(world):
        batches = take(ds(mixfeeder, job, world, rank, dict(zip(names, weights)), shuffle=shuffle,
                          drop_last=drop_last, num_epochs=2))
        got = by_epoch(batches)
        for e in (0, 1):
            assert got[e] == oracle.rank(world, rank, e), f"rank {rank} epoch {e}"
        per_source.update(d for d, _ in got[0])
        if rank == 0:
            check_tokens(corpora, names, batches)
    # the epoch's per-source counts are Megatron's (up to DistributedSampler's padding/drop)
    want = Counter(megatron_blend(weights, n)[0])
    slack = abs(world * (n // world if drop_last else -(-n // world)) - n)
    assert sum(abs(per_source[d] - want[d]) for d in (0, 1)) <= slack


def test_without_replacement_across_epochs_for_an_upsampled_and_a_downsampled_source(corpora, mixfeeder):
    """code (small) weighted far above its size, web (large) far below: over 3 epochs no sample
    of a source repeats before all of its samples were drawn."""
    names = ("web", "code")
    sizes = sizes_of(corpora, names)
    batches = take(ds(mixfeeder, "replacement", 1, 0, {"web": 0.2, "code": 0.8}, num_epochs=3))
    drawn = {0: [], 1: []}
    for e in range(3):
        for d, i in by_epoch(batches)[e]:
            drawn[d].append(i)
    assert len(drawn[1]) > 2 * sizes[1] and len(drawn[0]) < sizes[0]   # really up- and downsampled
    # Draws of a source run through one permutation after another, so after T draws every
    # sample was drawn T // n or T // n + 1 times (with replacement some would be 0 or 3+ times).
    for d in (0, 1):
        times = Counter(drawn[d])
        t, n = len(drawn[d]), sizes[d]
        assert set(times) <= set(range(n))
        assert {times[i] for i in range(n)} <= {t // n, t // n + 1}, names[d]
    assert max(Counter(drawn[0]).values()) == 1   # downsampled: nothing twice
    check_tokens(corpora, names, batches)


# -- exactness where it holds for one dataset ---------------------------------------------------

def test_resume_from_random_cursors_equals_the_uninterrupted_run(corpora, mixfeeder):
    mix = {"web": 0.5, "code": 0.3, "news": 0.2}
    whole = take(ds(mixfeeder, "resume", 2, 1, mix, num_epochs=2))
    rng = random.Random(7)
    for cut in sorted(rng.sample(range(len(whole) - 1), 20)):
        rest = take(ds(mixfeeder, "resume", 2, 1, mix, num_epochs=2, cursor=whole[cut][4]))
        assert [(e, s, p) for e, s, p, _, _ in rest] == [(e, s, p) for e, s, p, _, _ in whole[cut + 1:]], cut


def test_a_sigkilled_feeder_mid_epoch_fails_over_exactly(corpora, tmp_path):
    names, weights = ("web", "code"), (0.6, 0.4)
    sizes = sizes_of(corpora, names)
    oracle = Oracle(names, sizes, weights, sum(sizes), seed=5, shuffle=True, drop_last=False)
    flags = source_flags(corpora, names)
    a = FeederProc(None, source=flags[1], extra=flags[2:])
    b = FeederProc(None, source=flags[1], extra=flags[2:])
    try:
        d = FeederDataset([a.address, b.address], job="failover", rank=0, world_size=2, seq_len=SEQ, micro_batch=2,
                          seed=5, mixture=dict(zip(names, weights)), num_epochs=1, retry_for_s=30, read_ahead=1,
                          prefer="order")
        got = []
        for k, batch in enumerate(d):
            got.extend(zip(batch.sources.tolist(), batch.sample_ids.tolist()))
            if k == 40:
                a.signal(signal.SIGKILL)
        assert got == oracle.rank(2, 0, 0)
    finally:
        a.stop()
        b.stop()


def test_four_ranks_to_three_mid_epoch_deal_the_rest_once(corpora, mixfeeder):
    names, weights = ("web", "code"), (0.7, 0.3)
    sizes = sizes_of(corpora, names)
    n = sum(sizes)
    oracle = Oracle(names, sizes, weights, n, seed=5, shuffle=True, drop_last=False)
    mix = dict(zip(names, weights))
    before = [take(ds(mixfeeder, "elastic", 4, r, mix), limit=30) for r in range(4)]
    after = [take(ds(mixfeeder, "elastic", 3, r, mix, cursor=before[0][-1][4], reshard=True)) for r in range(3)]
    served = Counter(p for bs in before + after for _, _, pairs, _, _ in bs for p in pairs)
    # every position of the epoch was filled once, up to DistributedSampler's padding of the rest
    want = Counter(oracle.fill(0, p) for p in range(n))
    assert not set(want) - set(served)
    extra = sum((served - want).values())
    assert extra < 3
    assert len({len(bs) for bs in after}) == 1


def test_remix_at_a_random_step_continues_under_the_new_weights(corpora, mixfeeder):
    """A remix re-deals the epoch's rest under the new weights (README "Mixtures"): the rest of
    the epoch's global order dealt over the ranks as DistributedSampler deals a list, each
    remaining position's source by Megatron's rule over the remaining positions in ascending
    order, each source's draws going on after every draw the old mixture made in the epoch
    (a source new to the mixture from its first); later epochs entirely under the new rule."""
    old_w, new_w = (0.8, 0.2), (0.3, 0.5, 0.2)
    names3 = ("web", "code", "news")
    sizes = sizes_of(corpora, names3)
    n = sizes[0] + sizes[1]          # epoch_samples: the old mixture's default, kept by the remix
    world, mb = 2, 4
    cut = random.Random(3).randint(5, 40)
    old, new = dict(zip(names3, old_w)), dict(zip(names3, new_w))
    before = [take(ds(mixfeeder, "remix", world, r, old, num_epochs=3), limit=cut) for r in range(world)]
    cursor = before[0][-1][4]
    with pytest.raises(FeederError) as e:   # without remix=True: refused, naming both mixtures
        take(ds(mixfeeder, "remix", world, 0, new, num_epochs=3, cursor=cursor, retry_for_s=5))
    assert e.value.code == Code.FAILED_PRECONDITION
    assert "mixture differs" in str(e.value) and "web=0.8" in str(e.value) and "news=0.2" in str(e.value)
    after = [take(ds(mixfeeder, "remix", world, r, new, num_epochs=3, cursor=cursor, remix=True))
             for r in range(world)]
    for bs in after:
        check_tokens(corpora, names3, bs)

    base = world * mb * cut
    for rank in range(world):
        want = remixed_rank(names3, sizes, old_w, new_w, n, world=world, rank=rank, base=base, seed=5, epochs=3)
        got = by_epoch(after[rank])
        assert got[0] == want[0], f"rank {rank}: the rest of epoch 0"
        for e in (1, 2):
            assert got[e] == want[e], f"rank {rank}: epoch {e}"
        assert [s for _, s, _, _, _ in after[rank]][0] == cut   # steps go on from the cursor's


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mixture,code,words", [
    ({"web": 1, "nope": 1}, Code.NOT_FOUND, ["'nope'", "served"]),
    ({"web": -1, "code": 1}, Code.INVALID_ARGUMENT, ["weight of 'web'", ">= 0"]),
    ({"web": 0, "code": 0}, Code.INVALID_ARGUMENT, ["must not all be 0"]),
    ({"web": float("nan"), "code": 1}, Code.INVALID_ARGUMENT, ["finite"]),
    ({"web": 1.7e308, "code": 1e308}, Code.INVALID_ARGUMENT, ["finite sum"]),   # normalized, all 0 (review)
    ([("web", 1), ("web", 2)], Code.INVALID_ARGUMENT, ["twice"]),
])
def test_bad_mixtures_are_refused_precisely(corpora, mixfeeder, mixture, code, words):
    with pytest.raises(FeederError) as e:
        take(ds(mixfeeder, "bad", 1, 0, mixture, retry_for_s=3))
    assert e.value.code == code, e.value
    for w in words:
        assert w in str(e.value), e.value


def test_a_source_with_another_vocabulary_or_too_small_is_refused_naming_it(corpora, tmp_path):
    import dataclasses
    import shutil

    from feeder.sources import manifest as mf

    other = tmp_path / "other"                  # the same shards, recorded with another EOS
    shutil.copytree(corpora["code"][0], other)
    m = mf.read(other)
    (other / mf.NAME).unlink()
    mf.write(other, dataclasses.replace(m, eos_id=10))
    (tmp_path / "tiny").mkdir()
    tiny = prep_docs(tmp_path / "tiny", ["ab"])
    f = FeederProc(None, source=f"web={corpora['web'][0]}", extra=["--source", f"other={other}",
                                                                    "--source", f"tiny={tiny}"])
    try:
        for mix, words in (({"web": 1, "other": 1}, ["'other'", "eos_id"]), ({"web": 1, "tiny": 1}, ["'tiny'"])):
            with pytest.raises(FeederError) as e:
                take(ds(f, "vocab", 1, 0, mix, retry_for_s=3))
            assert e.value.code == Code.FAILED_PRECONDITION, e.value
            for w in words:
                assert w in str(e.value)
    finally:
        f.stop()


def test_a_tampered_mixture_in_a_cursor_is_refused(corpora, mixfeeder):
    b = take(ds(mixfeeder, "tamper", 1, 0, {"web": 0.7, "code": 0.3}), limit=3)[-1]
    cur = bytearray(b[4])
    at = bytes(cur).find(b"code")
    cur[at] ^= 0x20    # "Code": another source name, under the same MAC
    with pytest.raises(FeederError) as e:
        take(ds(mixfeeder, "tamper", 1, 0, {"web": 0.7, "code": 0.3}, cursor=bytes(cur), retry_for_s=3))
    assert e.value.code == Code.FAILED_PRECONDITION and "verification" in str(e.value)


def test_serve_refuses_an_unnamed_source_among_several(corpora):
    p = subprocess.run([sys.executable, "-m", "feeder.cli", "serve", "--source", str(corpora["web"][0]),
                        "--source", f"code={corpora['code'][0]}", "--listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a name" in lines[0], p.stderr


def test_the_ledger_and_audit_count_a_mixtures_positions_and_sources(corpora, tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    flags = source_flags(corpora, ("web", "code"))
    f = FeederProc(None, source=flags[1], extra=[*flags[2:], "--ledger", str(ledger), "--metrics-port", "0"])
    try:
        got = Counter()
        for r in range(3):
            got.update(d for _, _, pairs, _, _ in take(ds(f, "audited", 3, r, {"web": 0.75, "code": 0.25}))
                       for d, _ in pairs)
        # metrics name each source: samples sent from each, per rank
        from tests.test_ops import scrape, value

        m = scrape(f.metrics)
        for d, name in enumerate(("web", "code")):
            assert sum(value(m, "feeder_source_samples_total", job="audited", rank=r, source=name)
                       for r in range(3)) == got[d]
        st = subprocess.run([sys.executable, "-m", "feeder.cli", "status", "--target", f.address],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "300"})
        assert "audited" in st.stdout and "web+code" in st.stdout, st.stdout
    finally:
        f.stop()
    p = subprocess.run([sys.executable, "-m", "feeder.cli", "audit", str(ledger)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "every sample delivered exactly once" in p.stdout, p.stdout
    n = sum(sizes_of(corpora, ("web", "code")))
    want = Counter(megatron_blend([0.75, 0.25], n)[0])
    # padding (n not divisible by 3) may add a position or two to either source
    import re
    m = re.search(r"web (\d+)/[\d.]+, code (\d+)/", p.stdout)
    assert m, p.stdout
    assert 0 <= int(m.group(1)) - want[0] <= 2 and 0 <= int(m.group(2)) - want[1] <= 2


@pytest.mark.parametrize("workers,persistent", [(2, False), (3, True)])
def test_dataloader_workers_deliver_the_mixture_in_order_through_a_new_pass(corpora, mixfeeder, workers, persistent):
    """DataLoader workers over a mixture: the round-robin restores the exact order, and a new
    pass after load_state_dict goes on from the main process's cursor."""
    import multiprocessing as mp

    from torch.utils.data import DataLoader

    names, weights = ("web", "code"), (0.6, 0.4)
    sizes = sizes_of(corpora, names)
    oracle = Oracle(names, sizes, weights, sum(sizes), seed=5, shuffle=True, drop_last=False)
    d = ds(mixfeeder, f"workers-{workers}", 2, 1, dict(zip(names, weights)), num_epochs=2)
    dl = DataLoader(d, batch_size=None, num_workers=workers, persistent_workers=persistent,
                    multiprocessing_context=mp.get_context("spawn"))
    got, steps = [], []
    for k, b in enumerate(dl):
        got.append(list(zip(b.sources.tolist(), b.sample_ids.tolist())))
        steps.append((b.epoch, b.step))
        if k == 24:
            d.load_state_dict({**d.state_dict(), "cursor": b.cursor})
            break
    for b in dl:   # the second pass, from the cursor of the batch above
        got.append(list(zip(b.sources.tolist(), b.sample_ids.tolist())))
        steps.append((b.epoch, b.step))
    flat = {0: [], 1: []}
    for (e, _), pairs in zip(steps, got):
        flat[e].extend(pairs)
    assert flat[0] == oracle.rank(2, 1, 0) and flat[1] == oracle.rank(2, 1, 1)


def test_a_replica_whose_source_differs_is_moved_past_on_resume(corpora, tmp_path):
    """Feeder A serves "code" from other bytes than B: a cursor written on B is refused by A
    as another replica's (FAILED_PRECONDITION, tried elsewhere), and the rank resumes on B."""
    names, weights = ("web", "code"), (0.5, 0.5)
    (tmp_path / "other").mkdir()
    other = prep_docs(tmp_path / "other", make_docs(50, seed=99))
    a = FeederProc(None, source=f"web={corpora['web'][0]}", extra=["--source", f"code={other}"])
    b = FeederProc(None, source=f"web={corpora['web'][0]}", extra=["--source", f"code={corpora['code'][0]}"])
    try:
        mix = dict(zip(names, weights))
        first = take(ds(b, "stale", 1, 0, mix), limit=5)
        rest = take(FeederDataset([a.address, b.address], job="stale", rank=0, world_size=1, seq_len=SEQ,
                                  micro_batch=4, seed=5, mixture=mix, cursor=first[-1][4], prefer="order",
                                  retry_for_s=20))
        whole = take(ds(b, "stale-whole", 1, 0, mix))
        assert [p for _, _, p, _, _ in first + rest] == [p for _, _, p, _, _ in whole]
        check_tokens(corpora, names, rest)
        with pytest.raises(FeederError) as e:
            take(ds(a, "stale", 1, 0, mix, cursor=first[-1][4], retry_for_s=3))
        assert e.value.code == Code.FAILED_PRECONDITION and "'code'" in str(e.value)
    finally:
        a.stop()
        b.stop()


def test_a_region_file_names_several_sources(corpora, tmp_path):
    """`source = ["web=DIR", "code=DIR2"]` in a region file (paths relative to the file, as for
    one source): the feeder serves both by name, the first as its default."""
    from feeder_client import feeder_info

    region = tmp_path / "r.toml"
    rel = os.path.relpath(corpora["code"][0], tmp_path)
    region.write_text(f'source = ["web={corpora["web"][0]}", "code={rel}"]\nregion = "mix"\n')
    p = subprocess.Popen([sys.executable, "-m", "feeder.cli", "serve", "--config", str(region), "--listen",
                          "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "listening on" in line, p.stderr.read()
        address = line.split("listening on ")[1].strip()
        info = feeder_info([address])
        assert set(info.datasets) == {"web", "code"} and info.region == "mix"
        assert info.fingerprint == feeder_info([address], dataset="web").fingerprint
        assert take(ds([address], "region-file", 1, 0, {"web": 1, "code": 1}), limit=2)
    finally:
        p.kill()
        p.wait(10)


def test_the_second_review_a_corrupt_chunk_and_a_short_epoch_name_the_mixtures_part(corpora, tmp_path):
    """DATA_LOSS in a mixture names the source (every prepped source has a shard-00000.arrow),
    and drop_last over too few positions names epoch_samples, not "the dataset"."""
    import shutil

    from feeder.sources import manifest as mf
    from feeder.core.config import StreamSpec
    from feeder.core.errors import DataLoss
    from feeder.sources.mixture import MixtureSource
    from feeder.sources.open import open_source

    bad = tmp_path / "code"
    shutil.copytree(corpora["code"][0], bad)
    shard = bad / mf.read(bad).shards[0].path
    data = bytearray(shard.read_bytes())
    at = data.find(open_source(str(bad)).chunk(0).tobytes())   # inside the first chunk's tokens
    assert at > 0
    data[at + 10] ^= 0xFF
    shard.write_bytes(bytes(data))
    mix = MixtureSource((("web", 1.0), ("code", 1.0)), {"web": open_source(corpora["web"][0]),
                                                         "code": open_source(str(bad))})
    # (epoch_samples left to the sources' sum: code's half of it draws every code sample)
    spec = StreamSpec(job="j", rank=0, world_size=1, seq_len=SEQ, micro_batch=4, mixture=(("web", 1.0), ("code", 1.0)))
    plan = mix.plan(spec, None)
    with pytest.raises(DataLoss, match="mixture source 'code': shard .* is corrupt"):
        for run in plan.runs():
            plan.locate(run.ids * SEQ, SEQ + 1, run.sources).gather(plan.dtype)
    short = StreamSpec(**{**spec.__dict__, "world_size": 50, "drop_last": True, "epoch_samples": 40})
    with pytest.raises(FeederError, match="the mixture's epoch_samples is 40, fewer than world_size 50"):
        mix.plan(short, None)


def test_found_by_the_outside_review_names_sizes_and_numpy_numbers(corpora, mixfeeder, tmp_path, monkeypatch):
    """An epoch_samples past int64 positions is INVALID_ARGUMENT at once (it was INTERNAL,
    retried; issue 25 lifted the 2^31 cap of a materialized epoch); any printable source name without = or / is a name; a single existing directory
    whose name holds "=" (Hive style) is still one unnamed source; numpy's scalars are numbers."""
    import numpy as np

    from feeder.core.config import named_sources

    with pytest.raises(FeederError) as e:
        take(ds(mixfeeder, "huge", 1, 0, {"web": 1, "code": 1}, epoch_samples=2**63, retry_for_s=3))
    assert e.value.code == Code.INVALID_ARGUMENT and "epoch_samples must be at most" in str(e.value)
    assert named_sources(["日本語=/x", "a b=/y"]) == {"sources": (("日本語", "/x"), ("a b", "/y"))}
    with pytest.raises(FeederError, match="a name may not hold '/'"):   # (the second review)
        named_sources(["web=/x", "a/b=/y"])
    hive = tmp_path / "date=2024-01-01"
    hive.mkdir()
    monkeypatch.chdir(tmp_path)
    assert named_sources(["date=2024-01-01"]) == {"source": "date=2024-01-01"}
    got = take(ds(mixfeeder, "numpy", 1, 0, {"web": np.float32(0.7), "code": np.float64(0.3)},
                  epoch_samples=np.int64(50)))
    assert sum(len(p) for _, _, p, _, _ in got) == 50
