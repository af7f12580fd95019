"""The fault-combination harness (tests/chaos/) on a fixed set of seeds.

COVERAGE together covers every fault kind (feeder SIGKILL/SIGTERM/SIGSTOP, reset and blackhole
through a proxy, a corrupt replica, a superseding stream, a trainer restart from a checkpoint,
a world-size change, a new DataLoader pass, a rank disagreeing with its job, the cache directory
damaged under the feeders, a feeder slowed to a trickle or stuck while gRPC answers, with ranks
that hedge their reads) and every worker
mode (0-3 workers, persistent or not, spawn and forkserver), with `serve --processes 2`, ranks
spread over feeders, finite and unbounded streams, one dataset and mixtures of several, torch's
order and the stateless one, concat windows and best-fit bins (checked against bins packed by
tests/helpers.py packed_bins, from the rule alone), sources on files and on bounded Kafka topics
(mixed with files). Each scenario is a few seconds. Two more (LARGE) are mixtures of 10^9 and
2^32 + 5 positions per epoch, the oracle computing each position on its own.

The regression tests replay seeds that found a bug on the code before the fixes of audit
findings 1-4 (1be1a8d); `python -m tests.chaos --seed N` replays one by hand and keeps the work
directory (rank outputs, rank and feeder logs, ledgers) when it fails.
"""
from __future__ import annotations

import pytest

from tests.chaos import FAULT_KINDS, Scenario, run_scenario

pytestmark = pytest.mark.fault

COVERAGE = [2544, 241, 411, 2360, 671, 248, 569, 47, 467, 3211]


def _run(seed: int, request=None):
    sc = Scenario.from_seed(seed)
    if sc.kafka:   # its sources on topics need the broker
        request.getfixturevalue("kafka_broker")
    res = run_scenario(sc)
    assert res.ok, (f"seed {seed} failed (replay: python -m tests.chaos --seed {seed}; work dir {res.workdir}): "
                    f"{res.scenario.describe()}\n" + "\n".join(res.errors[:5]))
    assert res.samples > 0
    return res


def test_coverage_seeds_cover_every_fault_kind_and_worker_mode():
    scs = [Scenario.from_seed(s) for s in COVERAGE]
    kinds = {f.kind for sc in scs for f in sc.faults}
    assert kinds == set(FAULT_KINDS), f"not covered: {set(FAULT_KINDS) - kinds}"
    modes = {(sc.workers > 0, sc.persistent, sc.context) for sc in scs}
    assert {(False, False, "")} <= modes
    assert {m[2] for m in modes if m[0]} == {"spawn", "forkserver"}
    assert {m[1] for m in modes if m[0]} == {True, False}
    assert {sc.workers for sc in scs} >= {0, 1, 2, 3}
    assert any(sc.processes > 1 for sc in scs) and any(sc.num_epochs == 0 for sc in scs)
    assert any(sc.mixture for sc in scs) and any(not sc.mixture for sc in scs)   # mixtures too (issue 18)
    assert {sc.permutation for sc in scs} == {"torch", "stateless"}              # both orders (issue 25)
    kafka = [Scenario.from_seed(s) for s in (1043, 861)]      # and two more, with the broker (issue 26)
    assert any(sc.kafka and sc.mixture and len(sc.kafka) < len(sc.mixture) for sc in kafka)
    assert {sc.packing for sc in scs} == {"concat", "best_fit"}                  # both sample layouts (issue 27)
    # model-parallel ranks: members, and context-parallel slices beside them (issue 33)
    assert any(sc.members > 1 and sc.cp_size > 1 for sc in scs) and any(sc.members == 1 for sc in scs)


def test_model_parallel_scenarios_are_a_share_with_both_layouts():
    from tests.chaos.scenario import CP_SHARE, MEMBERS_SHARE

    scs = [Scenario.from_seed(s) for s in range(3000)]
    possible = [sc for sc in scs if sc.n_docs != 40000 and sc.world * (sc.workers + 1) <= 6]
    mp = [sc for sc in scs if sc.members > 1]
    assert abs(len(mp) / len(possible) - MEMBERS_SHARE) < 0.04
    cp = [sc for sc in mp if sc.cp_size > 1]
    assert abs(len(cp) / len(mp) - CP_SHARE) < 0.1
    assert {sc.cp_layout for sc in cp} == {"zigzag", "contiguous"} and {sc.cp_size for sc in cp} == {2, 4}
    assert {sc.members for sc in mp} == {2, 3} and any(sc.workers for sc in mp) and any(sc.mixture for sc in mp)


def test_kafka_scenarios_are_mixtures_for_a_share_of_them():
    """The generator puts a share of its scenarios on Kafka topics, and a share of those are
    mixtures: of topics alone, and of topics and files."""
    from tests.chaos.scenario import KAFKA_SHARE, MIXTURE_SHARE

    scs = [Scenario.from_seed(s) for s in range(3000)]
    kafka = [sc for sc in scs if sc.kafka]
    # (large scenarios stay on files, and so does a lone corpus a corrupt fault hits)
    possible = [sc for sc in scs if sc.n_docs != 40000]
    assert abs(len(kafka) / len(possible) - KAFKA_SHARE) < 0.04
    mixed = [sc for sc in kafka if sc.mixture]
    assert abs(len(mixed) / len(kafka) - MIXTURE_SHARE) < 0.08
    assert any(len(sc.kafka) == len(sc.mixture) for sc in mixed)      # every source on a topic
    assert any(len(sc.kafka) < len(sc.mixture) for sc in mixed)       # topics and files
    assert not any(0 in sc.kafka and any(f.kind == "corrupt" for f in sc.faults) for sc in kafka)


def test_regression_seeds_are_pinned_to_the_scenarios_that_failed():
    from tests.chaos.scenario import PINNED

    assert {666, 127, 17809, 543, 258, 200307, 500064, 600466} <= set(PINNED)
    assert Scenario.from_seed(17809).describe().endswith("faults=[blackhole(f0@b97+500ms)]")
    assert not set(COVERAGE) & set(PINNED)


def test_a_seed_alone_replays_the_same_scenario():
    for seed in (0, 1234, 99999):
        assert Scenario.from_seed(seed) == Scenario.from_seed(seed)
        assert Scenario.from_seed(seed).describe() == Scenario.from_seed(seed).describe()
    assert len({Scenario.from_seed(s).describe() for s in range(50)}) == 50


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.kafka) if Scenario.from_seed(s).kafka else s
                                  for s in COVERAGE])
def test_chaos_seed(seed, request):
    _run(seed, request)


@pytest.mark.kafka
def test_chaos_kafka_mixture_with_a_sigterm_a_corrupt_replica_and_a_trainer_restart(request):
    """A mixture of a file source and a bounded topic on 3 feeders of one region: one feeder
    SIGTERMed and restarted, a corrupt replica, the trainer restarted from its checkpoint, the
    region's cache damaged under its feeders, which are restarted on it (issue 34)."""
    sc = Scenario.from_seed(1043)
    assert sc.kafka == (1,) and len(sc.mixture) == 2
    _run(1043, request)


@pytest.mark.kafka
def test_chaos_cache_damage_of_a_snapshot_and_a_packing_met_by_restarted_feeders(request):
    """Issue 34's fault: a byte flipped in the Kafka epoch's snapshot and in the packing of the
    region's cache, every feeder SIGKILLed and started again on it. The restarted feeders find
    both damaged, rebuild them (the snapshot from the topic) and the ranks get exactly their
    bins, after a trainer restart too."""
    sc = Scenario.from_seed(343)
    assert sc.kafka == (0,) and sc.packing == "best_fit" and "cache-damage" in {f.kind for f in sc.faults}
    res = _run(343, request)
    assert res.faults["cache_entries_damaged"] == 2


@pytest.mark.kafka
def test_regression_seed_861_a_packed_mixture_of_topics_resumes_from_its_cursor(request):
    """Found when issues 26 and 27 met: a best-fit mixture of two bounded topics and a file
    named each source in its cursor by its packing's fingerprint, and a DataLoader's new pass
    from that cursor was refused ("'bf-…' is not a Kafka epoch"): a topic's epoch is rebuilt from
    its ranges. The packing is now in the mixture's fingerprint; each source keeps its key."""
    sc = Scenario.from_seed(861)
    assert sc.kafka == (0, 1) and sc.packing == "best_fit" and len(sc.mixture) == 3
    _run(861, request)


def test_large_seeds_are_mixtures_past_10_9_positions_with_faults():
    from tests.chaos.scenario import LARGE

    scs = list(LARGE.values())
    assert all(sc.mixture and sc.epoch_samples >= 10**9 and sc.faults for sc in scs)
    assert max(sc.epoch_samples for sc in scs) > 1 << 32


@pytest.mark.parametrize("seed", [25000001, 25000002])
def test_chaos_seed_of_a_mixture_past_10_9_positions(seed):
    """Issue 25: the harness's fixed seeds include mixtures of 10^9 and 2^32 + 5 positions
    (tests/chaos/scenario.py LARGE), checked position by position."""
    assert Scenario.from_seed(seed).epoch_samples >= 10**9
    _run(seed)


# Seeds that failed on 1be1a8d (before the fixes of audit findings 1-4), named by what broke;
# pinned (tests/chaos/scenario.py PINNED) to the scenarios that failed.
def test_regression_seed_666_sigterm_with_a_fully_queued_finite_stream():
    """SIGTERM while the rest of a finite stream waited in the feeder's queue: the stream ended
    with OK after 1791 of 2223 batches (shutdown dropped the queue of a finished producer)."""
    _run(666)


def test_regression_seed_127_data_loss_on_one_replica():
    """A corrupt replica first in the rank's targets: the rank got DATA_LOSS instead of moving
    to the other target's good replica."""
    _run(127)


def test_regression_seed_17809_dataloader_workers_reconnect():
    """3 spawn workers, a blackholed link: after the reconnect a worker's stream resumed at the
    wrong round-robin phase (position 133: step 61 instead of 63)."""
    _run(17809)


def test_regression_seed_543_new_pass_over_persistent_workers():
    """A new pass over a DataLoader with 3 persistent workers after load_state_dict: it went on
    from where the workers had streamed to (step 37), not from the dataset's cursor (step 31).
    Still failing after the fixes (4b032d5): the pass restarts at the constructor's cursor
    (epoch 2 step 0), as persistent workers keep the dataset copy they were made with."""
    _run(543)


def test_regression_seed_258_rank_disagreeing_on_micro_batch():
    """A rank asking for micro_batch 9 while its job ran with 8 on that feeder was served (and
    replaced the job's own stream of that rank) instead of being refused."""
    _run(258)


def test_regression_seed_200307_a_replaced_process_reconnecting_after_a_sigterm():
    """Found by the 500-scenario soak on the final code of the audit fixes: the feeder was
    SIGTERMed while rank 0's process was reading, and a restarted process superseded it. The
    replaced process reconnected before it learned it was replaced; its stream was then the
    newest of the rank and displaced the live process, which stopped with FAILED_PRECONDITION.
    Streams are now fenced by the trainer process's start time (client_started_ns)."""
    _run(200307)


def test_regression_seed_500064_a_replacement_whose_first_request_never_arrived_is_not_fenced():
    """Found by the soak of the fence's second version: a client counted its stream as
    continued from its first request on, so a replacement whose first request never reached
    the feeder (a blackholed link) retried as a reconnect and was fenced off its own rank.
    A client's streams now count as continued once one of them delivered a reply."""
    _run(500064)


def test_regression_seed_600466_a_resharded_rank_starting_a_new_pass_ahead_of_the_others():
    """Found by the soak of the fence's third version (and failing on the code before it):
    world 8 -> 4, then rank 3 began a new pass from its own cursor with reshard still set,
    6 steps ahead of the other ranks. The feeder re-dealt from there, and `feeder audit` found
    two different batches served for (epoch 0, world 4, rank 3, step 57). A cursor of the
    dealing over the same world size now goes on in that dealing instead of re-dealing it."""
    _run(600466)


def test_regression_soak_seed_4510053_a_hedged_read_does_not_replace_the_ranks_own_stream(request):
    """Slow, not dead (issue 45): a feeder stuck, then slowed; the rank hedging over three
    feeders of a Kafka mixture. Its hedge landed on the feeder it had just failed over to, and
    replaced its own stream there (FAILED_PRECONDITION) while side streams took a slot."""
    _run(4510053, request)


def test_regression_soak_seed_330157_a_superseded_ranks_member_errors_are_written_to_its_log():
    """Soak seed 330157 (and 330081): a rank's members, replaced along with it (FAILED_PRECONDITION),
    left errors keyed by (kind, index), which its JSON log could not hold: the rank crashed in
    the harness, not the feeder. The verdict is plain JSON whatever the members met."""
    import json

    from tests.chaos.rank import Shadows

    sh = Shadows.__new__(Shadows)
    sh.cfg, sh.got = {"seq_len": 8}, {("m", 1): [(0, 0, [1, 2], "h"), (0, 1, [3, 4], "h2")]}
    sh.errors = {("m", 1): "FAILED_PRECONDITION: replaced", ("cp", 0): "UNAVAILABLE: gone"}
    verdict = sh.verdict({(0, 0): ([1, 2], "h"), (0, 1): ([3, 4], "h2")})
    assert json.loads(json.dumps(verdict)) == {"members": "ok", "compared": 2, "bad": [],
                                               "errors": {"m1": "FAILED_PRECONDITION: replaced",
                                                          "cp0": "UNAVAILABLE: gone"}}


# Live elasticity (issue 43): seeds of tests/chaos/elastic.py that together inject every kind
# (replica churn inside a step, joins, leaves, aborted steps, feeder SIGKILL, SIGTERM, SIGSTOP),
# both policies, one and two feeders; `python -m tests.chaos --elastic --seeds N` runs many.
ELASTIC_COVERAGE = [114, 122, 123, 124, 144, 147]


def test_elastic_coverage_seeds_cover_every_kind_and_policy():
    from tests.chaos.elastic import ELASTIC_KINDS, ElasticScenario

    scs = [ElasticScenario.from_seed(s) for s in ELASTIC_COVERAGE]
    assert {h.kind for sc in scs for h in sc.hits} == set(ELASTIC_KINDS)
    assert {sc.policy for sc in scs} == {"constant", "shrink"} and {sc.targets for sc in scs} == {1, 2}


@pytest.mark.parametrize("seed", ELASTIC_COVERAGE)
def test_elastic_scenario(seed):
    from tests.chaos.elastic import ElasticScenario, run_elastic

    res = run_elastic(ElasticScenario.from_seed(seed))
    assert res.ok, (f"seed {seed} failed (replay: python -m tests.chaos --elastic --seed {seed}; work dir "
                    f"{res.workdir}): {res.scenario.describe()}\n" + "\n".join(res.errors[:5]))
    assert res.samples > 0 and res.faults["churn"] >= 1


# Bugs the elastic soak found (seeds 970000-970499 at e08aee6's harness), kept as regressions:
#   970373: a step asked again in the same world, by a replica with an empty part, was answered
#           from memory with the empty part's marker batch (a batch of 0 samples to train on);
#   970237: `feeder audit` allowed a constant job's padding for the world its first stream saw
#           (2, after a replica left at once), not the 3 its global batch is dealt for;
#   980068: (the harness) its replicas shared one process start time, so a dead replica's late
#           reconnect was taken for its successor's own and displaced it; each is a process now;
#   990455: a replica's late report of step 33 came after the others' of step 34, and the commit
#           log's rule for a job gone back to a checkpoint left a new replica waiting for good.
@pytest.mark.parametrize("seed", [970373, 970237, 980068, 990455])
def test_elastic_soak_regression(seed):
    test_elastic_scenario(seed)


def test_regression_soak_seed_4720381_a_harness_feeder_binds_its_own_port_and_keeps_it_across_a_restart(
        tmp_path, dataset, monkeypatch):
    """The harness picked a port free when asked and handed it to the feeder; under `--jobs N`
    another scenario's process bound it first, and the feeder could not start. Its first start
    now binds any free port and says which; a restart binds that one again, where the ranks
    know it."""
    import socket

    from tests.chaos import runner

    # (the race, made certain: whatever port the harness might pick beforehand, another process holds)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(runner, "free_port", lambda: taken.getsockname()[1], raising=False)
    fd = runner.Feeder(dataset, [], tmp_path / "ledger.jsonl", tmp_path / "feeder.log", 1)
    try:
        fd.wait_ready()
        host, port = fd.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0, fd.address
        socket.create_connection((host, int(port)), timeout=5).close()
        first = fd.address
        fd.proc.kill()
        fd.proc.wait(10)
        fd.start()
        assert fd.address == first
        socket.create_connection((host, int(port)), timeout=5).close()
        fd.log.flush()
        assert (tmp_path / "feeder.log").read_text().count(f"listening on {first}") == 2
    finally:
        fd.close()
        taken.close()
