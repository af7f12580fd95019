"""Live elasticity (feeder.core.steps): a global step's part for each of the replicas live at it.

A seeded generator of scenarios (worlds changing at every attempt, steps that do not commit,
streams resumed inside a step, several epochs, both policies, drop_last, both orders) run
against an oracle written from torch's DistributedSampler alone; then the same through real
gRPC: ElasticFeeder, a replica that joins with no state, failover to a second feeder sharing
the commit log, and the errors a caller can get."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from feeder.core.config import ServeConfig, StreamSpec
from feeder.core.errors import Code, FeederError
from feeder.core.planning import StreamPlan
from feeder.service.server import ServerThread
from tests.elastic_oracle import Oracle, ds_list

SEQ = 8
L = 512   # the gRPC tests' seq_len: an epoch of a few dozen steps


def _spec(sc, rank, world, step, **kw):
    return StreamSpec(job="j", rank=rank, world_size=world, seq_len=SEQ, micro_batch=sc["mb"], seed=sc["seed"],
                      shuffle=sc["shuffle"], drop_last=sc["drop_last"], num_epochs=sc["epochs"],
                      permutation=sc["permutation"], global_batch=sc["policy"], accumulation=sc["acc"],
                      start_replicas=sc["w0"] if sc["policy"] == "constant" else 0, first_step=step, **kw)


def _part(sc, step, rank, world, cursor=None):
    """Replica rank of world's runs from `step` on (the plan alone, no server), first run only."""
    plan = StreamPlan(_spec(sc, rank, world, step), n_tokens=sc["n"] * SEQ + 1, fingerprint="f", cursor=cursor)
    for run in plan.runs():
        return run
    return None


def scenario(seed: int) -> dict:
    rng = random.Random(seed)
    return dict(n=rng.randint(5, 90), w0=rng.randint(1, 4), mb=rng.randint(1, 3), acc=rng.randint(1, 3),
                drop_last=rng.random() < 0.3, seed=rng.randint(0, 99), shuffle=rng.random() < 0.9,
                permutation=rng.choice(["torch", "stateless"]), policy=rng.choice(["constant", "shrink"]),
                epochs=rng.randint(1, 2), rng=rng)


def run_scenario(sc: dict) -> dict:
    """Attempts of steps in random worlds, some not committed, some replicas' streams resumed
    inside the step; checked step by step against the oracle, then the epochs as wholes."""
    rng = sc["rng"]
    oracle = Oracle(n=sc["n"], w0=sc["w0"], mb=sc["mb"], acc=sc["acc"], drop_last=sc["drop_last"], seed=sc["seed"],
                    permutation=sc["permutation"], shuffle=sc["shuffle"], policy=sc["policy"])
    committed: dict[int, Counter] = {}
    cursor = None   # shrink: after the last committed step
    step, attempts = 0, 0
    while attempts < 400:
        attempts += 1
        world = rng.randint(1, sc["w0"] + 2)
        runs = [_part(sc, step, r, world, cursor) for r in range(world)]
        if all(run is None for run in runs):
            break   # every epoch dealt
        got = Counter(i for run in runs for i in run.ids.tolist())
        total = {int(v) for run in runs for v in run.elastic[:, 2]}
        assert len(total) == 1 and sum(got.values()) == total.pop(), (sc, step, world)
        for run in runs:   # each batch says how many its replica has, and which it is
            assert run.elastic[:, 0].tolist() == [len(run)] * len(run) or run.elastic[0, 0] == 0
            assert all(c <= sc["mb"] for c in np.diff([run.start, *run.stops.tolist()]))
            assert run.step == step
        if sc["policy"] == "constant":
            epoch, want = oracle.constant(step)
            after = None
        else:
            epoch, want, after = oracle.shrink(world)
        assert got == want, (sc, step, world)
        assert {run.epoch for run in runs if len(run.ids)} <= {epoch}
        r = rng.randrange(world)   # a stream broken inside the step resumes in it, this replica alone
        if len(runs[r]) > 1:
            k = rng.randrange(1, len(runs[r]))
            again = _part(sc, step, r, world, runs[r].cursors[k - 1])
            assert again.ids.tolist() == runs[r].ids[int(runs[r].stops[k - 1]) - runs[r].start:].tolist()
            if world > 1:   # ... and is refused to another replica or world
                with pytest.raises(FeederError, match="inside step"):
                    _part(sc, step, (r + 1) % world, world, runs[r].cursors[k - 1])
        if rng.random() < 0.8:
            committed.setdefault(epoch, Counter())
            committed[epoch] += got
            if after is not None:
                oracle.commit(after)
            cursor = runs[0].cursors[-1]
            step += 1
    assert attempts < 400
    # Every epoch whole: each sample once (beyond DistributedSampler's padding, or what drop_last leaves out).
    for epoch in range(sc["epochs"]):
        why = oracle.epoch_whole(epoch, committed.get(epoch, Counter()), sc["w0"] + 2)
        assert not why, (sc, why)
    return committed


@pytest.mark.parametrize("block", range(8))
def test_generated_scenarios_against_distributed_sampler(block):
    """400 seeded scenarios (8 blocks of 50), each up to 400 attempts."""
    for seed in range(block * 50, block * 50 + 50):
        run_scenario(scenario(seed))


@pytest.mark.parametrize("policy", ["constant", "shrink"])
@pytest.mark.parametrize("n,world,mb,acc,drop_last", [(103, 3, 2, 3, False), (64, 4, 1, 2, True), (10, 3, 4, 1, False)])
def test_unchanged_world_is_distributed_sampler(policy, n, world, mb, acc, drop_last):
    """With no change of world a replica's ids are DistributedSampler(num_replicas=replicas)'s."""
    sc = dict(n=n, w0=world, mb=mb, acc=acc, drop_last=drop_last, seed=5, shuffle=True, permutation="torch",
              policy=policy, epochs=2)
    for r in range(world):
        plan = StreamPlan(_spec(sc, r, world, 0), n_tokens=n * SEQ + 1, fingerprint="f", cursor=None)
        got: dict[int, list] = {}
        for run in plan.runs():
            got.setdefault(run.epoch, []).extend(run.ids.tolist())
        for epoch in range(2):
            s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=5, drop_last=drop_last)
            s.set_epoch(epoch)
            assert got[epoch] == list(s)


def test_replicas_beyond_the_steps_micro_batches_get_an_empty_part():
    sc = dict(n=40, w0=2, mb=2, acc=1, drop_last=False, seed=0, shuffle=True, permutation="torch",
              policy="constant", epochs=1)
    runs = [_part(sc, 0, r, 3) for r in range(3)]
    assert [len(r.ids) for r in runs] == [2, 2, 0]
    assert runs[2].elastic[:, :3].tolist() == [[0, 0, 4]]


# Through real gRPC


@pytest.fixture(scope="module")
def two_feeders(dataset, tmp_path_factory):
    """Two feeders of one region: the same data, cache directory (the commit log) and secret."""
    cache = tmp_path_factory.mktemp("elastic-cache")
    cfg = dict(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096, cache_dir=str(cache),
               cursor_secret=b"s" * 32)
    a, b = (ServerThread(ServeConfig(**cfg, ledger=str(cache / f"ledger-{k}.jsonl"))) for k in "ab")
    yield a, b
    a.stop()
    b.stop()


def _feeders(targets, policy, k, job, **kw):
    from feeder_client.elastic import ElasticFeeder

    return [ElasticFeeder(targets, job=job, seq_len=L, micro_batch=2, accumulation=2, replicas=3,
                          global_batch=policy, connect_timeout_s=10, retry_for_s=20, **kw) for _ in range(k)]


def _n_samples(stream_len: int) -> int:
    return (stream_len - 1) // L


@pytest.mark.parametrize("policy", ["constant", "shrink"])
def test_elastic_feeder_over_grpc(two_feeders, stream, policy):
    """Worlds change, attempts fail and are dealt again, a fourth replica joins with nothing
    (shrink: from the feeders' commit log), the tokens are the samples' tokens; every epoch's
    sample is trained in exactly one committed step."""
    a, b = two_feeders
    targets = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
    feeders = _feeders(targets, policy, 4, f"grpc-{policy}", num_epochs=1)
    n = _n_samples(len(stream))
    plan = [(3, True), (3, False), (2, True), (2, True), (3, False), (3, True), (4, True), (1, True), (4, False),
            (2, True)]
    trained = Counter()
    step = 0
    for i, (world, commit) in enumerate(plan * 20):
        if world == 4 and i == 6:   # a new process: no state from anyone
            feeders[3].close()
            feeders[3] = _feeders(targets, policy, 1, f"grpc-{policy}", num_epochs=1)[0]
        parts = [feeders[r].step(step, r, world) for r in range(world)]
        if all(f.finished for f in feeders[:world]):
            break
        ids = [i for p in parts for bt in p for i in bt.sample_ids.tolist()]
        for p in parts:
            for bt in p:
                for row, sid in zip(bt.tokens.numpy(), bt.sample_ids.tolist()):
                    assert row.tolist() == stream[sid * L:sid * L + L + 1].tolist()
                assert bt.step == step and bt.parts == len(p) and bt.step_samples == len(ids)
        if policy == "constant":
            assert len(ids) == 12 or step == (-(-n // 3) - 1) // 4
        else:
            assert len(ids) <= 4 * world
        for r in range(world):
            feeders[r].commit(step, commit)
        if commit:
            trained.update(ids)
            step += 1
    assert set(trained) == set(range(n))
    assert sum(trained.values()) - n < 4   # only DistributedSampler's padding repeats
    for f in feeders:
        f.close()   # (after the commit reports went out)
    # `feeder status` says where the job stands: its last committed step and world, the aborts
    from feeder.ops.status import fetch

    said = [j.elastic for t in targets for j in fetch(t).jobs if j.job == f"grpc-{policy}"]
    assert any(f"step {step - 1} committed in a world of" in e for e in said), said
    assert any("steps had an attempt that did not commit" in e and not e.startswith("no") for e in said), said
    # `feeder audit` proves the same from the feeders' ledgers: every committed step's parts sent,
    # every sample in exactly one committed step; and notices a part that never was.
    from feeder.ops.audit import audit

    ledgers = [str(Path(a.cfg.cache) / f"ledger-{k}.jsonl") for k in "ab"]
    verdicts = audit(ledgers, job=f"grpc-{policy}")
    assert len(verdicts) == 1 and verdicts[0]["exactly_once"], verdicts
    assert verdicts[0]["committed_steps"] == step
    lines = [ln for p in ledgers for ln in Path(p).read_text().splitlines()]
    import json

    def sent_part(ln: str) -> bool:   # every copy of step 3's first part to replica 0, in whichever world
        rec = json.loads(ln)
        return "elastic" in rec and "open" not in rec and (rec["step"], rec["rank"], rec["part"]) == (3, 0, 0)

    damaged = Path(a.cfg.cache) / f"damaged-{policy}.jsonl"
    damaged.write_text("\n".join(ln for ln in lines if not sent_part(ln)) + "\n")
    bad = audit([str(damaged)], job=f"grpc-{policy}")
    assert not bad[0]["exactly_once"] and bad[0]["incomplete_steps"][0]["step"] == 3, bad


def test_failover_inside_a_step(two_feeders, stream, dataset):
    """The first feeder stops while replicas read a step: they finish it on the second, exact."""
    cfg = dict(source=str(dataset), listen="127.0.0.1:0", message_bytes=4096, cache_dir=str(two_feeders[0].cfg.cache),
               cursor_secret=b"s" * 32)
    first = ServerThread(ServeConfig(**cfg))
    targets = [f"127.0.0.1:{first.port}", f"127.0.0.1:{two_feeders[1].port}"]
    feeders = _feeders(targets, "constant", 3, "failover", prefer="order", read_ahead=1)
    want = {r: feeders[r].step(0, r, 3) for r in range(3)}
    first.stop()
    got = [feeders[r].step(s, r, 3) for s in (1, 2) for r in range(3)]
    ref = _feeders([targets[1]], "constant", 3, "failover-ref")
    assert [[b.sample_ids.tolist() for b in p] for p in got] == \
        [[b.sample_ids.tolist() for b in ref[r].step(s, r, 3)] for s in (1, 2) for r in range(3)]
    assert sum(f._client.failovers for f in feeders) >= 1   # (the others had read those steps ahead)
    for f in feeders + ref:
        f.close()
    assert want


def test_bad_requests_are_refused_clearly(two_feeders):
    from feeder_client.elastic import ElasticFeeder

    t = [f"127.0.0.1:{two_feeders[0].port}"]
    with pytest.raises(FeederError, match="global_batch must be constant or shrink"):
        ElasticFeeder(t, job="x", seq_len=32, micro_batch=2, replicas=2, global_batch="grow")
    with pytest.raises(FeederError, match="unexpected arguments.*world_size"):
        ElasticFeeder(t, job="x", seq_len=32, micro_batch=2, replicas=2, world_size=2)
    f = ElasticFeeder(t, job="x", seq_len=32, micro_batch=2, replicas=2, connect_timeout_s=5, retry_for_s=5)
    with pytest.raises(FeederError, match=r"replica must be in \[0, replicas\)") as e:
        f.step(0, 2, 2)
    assert e.value.code == Code.INVALID_ARGUMENT
    f.close()
    with pytest.raises(FeederError, match="num_workers=1"):
        StreamSpec(job="j", rank=0, world_size=2, seq_len=8, micro_batch=1, global_batch="constant", num_workers=2)
    with pytest.raises(FeederError, match="reshard does not apply"):
        StreamSpec(job="j", rank=0, world_size=2, seq_len=8, micro_batch=1, global_batch="shrink", reshard=True)


def test_shrink_step_without_any_commit_is_refused(two_feeders, monkeypatch):
    """A shrink job's replica asking step 5 with no cursor, and no commit recorded: one clear
    FAILED_PRECONDITION after the bounded wait, not a silent stall."""
    from feeder.domain import engine

    monkeypatch.setattr(engine, "ELASTIC_COMMIT_WAIT_S", 1.0)
    f = _feeders([f"127.0.0.1:{two_feeders[0].port}"], "shrink", 1, "never-committed")[0]
    with pytest.raises(FeederError, match="no replica reported step 4's commit") as e:
        f.step(5, 0, 2)
    assert e.value.code == Code.FAILED_PRECONDITION
    f.close()


def test_other_sampling_fields_refused_within_one_job(two_feeders):
    """Replicas of one elastic job share policy and accumulation (the world may differ)."""
    t = [f"127.0.0.1:{two_feeders[0].port}"]
    a = _feeders(t, "constant", 1, "agree", num_epochs=0)[0]   # (unbounded: its stream stays open, the job live)
    a.step(0, 0, 3)
    from feeder_client.elastic import ElasticFeeder

    b = ElasticFeeder(t, job="agree", seq_len=L, micro_batch=2, accumulation=3, replicas=3, connect_timeout_s=5,
                      retry_for_s=5, num_epochs=0)
    with pytest.raises(FeederError, match="accumulation") as e:
        b.step(0, 1, 2)
    assert e.value.code == Code.FAILED_PRECONDITION
    c = _feeders(t, "constant", 1, "agree", num_epochs=0)[0]
    assert len(c.step(0, 1, 2)) == 3   # another world, same job: served
    for f in (a, b, c):
        f.close()


def test_spec_round_trips_the_elastic_fields():
    from feeder.service.convert import stream_request

    s = StreamSpec(job="j", rank=1, world_size=3, seq_len=8, micro_batch=2, global_batch="shrink", accumulation=4,
                   first_step=17)
    r = stream_request(s)
    assert (r.global_batch, r.accumulation, r.first_step, r.start_replicas) == ("shrink", 4, 17, 0)
    c = dataclasses.replace(s, global_batch="constant", start_replicas=0)
    assert c.start_replicas == 3


def test_members_and_context_parallel_slices_of_a_replica(two_feeders, stream):
    """Members of a replica get its part bit for bit; a context-parallel member its positions."""
    t = [f"127.0.0.1:{two_feeders[0].port}"]
    from feeder_client.elastic import ElasticFeeder

    def member(m, **kw):
        return ElasticFeeder(t, job="elastic-members", seq_len=L, micro_batch=2, accumulation=2, replicas=3,
                             members=2, member=m, connect_timeout_s=10, retry_for_s=20, **kw)

    a, b = member(0), member(1)
    for step, (r, w) in enumerate([(0, 3), (1, 3), (1, 2), (0, 1)]):
        pa, pb = a.step(step, r, w), b.step(step, r, w)
        assert [x.sample_ids.tolist() for x in pa] == [x.sample_ids.tolist() for x in pb]
        assert all((x.tokens == y.tokens).all() for x, y in zip(pa, pb)) and pa
    for f in (a, b):
        f.close()
    c = ElasticFeeder(t, job="elastic-cp", seq_len=L, micro_batch=2, accumulation=2, replicas=3, cp_size=2,
                      cp_rank=1, cp_layout="contiguous", connect_timeout_s=10, retry_for_s=20)
    for x in c.step(0, 2, 3):
        for row, sid in zip(x.tokens.numpy(), x.sample_ids.tolist()):
            assert row.tolist() == stream[sid * L + L // 2:sid * L + L + 1].tolist()
    c.close()


def test_an_empty_part_asked_again_is_still_empty(two_feeders):
    """Soak seed 970373: a replica with nothing in a step (more replicas than the step's
    micro-batches) asked the step again in the same world, and got the empty part's marker batch
    (0 samples) from memory."""
    from feeder_client.elastic import ElasticFeeder

    f = ElasticFeeder([f"127.0.0.1:{two_feeders[0].port}"], job="empty-again", seq_len=L, micro_batch=2,
                      replicas=2, connect_timeout_s=10, retry_for_s=20)
    assert f.step(0, 2, 3) == [] and f.step(0, 2, 3) == []
    f.commit(0, False)
    assert f.step(0, 2, 3) == []
    f.close()


# From the outside review of issue 43 (scripts in its report): each failed before its fix.


def test_a_mixture_is_dealt_in_steps(dataset, tmp_path_factory, stream):
    """F3: a mixture's runs were rebuilt without their step fields: every elastic stream of a
    mixture failed at its first step."""
    from feeder_client.elastic import ElasticFeeder

    cache = tmp_path_factory.mktemp("elastic-mix")
    with ServerThread(ServeConfig(sources=(("a", str(dataset)), ("b", str(dataset))), listen="127.0.0.1:0",
                                  message_bytes=4096, cache_dir=str(cache))) as srv:
        fs = [ElasticFeeder([srv.address], job="mix", seq_len=L, micro_batch=2, replicas=2,
                            mixture=(("a", 0.5), ("b", 0.5)), connect_timeout_s=10, retry_for_s=20) for _ in range(3)]
        seen = []
        for step, world in enumerate([2, 3, 1, 2]):
            parts = [fs[r].step(step, r, world) for r in range(world)]
            got = [(int(s), int(i)) for p in parts for b in p for s, i in zip(b.sources, b.sample_ids)]
            assert len(got) == 4 and {b.step_samples for p in parts for b in p} == {4}
            for p in parts:
                for b in p:
                    for row, sid in zip(b.tokens.numpy(), b.sample_ids.tolist()):
                        assert row.tolist() == stream[sid * L:sid * L + L + 1].tolist()
            seen += got
        assert len(set(seen)) == len(seen)   # (positions of one epoch: no (source, sample) twice)
        for f in fs:
            f.close()


def test_a_healing_replica_and_the_end_of_the_data_commit_without_error(two_feeders):
    """F1, F2: under shrink, commit() of a step this replica was not dealt (a healing torchft
    group; the pass that finds the data finished) raised and killed the training loop."""
    from feeder_client.elastic import ElasticFeeder, TorchftFeeder

    class Healing:
        def participating_rank(self):
            return None

        def current_step(self):
            return 0

        def num_participants(self):
            return 2

    f = ElasticFeeder([f"127.0.0.1:{two_feeders[0].port}"], job="heal-shrink", seq_len=L, micro_batch=2,
                      replicas=2, global_batch="shrink", connect_timeout_s=10, retry_for_s=20)
    data = TorchftFeeder(f, Healing())
    assert data.batches() == []
    data.commit(True)   # (no error: not dealt, nothing recorded)
    step = 0
    while True:   # (the docs' loop: the last pass gets [] and `finished`, and commits all the same)
        got = f.step(step, 0, 1)
        f.commit(step, True)
        if f.finished:
            break
        assert got
        step += 1
    f.close()


def test_a_shrink_cursor_of_another_step_is_not_dealt_from(two_feeders):
    """F5: a replica restarted with the cursor after step 0 asked step 5: its stream began at
    step 1 and the client dropped steps 1-4 silently, dealing step 5 from another chain. Now the
    client notices, warns, and starts from the feeders' commit log: the chain's own step 5."""
    from feeder_client.elastic import ElasticFeeder

    t = [f"127.0.0.1:{two_feeders[0].port}"]
    mk = lambda **kw: ElasticFeeder(t, job="stale-cursor", seq_len=L, micro_batch=2, replicas=2,  # noqa: E731
                                    global_batch="shrink", connect_timeout_s=10, retry_for_s=20, **kw)
    fs = [mk(), mk(), mk()]
    after0 = None
    for step, world in enumerate([2, 3, 3, 2, 2]):
        for r in range(world):
            fs[r].step(step, r, world)
        for r in range(world):
            fs[r].commit(step, True)
        if step == 0:
            after0 = fs[0].committed_cursor
    for f in fs:
        f.close()   # (their reports are in)
    want = mk().step(5, 1, 2)
    stale = mk(cursor=after0)
    got = stale.step(5, 1, 2)
    assert [b.sample_ids.tolist() for b in got] == [b.sample_ids.tolist() for b in want] and got
    stale.close()


def test_the_commit_log_takes_a_steps_newest_commit_whatever_came_after(tmp_path):
    """Soak seed 990455: a replica's report of step 33 came after the others' of step 34; a new
    replica asking step 35 must be dealt from step 34's commit, not wait for a report that never
    comes (a rule that took a later commit of an earlier step for a job gone back to a
    checkpoint left it waiting 60 s)."""
    from feeder.domain.commits import CommitLog

    log = CommitLog(str(tmp_path))
    for step, replica in ((33, 1), (33, 2), (34, 1), (34, 0), (33, 0)):
        log.record("j", step=step, committed=True, replicas=3, replica=replica, cursor=bytes([step, replica]))
    log.record("j", step=35, committed=False, replicas=3, replica=0, cursor=bytes([35, 0]))   # (not committed)
    assert log.cursor_after("j", 34) == bytes([34, 0])
    assert log.cursor_after("j", 33) == bytes([33, 0])
    assert log.cursor_after("j", 35) is None


def test_an_elastic_and_a_fixed_world_stream_of_one_job_are_refused_in_words(two_feeders):
    """F8: the refusal said "running with world_size=0"."""
    from feeder_client import FeederDataset

    t = [f"127.0.0.1:{two_feeders[0].port}"]
    a = _feeders(t, "constant", 1, "fixed-vs-elastic", num_epochs=0)[0]
    a.step(0, 0, 3)
    with pytest.raises(FeederError, match="running with live elasticity.*asks for a fixed world") as e:
        next(iter(FeederDataset(t, job="fixed-vs-elastic", rank=0, world_size=3, seq_len=L, micro_batch=2,
                                connect_timeout_s=10, retry_for_s=5)))
    assert e.value.code == Code.FAILED_PRECONDITION
    a.close()
