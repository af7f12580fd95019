"""Real DeepSpeed pipeline parallelism (issue 33): PipelineModule, 2 stages × 2 data-parallel
replicas (4 processes, gloo on CPU), fed only by the feeder. Both stages of a replica read its
stream as its two members; the ids are DistributedSampler(num_replicas=2)'s, the losses those
of the same run fed by a local DataLoader; a stage SIGKILLed, the job resumed from its
DeepSpeed checkpoint, continues exactly."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from feeder.core.config import ServeConfig
from feeder.core.sampler import n_samples
from feeder.service.server import ServerThread
from tests.helpers import free_port, launch, reference_ids

pytestmark = pytest.mark.slow
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
PIPE = str(Path(__file__).resolve().parent.parent / "trainer" / "pipeline.py")
SEQ, MB, ACCUM, STEPS = 64, 4, 2, 6


def run(tmp: Path, *extra, expect_rc=0, limit_s=300) -> str:
    cmd = [DEEPSPEED, "--num_gpus", "4", "--master_port", str(free_port()), PIPE, "--pipeline", "2",
           "--seq-len", str(SEQ), "--micro-batch", str(MB), "--grad-accum", str(ACCUM), "--steps", str(STEPS), *extra]
    return launch(cmd, tmp, "the pipeline run", limit_s=limit_s, expect_rc=expect_rc)


def losses(path: Path) -> dict[int, float]:
    """Each step's loss; a step taken twice (before the kill and after the resume) twice alike."""
    out: dict = {}
    for r in map(json.loads, path.read_text().splitlines()):
        assert out.setdefault(r["step"], r["loss"]) == pytest.approx(r["loss"], rel=1e-6), r
    return out


def micro_batches(d: Path) -> dict[tuple[int, int], list]:
    """(replica, member) -> the ids of every micro-batch it took, in order, over all runs."""
    out: dict = {}
    for f in sorted(d.glob("rank*.jsonl")):
        for r in map(json.loads, f.read_text().splitlines()):
            out.setdefault((r["dp"], r["member"]), []).append((r["step"], r["micro"], r["ids"]))
    return out


@pytest.mark.timeout(900)
def test_pipeline_stages_are_fed_exactly_and_resume_exactly_after_a_stage_is_killed(dataset, stream, tmp_path):
    srv = ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", message_bytes=8192))
    try:
        fed = tmp_path / "fed"
        fed.mkdir()
        common = ("--targets", srv.address, "--job", "pp", "--ckpt-dir", str(fed / "ck"), "--log-ids",
                  str(fed / "ids"), "--log-loss", str(fed / "loss.jsonl"))
        # Global rank 3 is a stage of a replica (which one the topology says; the ids log names
        # its replica and member): SIGKILLed after step 4, the checkpoint of step 3 is the last.
        out = run(fed, *common, "--save-every", "3", "--kill-at-step", "4", "--kill-rank", "3", expect_rc=1)
        assert "step    4" in out and "step    5" not in out
        out = run(fed, *common, "--resume")
        assert "resumed from" in out and "at step 3" in out and f"done: {STEPS} steps" in out
        local = tmp_path / "local"
        local.mkdir()
        run(local, "--local", str(dataset), "--log-ids", str(local / "ids"), "--log-loss", str(local / "loss.jsonl"))
    finally:
        srv.stop()

    n = n_samples(len(stream), SEQ)
    taken = micro_batches(fed / "ids")
    assert sorted(taken) == [(0, 0), (0, 1), (1, 0), (1, 1)]   # 2 replicas x (first stage, last stage)
    for replica in range(2):
        want = reference_ids(n, 2, replica, shuffle=True, seed=0, drop_last=False, epoch=0)
        per_step = {}
        for member in range(2):
            for step, micro, ids in taken[replica, member]:
                # the killed run's steps 4 were taken again after the resume from step 3: the same ids
                assert per_step.setdefault((member, step, micro), ids) == ids
        for member in range(2):
            got = [per_step[member, s, m] for s in range(STEPS) for m in range(ACCUM)]
            assert [i for ids in got for i in ids] == want[:STEPS * ACCUM * MB], (replica, member)
        assert all(per_step[0, s, m] == per_step[1, s, m] for s in range(STEPS) for m in range(ACCUM))
    local_taken = micro_batches(local / "ids")   # the reference read the same samples, in the same order
    for key, batches in local_taken.items():
        assert [ids for _, _, ids in batches] == [ids for _, _, ids in taken[key]][-len(batches):] or \
            [i for _, _, ids in batches for i in ids] == reference_ids(n, 2, key[0], shuffle=True, seed=0,
                                                                        drop_last=False, epoch=0)[:STEPS * ACCUM * MB]
    fed_loss, local_loss = losses(fed / "loss.jsonl"), losses(local / "loss.jsonl")
    assert sorted(local_loss) == list(range(1, STEPS + 1))
    for step, loss in local_loss.items():
        assert fed_loss[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (step, fed_loss, local_loss)
