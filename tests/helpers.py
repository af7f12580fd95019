"""Shared test helpers: deterministic corpora, the independently computed packed stream,
and torch's own DistributedSampler as the reference."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from torch.utils.data import DistributedSampler

from feeder.core.net import free_port

WORDS = ("the feeder streams packed token batches to every rank über données 数据 ✓ "
         "def main(): return 0 # comment\n").split(" ")


def make_docs(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = 0 if i % 17 == 5 else rng.randint(1, max_words)  # some empty documents
        docs.append(" ".join(rng.choice(WORDS) for _ in range(k)))
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def prep_docs(root: Path, docs: list[str], **kw) -> Path:
    """`feeder prep` (byte tokenizer, one worker) of docs into root/shards."""
    from feeder.core.tool_config import PrepConfig
    from feeder.ops.prep import prep

    prep(PrepConfig(inputs=(str(write_jsonl(root / "docs.jsonl", docs)),), out=str(root / "shards"), workers=1,
                    progress=False, **kw))
    return root / "shards"


def byte_stream(docs: list[str]) -> np.ndarray:
    """The packed stream under the byte tokenizer, computed without the feeder's code."""
    ids: list[int] = []
    for d in docs:
        ids.extend(d.encode("utf-8"))
        ids.append(256)
    return np.asarray(ids, dtype=np.int64)


def packed_bins(docs: list[str], seq_len: int) -> np.ndarray:
    """Best-fit-decreasing bins of the documents under the byte tokenizer, computed from the rule
    (docs/packing.md) without the feeder's code: int64 [bins, seq_len + 1], EOS-padded.

    Each document with its EOS; one longer than a bin cut into bin-sized pieces (each a bin, in
    stream order, before the rest), its remainder packed with the others: longest first (ties in
    stream order), each into the fullest open bin it fits (ties: the latest to reach that fill),
    else a new bin."""
    cap = seq_len + 1
    whole, items = [], []
    for d in docs:
        toks = [*d.encode("utf-8"), 256]
        cut = len(toks) - len(toks) % cap
        whole += [toks[a:a + cap] for a in range(0, cut, cap)]
        if cut < len(toks):
            items.append(toks[cut:])
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []      # per bin: (room left, when it got there)
    for t, i in enumerate(sorted(range(len(items)), key=lambda i: (-len(items[i]), i))):
        fits = [b for b in range(len(bins)) if room[b][0] >= len(items[i])]
        if fits:
            b = min(fits, key=lambda b: (room[b][0], -room[b][1]))
        else:
            b = len(bins)
            bins.append([])
            room.append((cap, t))
        bins[b] += items[i]
        room[b] = (cap - len(bins[b]), t)
    out = np.full((len(whole) + len(bins), cap), 256, dtype=np.int64)
    for r, toks in enumerate(whole + bins):
        out[r, :len(toks)] = toks
    return out


def reference_ids(n: int, world: int, rank: int, *, shuffle: bool, seed: int, drop_last: bool, epoch: int,
                  permutation: str = "torch") -> list[int]:
    """torch's DistributedSampler's list; with the stateless order, its dealing (interleave,
    padding, drop_last) of the positions, each mapped through that epoch's stateless order."""
    stateless = shuffle and permutation == "stateless"
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle and not stateless, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    if stateless:
        from feeder.core.order import Stateless

        return Stateless(n, seed + epoch)[np.asarray(list(s), dtype=np.int64)].tolist()
    return list(s)


def reference_slice(n: int, world: int, rank: int, *, shuffle: bool, seed: int, drop_last: bool, epoch: int,
                    permutation: str = "torch", start: int = 0, stop: int | None = None) -> list[int]:
    """reference_ids(...)[start:stop] without listing the epoch, for epochs of 10^9 positions and
    more: DistributedSampler's dealing written out (rank r's k-th index is the order's entry
    (r + k·world) mod n: the interleave, with padding taken again from the front), over the
    identity or the stateless order. torch's shuffled order has no random access, so it is
    taken from reference_ids, which is only practical for small n. Checked against
    reference_ids in tests/test_order.py."""
    if shuffle and permutation != "stateless":
        return reference_ids(n, world, rank, shuffle=True, seed=seed, drop_last=drop_last, epoch=epoch)[start:stop]
    count = (n // world if drop_last else -(-n // world)) if n > 0 else 0
    stop = count if stop is None else min(stop, count)
    if start >= stop:
        return []
    g = (rank + np.arange(start, stop, dtype=np.int64) * world) % n
    if not shuffle:
        return g.tolist()
    from feeder.core.order import Stateless

    return Stateless(n, seed + epoch)[g].tolist()


def sample(stream: np.ndarray, i: int, seq_len: int) -> np.ndarray:
    return stream[i * seq_len:i * seq_len + seq_len + 1]


def expected_ids(stream: np.ndarray, rank: int, world: int, seq_len: int, seed: int, epoch: int = 0) -> list[int]:
    from feeder.core.sampler import n_samples

    return reference_ids(n_samples(len(stream), seq_len), world, rank, shuffle=True, seed=seed, drop_last=False,
                         epoch=epoch)


def check_batches(batches, stream: np.ndarray, seq_len: int, want: list[int]) -> None:
    """The batches hold exactly `want`, in order, each sample's tokens cut from the stream."""
    assert [i for b in batches for i in b.sample_ids.tolist()] == want
    for b in batches:
        for row, i in zip(b.tokens.numpy(), b.sample_ids.tolist()):
            np.testing.assert_array_equal(row, sample(stream, i, seq_len))


def served_until_error(batches):
    """(the batches a stream gave before it ended with a FeederError, that error); a stream
    that ends without one fails the test."""
    import pytest

    from feeder.core.errors import FeederError

    served = []
    with pytest.raises(FeederError) as e:
        for b in batches:
            served.append(b)
    return served, e.value


def take_killing(ds, feeders, points, limit: int = 0) -> tuple[list, int]:
    """Iterate ds (up to `limit` batches; 0: to its end), SIGKILLing the feeder serving it after
    each batch index in `points` and starting it again on its port: (the batches, kills)."""
    got, kills = [], 0
    for k, b in enumerate(ds):
        got.append(b)
        if kills < len(points) and k == points[kills]:
            victim = next(f for f in feeders if f.address == ds.client.target)
            victim.signal(signal.SIGKILL)
            victim.start()
            kills += 1
        if len(got) == limit:
            break
    return got, kills


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """The run was refused as a user's mistake: exit 2, one line naming what was wrong."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


class FeederProc:
    """A `feeder serve` subprocess on a fixed port, so a restart keeps its address."""

    def __init__(self, dataset, port=None, extra=(), source=None, host="127.0.0.1", prefix=()):
        self.source = str(source or dataset)
        self.port, self.extra = port or free_port(), list(extra)
        self.prefix = list(prefix)   # e.g. setpriv: the feeder as another user
        self.address = f"{host}:{self.port}"
        self.proc = None
        self.metrics = ""
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "feeder.cli", "serve", "--source", self.source, "--listen", self.address,
             "--grace", "1", "--message-bytes", "8192", "--prefetch-messages", "2", *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        assert "listening on" in line, f"feeder did not start: {line!r}"
        if "--metrics-port" in self.extra:
            line = self.proc.stdout.readline()
            assert "metrics on " in line, line
            self.metrics = line.split("metrics on ")[1].strip()

    def signal(self, sig):
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            assert self.proc.wait(20) in (0, -signal.SIGKILL)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


def launch(cmd: list[str], cwd, what: str, *, limit_s: float, expect_rc: int = 0, env: dict | None = None,
           merged: bool = False) -> str:
    """Run a launch (`deepspeed`, `torchrun`) to its end: its stdout (with its stderr when
    `merged`; `env`: variables set on top of this process's). A run past limit_s gets SIGABRT, so
    that faulthandler prints where every rank's threads stood, and the test fails with that in
    its message; a run that fails (or succeeds) against `expect_rc` fails the test with its output."""
    import os
    import signal

    import pytest

    for attempt in (1, 2):
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                             text=True, cwd=cwd, env=dict(os.environ, PYTHONFAULTHANDLER="1", **(env or {})),
                             start_new_session=True)
        hung = False
        try:
            out, err = p.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGABRT)
            out, err = p.communicate(timeout=60)
            hung = True
        failed = hung or (p.returncode == 0) != (expect_rc == 0)
        if not (failed and attempt == 1 and _rendezvous_failed(out + (err or ""))):
            break
    if hung:
        pytest.fail(f"{what}: no end after {limit_s} s; the ranks' stacks:\n{out[-12000:]}\n{(err or '')[-20000:]}")
    assert (p.returncode == 0) == (expect_rc == 0), out[-6000:] + (err or "")[-3000:]
    return out


def _rendezvous_failed(text: str) -> bool:
    """Whether a launch's ranks died making gloo's process group while DeepSpeed's engine
    started, so before any batch was read: torch.distributed's own start on a loaded 2-core host
    (`DistNetworkError: Broken pipe` in ProcessGroupGloo, the other ranks then waiting in its
    rendezvous: the HF Trainer test in a fresh-clone run at 935b057). Such a launch is tried once
    more: its ranks trained nothing, and the new processes take their ranks over."""
    return all(mark in text for mark in ("DistNetworkError", "ProcessGroupGloo(", "DeepSpeedEngine("))
