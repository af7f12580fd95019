"""Mixture schedules (issue 46): weights keyed by training progress, changed live, exact on resume.

Checked against tests/schedule_oracle.py (written from docs/mixtures.md): a seeded generator of
schedules and dealings through the plans, then a real feeder with ranks, `feeder mix` and
`feeder audit`."""
from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from feeder.core import schedule as sc
from feeder.core.config import StreamSpec
from feeder.core.errors import FeederError
from feeder.domain.schedules import Schedules
from feeder.sources import Context
from feeder.sources import scheduled  # noqa: F401 (registers the scheduled plan, as a server does)
from feeder.sources.mixture import MixtureParts
from tests.helpers import FeederProc, reference_ids
from tests.schedule_oracle import Blend, Segments, sample
from tests.test_mixture import SEQ, check_tokens, corpora, sizes_of, source_flags  # noqa: F401 (corpora: a fixture)


class Part:
    """A source of `n` samples of SEQ tokens (the plans need only its sizes and identity)."""

    def __init__(self, n: int, fp: str):
        self.n_tokens, self.fingerprint, self.n_documents = n * SEQ + 1, fp, 1
        self.vocab_size, self.eos_id, self.dtype = 100, 0, np.dtype(np.uint32)


def random_table(rng: random.Random, names, horizon: int) -> list[dict]:
    """1-5 segments, constant or linear, over [0, horizon)."""
    k = rng.randint(1, 5)
    cuts = sorted(rng.sample(range(1, horizon), k - 1))
    segs = []
    for j in range(k):
        w = {n: rng.choice([0, 0.5, 1, 2, 3, rng.random()]) for n in names}
        if not any(w.values()):
            w[names[0]] = 1
        seg = {"weights": w}
        if j < k - 1:
            seg["until"] = cuts[j]
            if rng.random() < 0.5:
                to = {n: rng.random() for n in names}
                seg["to"] = to
        segs.append(seg)
    return segs


def plans_of(parts, names, table, *, world, ctx, epochs, drop_last, seed, **kw):
    sched = sc.parse({"segment": table})
    mp = MixtureParts(names, sched.segments[0].weights, parts, tuple(p.fingerprint for p in parts))
    spec = StreamSpec(job=kw.pop("job", "j"), rank=0, world_size=world, seq_len=SEQ, micro_batch=kw.pop("mb", 3),
                      mixture=tuple(zip(names, sched.segments[0].weights)), mixture_schedule=sched.canonical(),
                      num_epochs=epochs, drop_last=drop_last, seed=seed, **kw)
    return mp, spec, sched


def rank_samples(mp, spec, rank, ctx, cursor=None, limit=None):
    """[(epoch, index, source, id)] of a rank's stream, and the plan."""
    plan = mp.plan(dataclasses.replace(spec, rank=rank), cursor, ctx)
    out, runs = [], 0
    for run in plan.runs(4):
        out += [(run.epoch, int(i), int(s), int(d)) for i, s, d in zip(run.positions, run.sources, run.ids)]
        runs += 1
        if limit and runs >= limit:
            break
    return out, plan


def reference(names, sizes, table, seed, splice=None):
    seg = Segments.from_table(names, table)
    if splice is not None:
        at, new_table = splice
        seg = seg.spliced(Segments.from_table(names, new_table), at)
    return Blend(seg, len(names))


@pytest.mark.parametrize("case", range(12))
def test_every_sample_of_random_schedules_is_the_references(case):
    """2-4 sources, 1-5 segments, random worlds, epochs, resumes from random cursors, a world
    change and a live change mid-epoch: each sample's source and id are the reference's for its
    progress; each epoch's indexes are DistributedSampler's (shuffle off) for the rank."""
    rng = random.Random(4600 + case)
    k = rng.randint(2, 4)
    names = tuple(f"s{d}" for d in range(k))
    sizes = [rng.randint(5, 300) for _ in range(k)]
    parts = [Part(n, f"fp{d}") for d, n in enumerate(sizes)]
    n = sum(sizes)
    epochs, world, seed = rng.randint(1, 3), rng.randint(1, 4), rng.randrange(1 << 40)
    drop_last = rng.random() < 0.3
    table = random_table(rng, names, n * epochs)
    ctx = Context(schedules=Schedules())
    mp, spec, sched = plans_of(parts, names, table, world=world, ctx=ctx, epochs=epochs, drop_last=drop_last,
                               seed=seed, job=f"case{case}")
    blend = reference(names, sizes, table, seed)
    for r in range(world):
        got, plan = rank_samples(mp, spec, r, ctx)
        want_idx = [(e, i) for e in range(epochs) for i in reference_ids(n, world, r, shuffle=False, seed=seed,
                                                                           drop_last=drop_last, epoch=e)]
        assert [(e, i) for e, i, _, _ in got] == want_idx
        for e, i, s, d in got:
            assert (s, d) == sample(blend, names, sizes, seed, True, e * n + i), (r, e, i)
        # resumed from a random cursor (as the feeder writes it after a batch): the rest, exactly
        cut = rng.randint(0, max(0, len(got) - 1))
        plan2 = mp.plan(dataclasses.replace(spec, rank=r), None, ctx)
        taken, cursor = 0, None
        tmpl = plan2.cursor_template()
        for run in plan2.runs(4):
            for j, stop in enumerate(run.stops.tolist()):
                a = int(run.stops[j - 1]) if j else run.start
                taken += stop - a
                cursor = dataclasses.replace(tmpl, world_size=run.world, epoch=run.epoch, base=run.base, pos=stop,
                                             step=run.step + j + 1)
                if taken >= cut:
                    break
            if taken >= cut:
                break
        if cursor is not None:
            rest, _ = rank_samples(mp, spec, r, ctx, cursor=cursor)
            assert rest == got[taken:], (r, taken)


def test_a_world_change_and_a_live_change_mid_epoch_deal_every_index_once_under_the_spliced_schedule():
    names = ("web", "code", "math")
    sizes = [900, 400, 250]
    parts = [Part(n, f"fp{d}") for d, n in enumerate(sizes)]
    n, seed = sum(sizes), 77
    table = [{"until": 900, "weights": {"web": 6, "code": 3, "math": 1}},
             {"weights": {"web": 3, "code": 3, "math": 4}}]
    books = Schedules()
    ctx = Context(schedules=books)
    mp, spec, sched = plans_of(parts, names, table, world=4, ctx=ctx, epochs=2, drop_last=False, seed=seed,
                               job="wc", mb=8)
    # 4 ranks take 10 runs of 4 batches each, then the world becomes 3 (reshard from their cursors)
    seen = {}
    cursors = {}
    for r in range(4):
        plan = mp.plan(dataclasses.replace(spec, rank=r), None, ctx)
        tmpl = plan.cursor_template()
        for j, run in enumerate(plan.runs(4)):
            seen.update({(run.epoch, int(i)): (int(s), int(d)) for i, s, d in zip(run.positions, run.sources, run.ids)})
            cursors[r] = dataclasses.replace(tmpl, world_size=run.world, epoch=run.epoch, base=run.base,
                                             pos=int(run.stops[-1]), step=run.step + len(run.stops))
            if j == 9:
                break
    # a live change: prepared, then committed at P past everything planned
    book = books.get("wc")
    at = book.prepare()
    assert at % sc.BLOCK == 0 and at >= max(e * n + i for e, i in seen) + 1
    change = [{"until": 3000, "weights": {"web": 1, "code": 1, "math": 1}, "to": {"web": 0, "code": 1, "math": 3}},
              {"weights": {"web": 1, "code": 0, "math": 0}}]
    new = sc.spliced(sched, sc.parse({"segment": change}), at)
    book.commit(new, at)
    blend = reference(names, sizes, table, seed, splice=(at, change))
    again = {0: 0, 1: 0}
    for r in range(3):
        got, _ = rank_samples(mp, dataclasses.replace(spec, world_size=3, reshard=True), r, ctx, cursor=cursors[r])
        for e, i, s, d in got:
            if (e, i) in seen:   # DistributedSampler's padding: the same sample again
                assert seen[(e, i)] == (s, d)
                again[e] += 1
            seen[(e, i)] = (s, d)
    # every index of both epochs, once but for the padding of each epoch's last dealing (< 3)
    assert again[0] <= 2 and again[1] <= 2
    for e in range(2):
        assert {i for (ee, i) in seen if ee == e} == set(range(n))
    for (e, i), got in seen.items():
        assert got == sample(blend, names, sizes, seed, True, e * n + i), (e, i)
    # cursors written after the change carry it: a plan resumed from one takes version 1
    fresh = Schedules()
    late = mp.plan(dataclasses.replace(spec, world_size=3, reshard=True, rank=0), cursors[0], ctx)
    assert late.schedule.version == 1
    ctx2 = Context(schedules=fresh)
    plan = mp.plan(dataclasses.replace(spec, world_size=3, rank=0), None, ctx2)
    plan.cursor_template()
    runs = plan.runs(4)
    for _ in range(2):   # (planned short of the change's point: what a feeder that never heard of it may do)
        assert next(runs).cursors is None   # (no change known here: the template's cursors)
    late_cursor = dataclasses.replace(cursors[0], src=late.pos)
    mp.plan(dataclasses.replace(spec, world_size=4, rank=0), late_cursor, ctx2)
    assert fresh.get("wc").version == 1   # learned from the cursor
    rest = [(run.epoch, int(i), int(s), int(d)) for run in runs for i, s, d in zip(run.positions, run.sources, run.ids)]
    assert rest and all((s, d) == sample(blend, names, sizes, seed, True, e * n + i) for e, i, s, d in rest)


def test_shares_over_windows_of_100k_samples_are_within_1_percent_of_the_schedule():
    rng = random.Random(46)
    for _ in range(3):
        k = rng.randint(2, 4)
        names = tuple(f"s{d}" for d in range(k))
        table = random_table(rng, names, 2_000_000)
        sched = sc.parse({"segment": table})
        b = sc.blending(sched)
        b._grow(2_000_000)
        src, _ = b.at(sc.slots_of(np.arange(2_000_000), 9))
        for lo in range(0, 2_000_000, 100_000):
            got = np.bincount(src[lo:lo + 100_000], minlength=k) / 100_000
            want = (sched.target(lo + 100_000) - sched.target(lo)) / 100_000
            assert np.abs(got - want).max() <= 0.01, (lo, got, want)


def test_a_constant_schedule_blends_as_megatron_and_the_c_loop_as_the_python_one():
    from feeder.core import blend as mx

    sched = sc.parse({"segment": [{"weights": {"a": 5, "b": 3, "c": 2}}]})
    src, draw = sc.Blending(sched).at(np.arange(50_000))
    idx, dr, _ = mx.blend(mx.normalized([5, 3, 2]), 50_000)
    assert (src == idx).all() and (draw == dr).all()
    ramp = sc.parse({"segment": [{"until": 7000, "weights": {"a": 1, "b": 0}, "to": {"a": 0, "b": 1}},
                                 {"weights": {"a": 1, "b": 3}}]})
    native = sc.Blending(ramp).at(np.arange(20_000))
    saved = sc._native_at, sc._native_checkpoints
    try:
        sc._native_at = sc._native_checkpoints = None
        python = sc.Blending(ramp).at(np.arange(20_000))
    finally:
        sc._native_at, sc._native_checkpoints = saved
    assert all((a == b).all() for a, b in zip(native, python))


@pytest.mark.parametrize("bad,words", [
    ({"segment": [{"weights": {"a": 1}, "until": 10}, {"weights": {"b": 1}}]}, "not one of the schedule's sources"),
    ({"segment": [{"weights": {"a": 1, "b": 1}}, {"weights": {"a": 1}}]}, "needs `until`"),
    ({"segment": [{"weights": {"a": 1, "b": 1}, "to": {"a": 0, "b": 1}}]}, "cannot ramp"),
    ({"segment": [{"until": 5, "weights": {"a": 1, "b": 1}}, {"until": 5, "weights": {"a": 1}}, {"weights": {"a": 1}}]},
     "must be past where it starts"),
    ({"segment": [{"weights": {"a": -1, "b": 1}}]}, "finite number >= 0"),
    ({"segment": [{"weights": {"a": 0, "b": 0}}]}, "must not all be 0"),
    # (outside review: a ramp on the last segment with an end, and weights whose sum overflows)
    ({"segment": [{"until": 1000, "weights": {"a": 3, "b": 1}, "to": {"a": 1, "b": 1}}]}, "cannot ramp"),
    ({"segment": [{"weights": {"a": 1e308, "b": 1e308}}]}, "sum overflows"),
    ({"segment": [{"weights": {}}]}, "weights must be a table"),
    ({"segment": [{"weights": 3}]}, "weights must be a table"),
    ({"unit": "tokens", "segment": [{"weights": {"a": 1}}]}, "--seq-len"),
    ({"unit": "bytes", "segment": [{"weights": {"a": 1}}]}, "samples or tokens"),
    ({"segments": []}, "at least one"),
])
def test_bad_schedules_are_refused_saying_what_was_expected(bad, words):
    with pytest.raises(FeederError, match=words):
        sc.parse(bad)


# -- a real feeder: ranks, a live change with `feeder mix`, the ledger and `feeder audit` --------------------------

NAMES = ("web", "code")


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "feeder.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "300"})


def test_a_live_change_while_ranks_read_switches_every_rank_at_one_position_exactly_once(corpora, tmp_path):  # noqa: F811
    from feeder_client import FeederDataset

    ledger = tmp_path / "ledger.jsonl"
    flags = source_flags(corpora, NAMES)
    f = FeederProc(None, source=flags[1], extra=[*flags[2:], "--ledger", str(ledger), "--cache-dir", str(tmp_path / "c"),
                                                      "--metrics-port", "0"])
    sizes = sizes_of(corpora, NAMES)
    n = sum(sizes)
    table = [{"weights": {"web": 3, "code": 1}}]
    seed, world = 5, 2
    try:
        def ds(rank, **kw):
            return FeederDataset([f.address], job="live", rank=rank, world_size=world, seq_len=SEQ, micro_batch=4,
                                 seed=seed, num_epochs=3, retry_for_s=20, mixture_schedule={"segment": table}, **kw)

        its = [iter(ds(r)) for r in range(world)]
        got = {r: [] for r in range(world)}
        for r in range(world):
            for _ in range(5):
                got[r].append(next(its[r]))
        change = tmp_path / "anneal.toml"
        change.write_text('[[segment]]\nuntil = 200\nweights = {web = 3, code = 1}\nto = {web = 0, code = 1}\n'
                          '[[segment]]\nweights = {web = 1, code = 4}\n')
        p = _cli("mix", "live", "--schedule", str(change), "--relative", "--target", f.address)
        assert p.returncode == 0, p.stderr
        at = int(p.stdout.split("from progress ")[1].split(" ")[0].replace(",", ""))
        assert "version 1" in p.stdout
        # one rank is killed (its iterator dropped) and resumed from its last cursor
        resume = got[1][-1].cursor
        its[1] = iter(ds(1, cursor=resume))
        for r in range(world):
            got[r] += list(its[r])
        st = _cli("status", "--target", f.address)
        assert "schedule v1" in st.stdout and f"changed at {at:,}" in st.stdout, st.stdout
        from tests.test_ops import scrape, value

        m = scrape(f.metrics)
        assert value(m, "feeder_mixture_schedule_version", job="live") == 1
        shares = [value(m, "feeder_mixture_share", job="live", source=s, kind=k) for s in NAMES
                  for k in ("scheduled", "actual")]
        assert abs(sum(shares[0::2]) - 1) < 1e-6 and abs(sum(shares[1::2]) - 1) < 1e-6
        assert abs(shares[0] - shares[1]) < 0.02   # web: actual within 2% of scheduled
    finally:
        f.stop()
    change_table = [{"until": 200, "weights": {"web": 3, "code": 1}, "to": {"web": 0, "code": 1}},
                    {"weights": {"web": 1, "code": 4}}]
    shifted = [dict(s, until=s["until"] + at) if "until" in s else s for s in change_table]
    blend = reference(NAMES, sizes, table, seed, splice=(at, [{"until": at, "weights": {"web": 3, "code": 1}},
                                                               *shifted]))
    for r in range(world):
        batches = got[r]
        pairs = [(b.epoch, (int(s), int(i))) for b in batches for s, i in zip(b.sources.tolist(),
                                                                               b.sample_ids.tolist())]
        want = [(e, sample(blend, NAMES, sizes, seed, True, e * n + i)) for e in range(3)
                for i in reference_ids(n, world, r, shuffle=False, seed=seed, drop_last=False, epoch=e)]
        assert pairs == want, f"rank {r}"
        check_tokens(corpora, NAMES, [(b.epoch, b.step, list(zip(b.sources.tolist(), b.sample_ids.tolist())),
                                       b.tokens.numpy(), b.cursor) for b in batches])
    a = _cli("audit", str(ledger))
    assert a.returncode == 0 and "exactly once" in a.stdout, a.stdout + a.stderr
    import json

    changes = [r for r in map(json.loads, ledger.read_text().splitlines()) if "mix" in r]
    assert [(r["mix"], r["at"], json.loads(r["schedule"])["version"]) for r in changes] == [("live", at, 1)]


def test_feeder_mix_refuses_clearly_without_a_traceback(corpora, tmp_path):  # noqa: F811
    flags = source_flags(corpora, NAMES)
    f = FeederProc(None, source=flags[1], extra=flags[2:])
    try:
        bad = tmp_path / "bad.toml"
        bad.write_text("[[segment]]\nweights = {web = 0, code = 0}\n")
        good = tmp_path / "good.toml"
        good.write_text("[[segment]]\nweights = {web = 1, code = 1}\n")
        for args, words in ((["nojob", "--schedule", str(good)], "serves job 'nojob' with a mixture schedule"),
                            (["j", "--schedule", str(bad)], "weights must not all be 0"),
                            (["j", "--schedule", str(tmp_path / "missing.toml")], "cannot read"),
                            (["j"], "needs --schedule")):
            p = _cli("mix", *args, "--target", f.address)
            assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr
        from tests.helpers import free_port

        p = _cli("mix", "j", "--schedule", str(good), "--target", f.address, "--target", f"127.0.0.1:{free_port()}")
        assert p.returncode == 2 and "cannot reach" in p.stderr and "Traceback" not in p.stderr, p.stderr
        p = _cli("mix", "j", "--abort", "--target", f.address)
        assert p.returncode == 0, p.stderr
    finally:
        f.stop()


@pytest.mark.parametrize("policy", ["constant", "shrink"])
def test_elastic_steps_of_a_scheduled_mixture_are_the_references_at_their_progress(policy):
    """Live elasticity (a step's part dealt over the replicas live at it) over a schedule: each
    sample is the reference's at its progress, and each step's indexes are dealt once."""
    names = ("a", "b", "c")
    sizes = [200, 120, 40]
    parts = [Part(n, f"fp{d}") for d, n in enumerate(sizes)]
    n, seed = sum(sizes), 11
    table = [{"until": 150, "weights": {"a": 1, "b": 1, "c": 1}, "to": {"a": 0, "b": 1, "c": 4}},
             {"weights": {"a": 5, "b": 1, "c": 0}}]
    ctx = Context(schedules=Schedules())
    mp, spec, _ = plans_of(parts, names, table, world=3, ctx=ctx, epochs=1, drop_last=False, seed=seed,
                           job=f"el-{policy}", mb=2, global_batch=policy, accumulation=2,
                           **({"start_replicas": 2} if policy == "constant" else {}))
    blend = reference(names, sizes, table, seed)
    by_step: dict = {}
    for r in range(3):
        plan = mp.plan(dataclasses.replace(spec, rank=r), None, ctx)
        for run in plan.runs(4):
            assert run.cursors is not None   # (an elastic run's own cursors)
            for i, s, d in zip(run.positions.tolist(), run.sources.tolist(), run.ids.tolist()):
                assert (s, d) == sample(blend, names, sizes, seed, True, run.epoch * n + i)
                by_step.setdefault(run.step, []).append(i)
    seen = [i for step in sorted(by_step) for i in by_step[step]]
    assert len(set(seen)) == n   # every index of the epoch, in one step each (padding repeats a few)


def test_regression_chaos_4600018_a_batch_sent_again_across_a_live_change_is_the_same_batch():
    """Soak seed 4600018 (--kinds mix,...): a rank moved off a slow feeder after a live change,
    and the new feeder sent again a batch from before the change point, its cursor carrying the
    new schedule version; the client took the differing bytes for feeders that disagree. Two
    cursors of one place whose schedules differ only by a change are the same place; another
    place, or a schedule that started elsewhere, is not."""
    from feeder.core.cursor import Cursor, Scheduled, same_place

    base = sc.parse({"segment": [{"weights": {"a": 1, "b": 1}}]})
    v1 = sc.spliced(base, sc.parse({"segment": [{"weights": {"a": 0, "b": 1}}]}), 512)
    other = sc.parse({"segment": [{"weights": {"a": 2, "b": 1}}]})

    def cursor(schedule, pos=8):
        src = Scheduled(names=("a", "b"), fingerprints=("fa", "fb"), epoch_samples=1000, schedule=schedule.canonical())
        return Cursor(job="j", fingerprint="mix-x", seed=1, shuffle=True, drop_last=False, seq_len=16, world_size=2,
                      rank=0, epoch=0, base=0, pos=pos, step=2, src=src).encode(b"secret")

    assert cursor(base) != cursor(v1) and same_place(cursor(base), cursor(v1))
    assert not same_place(cursor(base), cursor(v1, pos=12))
    assert not same_place(cursor(base), cursor(other))


def test_regression_chaos_4610025_a_change_after_a_restart_lands_past_what_the_process_before_sent(tmp_path):
    """Soak seed 4610025: a feeder sent a whole epoch, was SIGKILLed and restarted, and no rank
    opened a stream on the new process before `feeder mix`: the new process knew nothing of the
    job, the change was put at the other feeder's frontier, and the ranks had consumed samples
    past it under the old schedule. A feeder now records how far it may plan before it serves
    it, and a restarted one answers a prepare from that record."""
    base = sc.parse({"segment": [{"weights": {"a": 1, "b": 1}}]})
    before = Schedules(str(tmp_path))
    book = before.book("job", base)
    book.take(70_001)                      # (a run planned up to progress 70,000)
    after = Schedules(str(tmp_path))       # the restarted process: no stream of the job yet
    assert after.get("job") is None
    again = after.recorded("job")
    assert again is not None and again.prepare() >= 70_001
    new = sc.spliced(base, sc.parse({"segment": [{"weights": {"a": 0, "b": 1}}]}), again.hold)
    with pytest.raises(FeederError, match="past the change"):
        again.commit(sc.Schedule(names=new.names, segments=new.segments, version=1, base=new.base), sc.BLOCK)
    assert again.commit(new, again.hold) is new
    # and a third process, from the log alone, serves version 1 with the hold gone
    third = Schedules(str(tmp_path)).book("job", base)
    assert third.version == 1 and third.hold is None and third.take(80_000).version == 1


def test_a_commit_that_rewrites_the_schedule_before_its_point_is_refused():
    """Outside review: a raw Mix commit of another schedule from 0 was taken, and a resume then
    returned other samples than were sent."""
    base = sc.parse({"segment": [{"weights": {"a": 1, "b": 1}}]})
    book = Schedules().book("rw", base)
    book.take(300)
    at = book.prepare()
    other = sc.parse({"segment": [{"weights": {"a": 0, "b": 1}}]})
    forged = sc.Schedule(names=other.names, segments=other.segments, version=1, base=base.base)
    with pytest.raises(FeederError, match="rewrites the schedule before"):
        book.commit(forged, at)
    assert book.commit(sc.spliced(base, other, at), at).version == 1


def test_regression_review_a_change_learned_late_from_a_cursor_past_what_was_served_fails_loudly():
    """Outside review (issue 46): a feeder with its own cache directory, not a target of `feeder
    mix`, resumed one rank from a cursor written before a change and served it past the change's
    point under the old schedule; another rank's cursor then brought the change, and was taken
    silently, so the two ranks were served by two schedules. Nothing already sent can be taken
    back: the rank's stream ends, and the cursor that brings the change is refused, each saying
    what happened and what to do; the feeder serves the change from then on."""
    names, sizes = ("a", "b"), [600, 400]
    parts = [Part(n, f"fp{d}") for d, n in enumerate(sizes)]
    table = [{"weights": {"a": 1, "b": 1}}]
    here = Context(schedules=Schedules())
    mp, spec, sched = plans_of(parts, names, table, world=2, ctx=here, epochs=2, drop_last=False, seed=3, job="late")
    plan0 = mp.plan(dataclasses.replace(spec, rank=0), None, here)
    tmpl = plan0.cursor_template()
    first = next(plan0.runs(4))
    old_cursor = dataclasses.replace(tmpl, pos=int(first.stops[-1]), step=first.step + len(first.stops))
    book = here.schedules.get("late")
    at = book.prepare()
    new = sc.spliced(sched, sc.parse({"segment": [{"weights": {"a": 0, "b": 1}}]}), at)
    book.commit(new, at)
    assert sc.diverges(sched, new) == at and sc.diverges(new, new) is None and sc.diverges(sched, sched) is None
    v1_cursor = dataclasses.replace(old_cursor, src=dataclasses.replace(tmpl.src, schedule=new.canonical()))
    # another feeder, which never heard of the change: rank 1 resumes from its pre-change cursor
    there = Context(schedules=Schedules())
    rank1 = mp.plan(dataclasses.replace(spec, rank=1), dataclasses.replace(old_cursor, rank=1), there)
    runs1 = rank1.runs(4)
    while rank1.reached <= at + sc.BLOCK:
        next(runs1)
    with pytest.raises(FeederError, match=f"served progress up to .* past change 1 at progress {at:,}"):
        mp.plan(dataclasses.replace(spec, rank=0), v1_cursor, there)
    with pytest.raises(FeederError, match=f"this rank was sent progress .* past change 1 at progress {at:,}"):
        next(runs1)
    # from then on the feeder serves the change: a rank resumed from before the point gets version 1
    again = mp.plan(dataclasses.replace(spec, rank=0), v1_cursor, there)
    assert again.schedule.version == 1
    assert mp.plan(dataclasses.replace(spec, rank=1), dataclasses.replace(old_cursor, rank=1), there).schedule.version == 1
    # and a cursor of the old schedule written past the point (rank 1's, from the stream that went
    # past it) is refused, as on the feeder that made the change
    late_pos = (at + sc.BLOCK) // 2
    for ctx in (there, here):
        with pytest.raises(FeederError, match=f"version 0 after progress .* past change 1 at {at:,}"):
            mp.plan(dataclasses.replace(spec, rank=1), dataclasses.replace(old_cursor, rank=1, pos=late_pos), ctx)
    ok_pos = (at - 1) // 2   # (its last sample, 1 + 2 * (ok_pos - 1), is before the point)
    assert mp.plan(dataclasses.replace(spec, rank=1), dataclasses.replace(old_cursor, rank=1, pos=ok_pos),
                   here).schedule.version == 1


def test_regression_review_a_cursor_of_another_job_changes_nothing_of_this_one():
    """Outside review: job A's cursor, carrying A's live change, was refused by job B's stream
    (the job differs) only after B's book had taken A's schedule, and recorded it."""
    names, sizes = ("a", "b"), [300, 200]
    parts = [Part(n, f"fp{d}") for d, n in enumerate(sizes)]
    ctx = Context(schedules=Schedules())
    table = [{"weights": {"a": 3, "b": 1}}]
    mp, spec_a, sched = plans_of(parts, names, table, world=1, ctx=ctx, epochs=1, drop_last=False, seed=5, job="A")
    spec_b = dataclasses.replace(spec_a, job="B")
    plan_a = mp.plan(spec_a, None, ctx)
    tmpl = plan_a.cursor_template()
    next(plan_a.runs(2))
    mp.plan(spec_b, None, ctx)   # (job B's book, from the same starting schedule)
    at = ctx.schedules.get("A").prepare()
    new = sc.spliced(sched, sc.parse({"segment": [{"weights": {"a": 0, "b": 1}}]}), at)
    ctx.schedules.get("A").commit(new, at)
    a_cursor = dataclasses.replace(tmpl, pos=3, step=1, src=dataclasses.replace(tmpl.src, schedule=new.canonical()))
    with pytest.raises(FeederError, match="job differs"):
        mp.plan(spec_b, a_cursor, ctx)
    assert ctx.schedules.get("B").version == 0 and ctx.schedules.get("A").version == 1


def test_regression_review_a_restarted_feeder_that_served_past_a_change_it_missed_still_says_so(tmp_path):
    """Outside review: the loud refusal of a change learned late counted only what this process
    planned; a restart on the same cache directory forgot what its predecessor had served past
    the change's point, and took the change silently."""
    base = sc.parse({"segment": [{"weights": {"a": 1, "b": 1}}]})
    Schedules(str(tmp_path)).book("job", base).take(9_000)   # served past 8,192 under version 0, then killed
    new = sc.spliced(base, sc.parse({"segment": [{"weights": {"a": 0, "b": 1}}]}), 4096)
    restarted = Schedules(str(tmp_path)).book("job", base)
    with pytest.raises(FeederError, match="process before it .* past change 1 at progress 4,096"):
        restarted.adopt(new)
    assert restarted.version == 1


def test_regression_review_a_change_past_the_segments_a_job_may_hold_is_refused_before_any_feeder_waits():
    """Outside review: the fourth change of 256 segments made a schedule of more than 1,024, which
    each feeder refused at the commit ("the first segment must start at 0"), after the prepare:
    the ranks waited at the change point, and feeder mix again failed the same way. The splice is
    checked where feeder mix makes it, before any commit, saying why."""
    names = ("a", "b")
    big = sc.parse({"segment": [{"until": 10 * (j + 1), "weights": {"a": 1 + j % 3, "b": 1}}
                                for j in range(sc.MAX_SEGMENTS - 1)] + [{"weights": {"a": 1, "b": 1}}]})
    s = sc.parse({"segment": [{"weights": {"a": 1, "b": 1}}]})
    at = 0
    with pytest.raises(FeederError, match="at most 1024 segments over all its live changes"):
        for _ in range(5):
            at += 12 * sc.BLOCK   # (past the last change's segments: each adds all of its own)
            s = sc.spliced(s, sc.shifted(big, at), at)
    assert s.version == 3 and len(s.segments) <= sc.MAX_HISTORY and s.names == names
