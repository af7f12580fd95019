"""Live elasticity under real torchft (issue 43): a Lighthouse with min_replicas=2, three replica
groups of one process (trainer/examples/torchft_train.py: torchft's Manager, DDP and
OptimizerWrapper over ProcessGroupGloo on CPU) fed by ElasticFeeder (TorchftFeeder's questions:
manager.current_step(), participating_rank(), num_participants()) from two `feeder serve`
processes sharing a cache directory and cursor secret. During the run a random group is
SIGKILLed at least four times at a chosen moment of its loop (mid-forward, in the backward's
allreduce, at the commit, between steps), each restarted and healed by torchft; the first
feeder is SIGKILLed once (the groups fail over to the second); a fourth group joins mid-run
(a new group, not a restart). The harness is bench/torchft_baseline.py's (Cluster), which
also measures torchft's own sampler under the same kills.

Judged from each group's log (what it was dealt before its forward pass, and whether the step
committed), against tests/elastic_oracle.py (DistributedSampler alone): the committed steps are
0..N-1, each trained by exactly the replicas 0..W-1 of its committing quorum, and holds exactly
its samples, none twice, none in two steps: under `constant` the G = micro_batch x accumulation
x 3 samples of DistributedSampler(num_replicas=3)'s step S, whatever W was; under `shrink` each
step begins where the last committed one ended, in the world that committed it.
"""
from __future__ import annotations

import json
import os
import signal
from collections import Counter

import pytest

# torchft's Rust side logs every quorum request at INFO on stderr; its logger reads RUST_LOG once,
# when torchft is first imported (so here, before the import below)
os.environ.setdefault("RUST_LOG", "warn")
import torchft  # noqa: F401,E402  (installed by make env: the torchft extra)

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

SEQ, MB, ACC, W0 = 16, 2, 2, 3
STEPS = 150
N_DOCS = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.helpers import byte_stream, make_docs, prep_docs

    docs = make_docs(N_DOCS, seed=43, max_words=40)
    root = tmp_path_factory.mktemp("torchft-corpus")
    return prep_docs(root, docs, shard_tokens=3000, chunk_tokens=600), byte_stream(docs)


def judge(records, *, n: int, policy: str, seed: int) -> tuple[dict, list[str]]:
    """The committed steps against the oracle: (what was checked, the failures)."""
    from feeder_bench.torchft_baseline import committed_steps
    from tests.elastic_oracle import Oracle

    steps, bad = committed_steps(records)
    if not steps:
        bad.append("no committed step")
    if sorted(steps) != list(range(len(steps))):
        bad.append(f"committed steps are not 0..N-1: {sorted(set(range(max(steps, default=0) + 1)) - set(steps))} "
                   "missing")
    oracle = Oracle(n=n, w0=W0, mb=MB, acc=ACC, drop_last=False, seed=seed, permutation="torch", shuffle=True,
                    policy=policy)
    seen: Counter = Counter()
    worlds = Counter()
    for s in sorted(steps):
        v = steps[s]
        got = Counter(i for p in v["parts"] for i in p[2])
        worlds[v["replicas"]] += 1
        if policy == "constant":
            _, want = oracle.constant(s)
        else:
            _, want, after = oracle.shrink(v["replicas"])
            oracle.commit(after)
        if got != want:
            bad.append(f"step {s} (W={v['replicas']}, quorum {v['quorum']}): {sum((want - got).values())} missing, "
                       f"{sum((got - want).values())} extra")
        if max(got.values(), default=1) > 1:
            bad.append(f"step {s}: a sample twice in one step")
        told = {p[3]["step_samples"] for p in v["parts"] if p[2]}
        if told != {sum(want.values())}:
            bad.append(f"step {s}: step_samples {sorted(told)}, the step has {sum(want.values())}")
        seen.update(got)
    again = [i for i, c in seen.items() if c > 1]
    if again:
        bad.append(f"{len(again)} samples in two committed steps")
    return {"steps": len(steps), "samples": sum(seen.values()), "worlds": dict(worlds)}, bad


def _last_errors(run_dir, died: list[dict]) -> str:
    """The last line of each crashed group's output (a CI log shows no more than the assertion)."""
    lines = []
    for e in died:
        for out in sorted(run_dir.glob(f"process*.{e['died']}.out")):
            text = [ln for ln in out.read_text(errors="replace").splitlines() if ln.strip()]
            if text:
                lines.append(f"{out.name}: {text[-1][:500]}")
    return "".join(f"\n  {ln}" for ln in lines)


@pytest.mark.parametrize("policy", ["constant", "shrink"])
def test_torchft_groups_killed_restarted_and_joined_with_a_feeder_failover(tmp_path, corpus, policy):
    from feeder.core.sampler import n_samples
    from feeder_bench.torchft_baseline import Cluster
    from tests.helpers import FeederProc

    dataset, stream = corpus
    n = n_samples(len(stream), SEQ)
    assert n >= STEPS * MB * ACC * 4, "the corpus must outlast the run (shrink with 4 groups deals 16 a step)"
    cache = tmp_path / "cache"
    cache.mkdir()
    secret = tmp_path / "secret"
    secret.write_bytes(b"torchft-elastic-" * 2)
    shared = ["--cache-dir", str(cache), "--cursor-secret-file", str(secret)]
    feeders = [FeederProc(dataset, extra=[*shared, "--ledger", str(tmp_path / f"ledger-{k}.jsonl")]) for k in range(2)]
    seed = {"constant": 3, "shrink": 4}[policy]
    try:
        c = Cluster(tmp_path / "run", ["--data", "feeder", "--targets", ",".join(f.address for f in feeders),
                                       "--job", f"torchft-{policy}", "--seq-len", str(SEQ), "--micro-batch", str(MB),
                                       "--accumulation", str(ACC), "--replicas", str(W0), "--global-batch", policy,
                                       "--seed", str(seed), "--steps", str(STEPS), "--delay-ms", "40"],
                    groups=W0, seed=seed)
        run = c.run(steps=STEPS, kills=4, join_at=STEPS // 5,
                    hooks={STEPS * 2 // 5: lambda: feeders[0].signal(signal.SIGKILL)}, limit_s=200)
    finally:
        for f in feeders:
            f.stop()
    where = f"logs in {tmp_path / 'run'}; events {run['events']}{_last_errors(tmp_path / 'run', run['died'])}"
    assert not run["timed_out"] and not run["died"], where
    assert len(run["kills"]) >= 4, where
    assert any("join" in e for e in run["events"]) and any("hook" in e for e in run["events"]), where
    checked, bad = judge(c.records, n=n, policy=policy, seed=seed)
    print(f"{policy}: {run['seconds']} s, {checked}, uncommitted attempts "
          f"{sum(1 for r in c.records if r['event'] == 'step' and not r['committed'])}, events {run['events']}")
    assert not bad, f"{bad[:10]} ({checked}); {where}"
    assert checked["steps"] == STEPS, (checked, where)
    # the world changed (kills, the join) and the steps still held their samples
    assert len(checked["worlds"]) >= 2, (checked, where)
    # a survivor never restarts: the groups never killed ran once, to the end
    killed = {e["kill"] for e in run["kills"]}
    for g in c.groups:
        if g.gid not in killed:
            assert g.incarnation == 1 and g.ended, (g.gid, where)
    # kills landed inside the step as well as between steps
    phases = {e["phase"] for e in run["kills"]}
    assert len(phases) >= 2 and phases & {"forward", "backward", "commit"}, (phases, where)
    # the first feeder died (SIGKILL) and the second served the rest: the groups failed over
    assert feeders[0].proc.returncode == -signal.SIGKILL, where
    served = [json.loads(ln) for ln in (tmp_path / "ledger-1.jsonl").read_text().splitlines()]
    assert max(r.get("step", -1) for r in served if r.get("elastic")) >= STEPS - 1, where
    # the feeders' ledgers agree (`feeder audit`): every committed step's parts sent, none twice,
    # every commit reported (the rest of the epoch is simply not reached)
    from feeder.ops.audit import audit

    [v] = audit([str(tmp_path / f"ledger-{k}.jsonl") for k in range(2)], job=f"torchft-{policy}")
    assert v["committed_steps"] == STEPS and not v["duplicates"] and not v["n_duplicate_deliveries"], v
    assert not v["incomplete_steps"] and not v["unreported_commits"] and not v["conflicts"], v
    # the new group took part (dealt by the feeder, with no loader state from anyone)
    joined = c.groups[W0]
    assert any(r["group"] == joined.gid and r["event"] == "step" and r["committed"] and r["replica"] is not None
               for r in c.records), where
