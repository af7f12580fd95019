"""Accelerate, the Hugging Face Trainer and Lightning fed by a live feeder: 2 ranks on CPU (gloo),
launched by torchrun, each framework's own checkpoint and resume call (trainer/examples/).

What is checked, per framework: the ids each rank trained on are DistributedSampler's; a run
checkpointed at step k and killed, resumed with the framework's resume call, trains on exactly
the uninterrupted run's ids after step k, and the feeder's ledger shows it was never asked for
a batch before step k (no batches skipped by pulling them); gradient accumulation 2 with 2
DataLoader workers; the mistakes a user makes are refused with a message that says what to do.
"""
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
EXAMPLES = Path(__file__).resolve().parent.parent / "trainer" / "examples"
SEQ, MB, SEED = 64, 4, 3
# One launch's limit, a hang guard: a launch takes 20-60 s on an idle 2-core host and twice that
# on a loaded one (CI at c636b4e: the ZeRO-2 test's three launches passed 240 s in all).
LAUNCH_S = 240


def launches(n: int) -> int:
    """A test's timeout for n launches: each may run to its own limit, and be tried once more
    (launch()'s one retry of a rendezvous that failed), before pytest-timeout steps in."""
    return (n + 1) * LAUNCH_S + 60


def torchrun(example: str, address: str, job: str, cwd: Path, *extra: str, expect_rc: int = 0,
             limit_s: float = LAUNCH_S) -> str:
    """One torchrun of 2 CPU ranks; stdout+stderr. A hung run gets SIGABRT (faulthandler
    prints every rank's stacks) and fails the test with them."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(EXAMPLES / f"{example}.py"), "--targets", address, "--job", job, "--seq-len", str(SEQ),
           "--micro-batch", str(MB), "--seed", str(SEED), *extra]
    return launch(cmd, cwd, f"{example} {job}", limit_s=limit_s, expect_rc=expect_rc, merged=True,
                  env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
                       "HF_HUB_OFFLINE": "1"})


def ids_log(d: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (d / f"rank{rank}.jsonl").read_text().splitlines()]


def ledger_steps(path: Path, job: str, rank: int) -> list[int]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted({r["step"] for r in recs if r.get("job") == job and r.get("rank") == rank and "ids" in r})


def check_exact_resume(example: str, dataset: Path, stream, tmp: Path, *, steps: int, save: int, crash: int,
                       grad_accum: int, workers: int, resume_args: tuple[str, ...], extra: tuple[str, ...] = ()) -> None:
    """Straight run; a run saving every `save` steps killed after `crash`; the resumed run.
    Each on a feeder of its own with a ledger, so the ledger shows what each run asked for."""
    common = ("--steps", str(steps), "--grad-accum", str(grad_accum), "--workers", str(workers), *extra)
    runs = {}
    for name, job, extra, rc in (
            ("a", "straight", (), 0),
            ("b", "crashed", ("--save-every", str(save), "--crash-at-step", str(crash)), 17),
            ("c", "crashed", resume_args, 0)):
        ledger = tmp / f"ledger-{name}.jsonl"
        with ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0", ledger=str(ledger))) as srv:
            runs[name] = torchrun(example, srv.address, job, tmp, *common, "--out", str(tmp / "ckpt"),
                                  "--log-ids", str(tmp / name), *extra, expect_rc=rc)
    n = n_samples(len(stream), SEQ)
    first = save * grad_accum               # the feeder step right after the checkpoint
    for rank in (0, 1):
        a, b, c = (ids_log(tmp / d, rank) for d in "abc")
        want = reference_ids(n, 2, rank, shuffle=True, seed=SEED, drop_last=False, epoch=0)
        assert len(a) == steps * grad_accum
        assert [i for x in a for i in x["ids"]] == want[:steps * grad_accum * MB], f"rank {rank}: not DistributedSampler's"
        assert [x["feeder_step"] for x in a] == list(range(steps * grad_accum))
        assert [x["ids"] for x in b[:first]] == [x["ids"] for x in a[:first]]
        assert len(b) >= crash * grad_accum, "the killed run got past its checkpoint before dying"
        # the resumed run trains on exactly the uninterrupted run's batches after the checkpoint
        assert [x["ids"] for x in c] == [x["ids"] for x in a[first:]], f"rank {rank}"
        assert [x["step"] for x in c] == [s for s in range(save, steps) for _ in range(grad_accum)]
        # and the feeder was asked for nothing before the checkpoint's step: no batch was skipped by pulling it
        asked = ledger_steps(tmp / "ledger-c.jsonl", "crashed", rank)
        assert asked and min(asked) == first, f"rank {rank}: the resumed run asked for steps {asked[:5]}..."


# --- Accelerate -----------------------------------------------------------------------------------

@pytest.mark.timeout(launches(3))
def test_accelerate_exact_with_grad_accum_and_workers_and_resume_by_load_state(dataset, stream, tmp_path):
    check_exact_resume("accelerate_train", dataset, stream, tmp_path, steps=6, save=3, crash=5, grad_accum=2,
                       workers=2, resume_args=("--resume",))


@pytest.mark.timeout(launches(4))
def test_accelerate_mistakes_are_refused_with_what_to_do(feeder, tmp_path):
    for workers in ("0", "2"):    # forked workers carry the dispatcher's frames: seen there too
        out = torchrun("accelerate_train", feeder.address, "mistake-dispatch", tmp_path, "--mistake", "dispatch",
                       "--workers", workers, expect_rc=1)
        assert "must not be wrapped by DataLoaderDispatcher" in out and "prepare_feeder(accelerator, dataset)" in out
    out = torchrun("accelerate_train", feeder.address, "mistake-shard", tmp_path, "--mistake", "shard", expect_rc=1)
    assert "must not be wrapped by IterableDatasetShard" in out and "every world_size-th" in out
    out = torchrun("accelerate_train", feeder.address, "mistake-rank", tmp_path, "--mistake", "rank", expect_rc=1)
    assert "feeder dataset rank=0 but the torch.distributed process group says rank=1" in out


# --- Hugging Face Trainer -------------------------------------------------------------------------

@pytest.mark.timeout(launches(3))
def test_hf_trainer_exact_with_grad_accum_and_workers_and_resume_from_checkpoint(dataset, stream, tmp_path):
    check_exact_resume("hf_trainer", dataset, stream, tmp_path, steps=6, save=3, crash=5, grad_accum=2,
                       workers=2, resume_args=("--resume",))
    # the cursors are in the Trainer's checkpoint folder, next to its RNG and optimizer state
    assert {"feeder_state.pt", "rng_state_0.pth", "rng_state_1.pth", "optimizer.pt"} <= {
        p.name for p in (tmp_path / "ckpt" / "checkpoint-3").iterdir()}


@pytest.mark.timeout(launches(3))
def test_hf_trainer_with_deepspeed_zero2_is_exact_too(dataset, stream, tmp_path):
    """The issue's case: the Trainer run with --deepspeed (ZeRO-2, on CPU here), the same checks."""
    check_exact_resume("hf_trainer", dataset, stream, tmp_path, steps=4, save=2, crash=3, grad_accum=2,
                       workers=0, resume_args=("--resume",),
                       extra=("--deepspeed", str(EXAMPLES / "ds_zero2_hf.json")))
    assert (tmp_path / "ckpt" / "checkpoint-2" / "global_step2").is_dir()   # DeepSpeed's own checkpoint


@pytest.mark.timeout(launches(2))
def test_hf_trainer_mistakes_are_refused_with_what_to_do(feeder, tmp_path):
    # a plain Trainer re-batches the dataset and hands it to accelerator.prepare (here with workers too)
    out = torchrun("hf_trainer", feeder.address, "mistake-plain", tmp_path, "--mistake", "plain", "--workers", "2",
                   expect_rc=1)
    assert "not a DataLoader that batches again (a Trainer given the dataset without FeederTrainer" in out
    out = torchrun("hf_trainer", feeder.address, "mistake-rank", tmp_path, "--mistake", "rank", expect_rc=1)
    assert "feeder dataset rank=0 but the torch.distributed process group says rank=1" in out


# --- Lightning ------------------------------------------------------------------------------------

@pytest.mark.timeout(launches(3))
def test_lightning_exact_with_grad_accum_and_workers_and_fit_ckpt_path(dataset, stream, tmp_path):
    """Lightning's fetcher reads a batch ahead of the one trained on: the checkpoint must hold
    the trained one's cursor, or the resumed run would miss a batch per rank."""
    check_exact_resume("lightning_train", dataset, stream, tmp_path, steps=6, save=3, crash=5, grad_accum=2,
                       workers=2, resume_args=("--resume",))


@pytest.mark.timeout(launches(3))
def test_lightning_mistakes_are_refused_with_what_to_do(feeder, tmp_path):
    out = torchrun("lightning_train", feeder.address, "mistake-rebatch", tmp_path, "--mistake", "rebatch", expect_rc=1)
    assert "wrap it in DataLoader(dataset, batch_size=None)" in out
    out = torchrun("lightning_train", feeder.address, "mistake-rank", tmp_path, "--mistake", "rank", expect_rc=1)
    assert "feeder dataset rank=0 but the torch.distributed process group says rank=1" in out
    # training_step(dataloader_iter) skips the hook that records the trained batch's cursor: refused at the save
    out = torchrun("lightning_train", feeder.address, "mistake-iter", tmp_path, "--mistake", "iter", "--save-every",
                   "2", "--out", str(tmp_path / "ckpt"), expect_rc=1)
    assert "pass each batch through self.trainer.datamodule.on_before_batch_transfer(batch, 0)" in out


# --- in one process: the loader's state and the checks, without a framework --------------------

def test_loader_state_continues_exactly_and_refuses_another_stream(feeder, stream):
    from feeder_trainer.integrations.common import DistributedFeederDataset, FeederIntegrationError, FeederLoader

    def loader(job="state", rank=0, world_size=2):
        return FeederLoader(DistributedFeederDataset(feeder.address, job=job, rank=rank, world_size=world_size,
                                                     seq_len=SEQ, micro_batch=MB, seed=SEED))

    want = reference_ids(n_samples(len(stream), SEQ), 2, 0, shuffle=True, seed=SEED, drop_last=False, epoch=0)
    first = loader()
    it = iter(first)
    took = [next(it).sample_ids.tolist() for _ in range(3)]   # the loop stops here; read-ahead is not taken
    state = first.state_dict()
    assert set(state["cursors"]) == {0} and state["world_size"] == 2
    again = loader()
    again.load_state_dict(state)
    rest = next(iter(again)).sample_ids.tolist()
    assert [i for b in took for i in b] + rest == want[:4 * MB]
    # a new pass over the same loader continues after the last batch taken, too
    assert next(iter(first)).sample_ids.tolist() == rest
    for other, msg in ((loader(job="other"), "job 'state' over 2 ranks, this run streams job 'other' over 2"),
                       (loader(world_size=3), "job 'state' over 2 ranks, this run streams job 'state' over 3"),
                       (loader(rank=1), "no cursor for rank 1")):
        with pytest.raises(FeederIntegrationError, match=msg):
            other.load_state_dict(state)


def test_rank_from_the_environment_and_rebatching_refused(feeder, monkeypatch):
    from torch.utils.data import DataLoader

    from feeder_trainer.integrations.common import DistributedFeederDataset, FeederIntegrationError

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ds = DistributedFeederDataset(feeder.address, job="env", seq_len=SEQ, micro_batch=MB)
    assert (ds.spec.rank, ds.spec.world_size) == (1, 3)
    with pytest.raises(FeederIntegrationError, match="world_size=2 but RANK/WORLD_SIZE in the environment says"):
        DistributedFeederDataset(feeder.address, job="env", seq_len=SEQ, micro_batch=MB, world_size=2)
    with pytest.raises(FeederIntegrationError, match=r"wrap it in DataLoader\(dataset, batch_size=None\)"):
        next(iter(DataLoader(ds, batch_size=2)))
    assert next(iter(DataLoader(ds, batch_size=None))).sample_ids.numel() == MB
