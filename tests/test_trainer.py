"""Real DeepSpeed: 2 ranks on CPU (gloo) from a live feeder, checkpoint, resume."""
from __future__ import annotations

import json
import mmap
import os
import sys
import time
from pathlib import Path

import pytest

from feeder.core.config import ServeConfig
from feeder.service.server import ServerThread
from tests.helpers import free_port, launch

pytestmark = pytest.mark.slow
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
TRAIN = str(Path(__file__).resolve().parent.parent / "trainer" / "train.py")


def train(address, job, tmp: Path, *extra, expect_rc=0, limit_s=240):
    """One `deepspeed` run of 2 ranks. A run past limit_s gets SIGABRT, so that faulthandler
    prints where every rank's threads stood, and the test fails with that in its message."""
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), TRAIN, "--targets", address,
           "--job", job, "--seq-len", "64", "--micro-batch", "4", "--grad-accum", "2", "--log-every", "3", *extra]
    return launch(cmd, tmp, job, limit_s=limit_s, expect_rc=expect_rc)


def ds_shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


def read_ids(d: Path, rank: int):
    return [json.loads(l) for l in (d / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture
def planted_segments():
    """Segments as earlier DeepSpeed runs leave them: an old one nothing maps (to be freed), a
    fresh one (a job may be creating it) and an old one this process maps (in use): both kept."""
    base = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.9_"
    paths = {k: Path(f"{base}{port}_0") for k, port in (("orphan", 1), ("fresh", 2), ("mapped", 3))}
    for p in paths.values():
        p.write_bytes(b"\0" * 4096)
    for k in ("orphan", "mapped"):
        os.utime(paths[k], (time.time() - 7200,) * 2)
    fd = os.open(paths["mapped"], os.O_RDWR)
    m = mmap.mmap(fd, 4096)
    yield paths
    m.close()
    os.close(fd)
    for p in paths.values():
        p.unlink(missing_ok=True)


@pytest.mark.timeout(800)
def test_resumed_ranks_receive_exactly_the_samples_of_an_uninterrupted_run(dataset, tmp_path, planted_segments):
    shm_before = ds_shm_segments()
    with ServerThread(ServeConfig(source=str(dataset), listen="127.0.0.1:0")) as srv:
        out = train(srv.address, "straight", tmp_path, "--steps", "12", "--log-ids", str(tmp_path / "a"))
        assert "done: 12 steps" in out and "tokens/s" in out and "data-wait" in out
        # what earlier runs left is freed, and only that
        assert "shared-memory segments" in out and "that earlier DeepSpeed runs left" in out
        assert not planted_segments["orphan"].exists()
        assert planted_segments["fresh"].exists() and planted_segments["mapped"].exists()
        # checkpoint at step 6, crash at step 9: the feeder has streamed well past step 6 by then
        train(srv.address, "crashed", tmp_path, "--steps", "12", "--save-every", "6", "--crash-at-step", "9",
              "--ckpt-dir", str(tmp_path / "ck"), "--log-ids", str(tmp_path / "b"), expect_rc=17)
        out = train(srv.address, "crashed", tmp_path, "--steps", "12", "--resume",
                    "--ckpt-dir", str(tmp_path / "ck"), "--log-ids", str(tmp_path / "c"))
        assert "resumed from" in out and "at step 6" in out
    # DeepSpeed's CPU all-reduce segments (66 MiB a rank) are gone, the crashed run's too
    assert ds_shm_segments() - shm_before == set()
    for rank in (0, 1):
        a, b, c = (read_ids(tmp_path / d, rank) for d in "abc")
        assert len(a) == 24  # 12 steps x 2 micro-batches
        assert [x["ids"] for x in b[:12]] == [x["ids"] for x in a[:12]]
        assert len(b) >= 16, "the crashed run got past its checkpoint before dying"
        # the restarted rank continues from the checkpoint's cursor, not the feeder's latest position
        assert [x["step"] for x in c] == [
            s for s in range(6, 12) for _ in (0, 1)]
        assert [x["ids"] for x in c] == [x["ids"] for x in a[12:]], f"rank {rank}"
    # and the two ranks never shared a sample
    both = [i for r in (0, 1) for x in read_ids(tmp_path / "a", r) for i in x["ids"]]
    assert len(both) == len(set(both))


@pytest.mark.timeout(600)
def test_a_mixture_trains_logs_per_source_loss_and_remixes_on_resume(tmp_path):
    """train.py --mixture: per-source losses in the log, sources in the ids log; resumed from
    its checkpoint with another --mixture and --remix, it goes on from the checkpoint's step
    under the new weights (a source that was not in the old mixture included)."""
    from collections import Counter

    from tests.helpers import make_docs, prep_docs

    dirs = {}
    for name, seed in (("web", 21), ("code", 22), ("news", 23)):
        (tmp_path / name).mkdir()
        dirs[name] = str(prep_docs(tmp_path / name, make_docs(300, seed=seed)))
    cfg = ServeConfig(sources=tuple(dirs.items()), listen="127.0.0.1:0")
    with ServerThread(cfg) as srv:
        out = train(srv.address, "mixed", tmp_path, "--steps", "6", "--save-every", "3", "--mixture",
                    "web=0.7,code=0.3", "--ckpt-dir", str(tmp_path / "ck"), "--log-ids", str(tmp_path / "a"))
        assert "done: 6 steps" in out
        lines = [line for line in out.splitlines() if line.startswith("step")]
        assert lines and all(" web " in line and " code " in line for line in lines), out[-2000:]
        out = train(srv.address, "mixed", tmp_path, "--steps", "9", "--resume", "--remix", "--mixture",
                    "web=0.2,code=0.3,news=0.5", "--ckpt-dir", str(tmp_path / "ck"), "--log-ids", str(tmp_path / "b"))
        assert "resumed from" in out and "at step 6" in out, out[-2000:]
    for rank in (0, 1):
        a, b = read_ids(tmp_path / "a", rank), read_ids(tmp_path / "b", rank)
        before = Counter(s for x in a for s in x["sources"])
        after = Counter(s for x in b for s in x["sources"])
        assert set(before) <= {0, 1} and before[0] > before[1]   # web 0.7, code 0.3
        assert [x["step"] for x in b] == [s for s in range(6, 9) for _ in (0, 1)]
        assert after[2] > after[0]                               # news 0.5 now, web 0.2


@pytest.mark.timeout(900)
def test_a_live_schedule_change_while_four_ranks_train_switches_them_at_one_position_exactly(tmp_path):
    """Issue 46: train.py --mixture-schedule on 4 DeepSpeed ranks; `feeder mix` changes the
    schedule while they train; the job crashes after its checkpoint and resumes from it. Every
    rank's samples, before and after the change and across the resume, are the oracle's under the
    schedule spliced at the position the change reports; the ledger's audit finds each once."""
    import subprocess
    import threading

    from feeder.core import sampler
    from tests.helpers import byte_stream, make_docs, prep_docs, reference_ids
    from tests.schedule_oracle import Blend, Segments, sample

    names, docs, dirs = ("web", "code"), {}, {}
    for name, seed in (("web", 31), ("code", 32)):
        (tmp_path / name).mkdir()
        docs[name] = make_docs(900, seed=seed)
        dirs[name] = str(prep_docs(tmp_path / name, docs[name]))
    # (1024 tokens a sample: what the feeder plans ahead of the loop is bounded in bytes (the
    # client's read-ahead, the feeder's prefetch, gRPC's window), so the change, past all of it,
    # comes within the run)
    seq = 1024
    sizes = [sampler.n_samples(len(byte_stream(docs[n])), seq) for n in names]
    n = sum(sizes)
    (tmp_path / "sched.toml").write_text("[[segment]]\nweights = {web = 3, code = 1}\n")
    (tmp_path / "change.toml").write_text("[[segment]]\nweights = {web = 0, code = 1}\n")
    ledger = tmp_path / "ledger.jsonl"
    cfg = ServeConfig(sources=tuple(dirs.items()), listen="127.0.0.1:0", ledger=str(ledger), message_bytes=8192,
                      prefetch_messages=2, cache_dir=str(tmp_path / "cache"))
    changed = {}

    def change_when_training(srv_address):
        log = tmp_path / "a" / "rank0.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if log.exists() and len(log.read_text().splitlines()) >= 2:   # 2 steps in
                p = subprocess.run([sys.executable, "-m", "feeder.cli", "mix", "sched", "--schedule",
                                    str(tmp_path / "change.toml"), "--relative", "--target", srv_address],
                                   capture_output=True, text=True, timeout=60)
                changed["out"] = p.stdout + p.stderr
                return
            time.sleep(0.05)

    with ServerThread(cfg) as srv:
        t = threading.Thread(target=change_when_training, args=(srv.address,), daemon=True)
        t.start()
        # (a small read-ahead, uncompressed: the change comes past all that was sent, which is then
        # near the loop; these toy documents compress 4x, and gRPC's window is in bytes)
        common = ["--mixture-schedule", str(tmp_path / "sched.toml"), "--ckpt-dir", str(tmp_path / "ck"),
                  "--max-read-ahead", "4", "--compression", "none"]
        out = train4(srv.address, "sched", tmp_path, "--steps", "40", "--save-every", "20", "--crash-at-step", "28",
                     "--log-ids", str(tmp_path / "a"), *common, expect_rc=17)
        t.join(60)
        assert "version 1 from progress" in changed.get("out", ""), changed
        at = int(changed["out"].split("from progress ")[1].split(" ")[0].replace(",", ""))
        out = train4(srv.address, "sched", tmp_path, "--steps", "40", "--resume", "--log-ids", str(tmp_path / "b"),
                     *common)
        assert "resumed from" in out and "at step 20" in out, out[-2000:]
        lines = [line for line in out.splitlines() if line.startswith("step")]
        assert lines and all(" web " in line and " code " in line for line in lines), out[-2000:]
    blend = Blend(Segments.from_table(names, [{"weights": {"web": 3, "code": 1}}]).spliced(
        Segments([(at, at, 0, [0.0, 1.0], [0.0, 1.0])]), at), 2)
    before = after = 0
    for rank in range(4):
        a, b = read_ids(tmp_path / "a", rank), read_ids(tmp_path / "b", rank)
        assert [x["step"] for x in b] == list(range(20, 40))
        got = [(x["epoch"], s, i) for x in [*a[:20], *b] for s, i in zip(x["sources"], x["ids"])]
        want_idx = [(e, i) for e in range(12) for i in reference_ids(n, 4, rank, shuffle=False, seed=0,
                                                                     drop_last=False, epoch=e)][:len(got)]
        for (e, s, i), (we, wi) in zip(got, want_idx):
            g = we * n + wi
            assert (e, s, i) == (we, *sample(blend, names, sizes, 0, True, g)), (rank, g, at)
            before, after = before + (g < at), after + (g >= at)
    assert before > 0 and after > 0, (before, after, at)
    # the ledger: every epoch the job finished exactly once, and none of any epoch twice or in two ways
    # (the job stopped at step 40, inside its last epoch)
    p = subprocess.run([sys.executable, "-m", "feeder.cli", "audit", str(ledger), "--json"], capture_output=True,
                       text=True, timeout=120)
    verdicts = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert len(verdicts) >= 3, p.stdout + p.stderr
    for v in verdicts:
        assert not v["conflicts"] and v["n_duplicate_deliveries"] <= v["padding_allowed"], v
        assert v["exactly_once"] or v["epoch"] == max(x["epoch"] for x in verdicts), v


def train4(address, job, tmp: Path, *extra, expect_rc=0, limit_s=400):
    cmd = [DEEPSPEED, "--num_gpus", "4", "--master_port", str(free_port()), TRAIN, "--targets", address,
           "--job", job, "--seq-len", "1024", "--micro-batch", "8", "--log-every", "5", *extra]
    return launch(cmd, tmp, job, limit_s=limit_s, expect_rc=expect_rc)
