"""`feeder bench --only scale` (issue 25): the first batch and the feeder's memory from 10^6 to
10^10 samples, for each order, and mixtures of 10^9 and 10^10 positions.

Each corpus is a sparse nanoGPT .bin of zeros (`truncate`: it costs no disk), seq_len 16 (the
order does not care how long a sample is; a longer one only makes the sparse file larger). Each
figure is one fresh `feeder serve` process with an empty cache directory, and rank 0 of 8 asking
for its first batch: the time from opening the stream to holding the batch, and the feeder's
peak resident memory (VmHWM), with the peak of its anonymous part apart (what is not the
memory-mapped order). torch's order is built once per (n, seed + epoch) into the cache directory;
a second process on the same cache ("again") then starts at once. At 10^10 torch's order would be
an 80 GB file (uint64): left out on this 24 GB machine, and said so."""
from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from .clients import Clients, Feeder
from .config import BenchConfig, say

SEQ = 16
SIZES = (10**6, 10**7, 10**8, 10**9, 10**10)
TORCH_MAX = 10**9          # torch's order at 10^10 is an 80 GB file: not on this machine
MIX_SIZES = (10**9, 10**10)


def _corpus(root: Path, n: int) -> Path:
    path = root / f"flat-{n}.bin"
    if not path.exists():
        with open(path, "wb") as f:
            f.truncate((n * SEQ + 1) * 2)
    return path


class _Peak:
    """Samples a process's anonymous resident memory (its peak: VmHWM covers file pages too)."""

    def __init__(self, pid: int):
        self.pid, self.anon_mb, self._stop = pid, 0.0, threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while not self._stop.wait(0.05):
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("RssAnon:"):
                            self.anon_mb = max(self.anon_mb, int(line.split()[1]) / 1024)
            except OSError:
                return

    def hwm_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self):
        self._stop.set()


def _first_batch(source: str, cache: Path, *, permutation: str, mixture=None, epoch_samples: int = 0,
                 extra=()) -> dict:
    """One fresh feeder process; rank 0 of 8 takes its first batch."""
    from feeder_client import FeederDataset

    f = Feeder(source, message_bytes=1 << 20, extra=["--vocab-size", "256", "--eos-id", "0", "--cache-dir",
                                                      str(cache), *extra])
    peak = _Peak(f.proc.pid)
    try:
        ds = FeederDataset([f.address], job="scale", rank=0, world_size=8, seq_len=SEQ, micro_batch=8,
                           permutation=permutation, mixture=mixture, epoch_samples=epoch_samples, retry_for_s=600,
                           idle_timeout_s=60)
        t0 = time.perf_counter()
        batch = next(iter(ds))
        took = time.perf_counter() - t0
        ds.client.close()
        out = {"first_batch_s": took, "feeder_peak_rss_mb": peak.hwm_mb(), "feeder_peak_anon_mb": peak.anon_mb,
               "max_id": int(batch.sample_ids.max())}
    finally:
        peak.stop()
        f.stop()
    return out


def _verify_s(cache: Path, n: int) -> float:
    """What verifying torch's order costs a process that finds it in the cache (issue 34: part of
    "again"'s first batch; at most 2 s at 10^9): a fresh order store opens the file the feeders
    built (seed 0, epoch 0: the bench's rank) and checks it whole before mapping it."""
    from feeder.core.sampler import OrderPending
    from feeder.domain.order_store import OrderStore

    st = OrderStore(str(cache))
    t0 = time.perf_counter()
    try:
        st.get(n, 0, "torch")
    except OrderPending:   # (not found sound: it would be built again; no figure)
        return float("nan")
    return time.perf_counter() - t0


def scale_figures(cfg: BenchConfig, root: Path | None = None) -> dict:
    """Every figure of the scale table, and tokens/s of the two orders on the bench corpus."""
    root = Path(root or tempfile.mkdtemp(prefix="feeder-scale-", dir=os.environ.get("FEEDER_SCALE_DIR")))
    rows = []
    sizes = SIZES[:3] if cfg.quick else SIZES
    for n in sizes:
        src = str(_corpus(root, n))
        for permutation in ("stateless", "torch"):
            if permutation == "torch" and n > TORCH_MAX:
                rows.append({"n": n, "order": "torch", "skipped": "an 80 GB order file (uint64): not on this "
                                                                  "machine's 24 GB"})
                continue
            cache = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
            say(f"scale: {n:.0e} samples, {permutation} order: first batch, fresh process")
            row = {"n": n, "order": permutation, **_first_batch(src, cache, permutation=permutation)}
            if permutation == "torch":
                say(f"scale: {n:.0e} samples, torch order: first batch of a second process on the same cache")
                again = _first_batch(src, cache, permutation=permutation)
                row.update(again_first_batch_s=again["first_batch_s"], again_peak_rss_mb=again["feeder_peak_rss_mb"],
                           again_peak_anon_mb=again["feeder_peak_anon_mb"], verify_s=_verify_s(cache, n))
            rows.append(row)
    for n in (() if cfg.quick else MIX_SIZES):
        a, b = _corpus(root, 10**8), _corpus(root, 3 * 10**7)
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
        say(f"scale: a mixture of 2 sources over {n:.0e} positions, stateless order")
        row = {"n": n, "order": "stateless", "mixture": "a=0.7,b=0.3",
               **_first_batch(f"a={a}", cache, permutation="stateless", mixture={"a": 0.7, "b": 0.3},
                              epoch_samples=n, extra=["--source", f"b={b}"])}
        rows.append(row)
    return {"scale": rows, "orders_tokens_s": _orders_tokens_s(cfg)}


def _orders_tokens_s(cfg: BenchConfig) -> dict:
    """Tokens/s of the stateless and the torch order on the bench corpus, interleaved rounds."""
    from .dataset import dataset

    data = dataset(cfg)
    clients = Clients()
    f = Feeder(data["shards"], message_bytes=cfg.message_bytes)
    got = {"torch": [], "stateless": []}
    try:
        for i in range(cfg.rounds):
            for perm in got:
                say(f"orders round {i + 1} of {cfg.rounds}: {cfg.ranks} ranks, {perm} order (counting clients)")
                got[perm].append(clients.count([f.address], f"ord-{perm}-{i}", cfg.ranks, seq_len=cfg.seq_len,
                                               mb=cfg.micro_batch, seconds=cfg.seconds,
                                               permutation=perm)["tokens_s"])
    finally:
        f.stop()
        clients.close()
    t, s = statistics.median(got["torch"]), statistics.median(got["stateless"])
    return {"torch_tokens_s": t, "stateless_tokens_s": s, "ratio": s / t, "rounds": got}


def scale_table(res: dict) -> str:
    lines = ["samples        order      first batch   peak RSS   peak anon   again (same cache)   of it, verifying the order"]
    for r in res.get("scale", []):
        what = f"{r['n']:.0e}" + (" mix" if r.get("mixture") else "")
        if r.get("skipped"):
            lines.append(f"{what:<14} {r['order']:<10} left out: {r['skipped']}")
            continue
        again = (f"{r['again_first_batch_s']:.2f} s, {r['again_peak_rss_mb']:.0f} MB"
                 if "again_first_batch_s" in r else "")
        if "verify_s" in r:
            again += f"   {r['verify_s']:.2f} s"
        lines.append(f"{what:<14} {r['order']:<10} {r['first_batch_s']:>9.2f} s {r['feeder_peak_rss_mb']:>7.0f} MB "
                     f"{r['feeder_peak_anon_mb']:>8.0f} MB   {again}")
    o = res.get("orders_tokens_s")
    if o:
        lines.append(f"bench corpus: stateless {o['stateless_tokens_s'] / 1e6:.1f} M tokens/s, torch "
                     f"{o['torch_tokens_s'] / 1e6:.1f} M tokens/s: {o['ratio']:.3f}x")
    return "\n".join(lines)

