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


PACK_SIZES = (10**7, 10**8, 10**9)   # documents of the packing rows
PACK_SEQ = 4096
PACK_MEDIAN = 600                      # tokens: lognormal lengths (sigma 1: mean ~990), web-like


def megatron_corpus(root: Path, n_docs: int, *, seed: int = 0, median: int = PACK_MEDIAN) -> Path:
    """A Megatron prefix of n_docs documents: a real .idx (lognormal lengths, written in parts:
    10^9 documents are a 20 GB index, never whole in memory) and a sparse .bin of zeros (costs no
    disk). Returns the prefix (PATH.idx + PATH.bin)."""
    import struct

    import numpy as np

    from feeder.sources.formats.megatron import MAGIC

    prefix = root / f"megatron-{n_docs}"
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if idx.exists() and bin_.exists():
        return prefix
    rng = np.random.default_rng(seed)
    part = 1 << 24
    tmp = idx.with_suffix(".idx.tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, 8, n_docs, n_docs + 1))   # version 1, uint16, sequences, documents
        f.truncate(f.tell() + 12 * n_docs + 8 * (n_docs + 1))
        lengths_at, pointers_at = f.tell(), f.tell() + 4 * n_docs
        total = 0
        for a in range(0, n_docs, part):
            n = min(part, n_docs - a)
            lengths = np.maximum(1, rng.lognormal(np.log(median), 1.0, n)).astype("<i4")
            pointers = (np.cumsum(lengths, dtype=np.int64) - lengths + total) * 2
            total += int(lengths.sum(dtype=np.int64))
            f.seek(lengths_at + 4 * a)
            f.write(lengths.tobytes())
            f.seek(pointers_at + 8 * a)
            f.write(pointers.astype("<i8").tobytes())
        docs_at = pointers_at + 8 * n_docs
        for a in range(0, n_docs + 1, part):
            f.seek(docs_at + 8 * a)
            f.write(np.arange(a, min(a + part, n_docs + 1), dtype="<i8").tobytes())
    with open(bin_, "wb") as f:
        f.truncate(total * 2)
    os.rename(tmp, idx)
    return prefix


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
                 extra=(), **stream) -> dict:
    """One fresh feeder process; rank 0 of 8 takes its first batch (`stream`: FeederDataset's
    other arguments: seq_len, micro_batch, packing, boundaries). A torch order's first batch comes
    from its early part (the order store's): the feeder is then kept until the whole is built
    (`order_built_s`, from the same start), so its peak memory and a second process's figures are
    those of a built cache."""
    from feeder_client import FeederDataset

    f = Feeder(source, message_bytes=1 << 20, extra=["--vocab-size", "256", "--eos-id", "0", "--cache-dir",
                                                      str(cache), *extra])
    peak = _Peak(f.proc.pid)
    try:
        ds = FeederDataset([f.address], job="scale", rank=0, world_size=8, **{"seq_len": SEQ, "micro_batch": 8, **stream},
                           permutation=permutation, mixture=mixture, epoch_samples=epoch_samples, retry_for_s=3600,
                           idle_timeout_s=60)
        t0 = time.perf_counter()
        batch = next(iter(ds))
        took = time.perf_counter() - t0
        ds.client.close()
        built, deadline = None, time.monotonic() + 1800
        while list((cache / "orders").glob("randperm-*.lock")) and time.monotonic() < deadline:   # (a build under way)
            time.sleep(0.05)
            built = time.perf_counter() - t0
        out = {"first_batch_s": took, "feeder_peak_rss_mb": peak.hwm_mb(), "feeder_peak_anon_mb": peak.anon_mb,
               "max_id": int(batch.sample_ids.max()), **({} if built is None else {"order_built_s": built})}
    finally:
        peak.stop()
        f.stop()
    return out


def _packed_first_batch(prefix: Path, cache: Path, *, packing: str = "best_fit", boundaries: bool = False,
                        permutation: str = "torch") -> dict:
    """A fresh feeder over a Megatron prefix, seq_len 4096 (best-fit bins: the packing is built
    first, unless the cache holds it; then, with torch's order, the order of the bins: 2.4·10^8
    of them at 10^9 documents)."""
    got = _first_batch(str(prefix), cache, permutation=permutation, seq_len=PACK_SEQ, micro_batch=1, packing=packing,
                       boundaries=boundaries)
    return {k: got[k] for k in ("first_batch_s", "feeder_peak_rss_mb", "feeder_peak_anon_mb", "order_built_s") if k in got}


_BUILD = """
import json, os, resource, sys, time
os.sched_setaffinity(0, range(int(sys.argv[3])))   # this many cores: the build's threads are one per core
from feeder.core.malloc import keep_freed_memory
keep_freed_memory()   # as `feeder serve` does (a block's arrays from the heap, not fresh mmaps)
from feeder.core.config import PackingConfig
from feeder.sources import Context, packed
from feeder.sources.formats import Options, open_any
t0 = time.perf_counter()
t = packed.packed(open_any(sys.argv[1], Options(vocab_size=256, eos_id=0), name="m"), int(sys.argv[4]),
                  Context(sys.argv[2], packing=PackingConfig()))
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"build_s": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": ru.ru_maxrss / 1024}))
"""

# The host's own ceiling for the build's work: the same blocks packed (read from the index and
# packed, nothing written) by one process on one core, then halved between two processes on a core
# each, which share nothing but the machine. What two cores give any build here, to set the
# build's own ratio against (this 2-vCPU machine gave 1.1-1.7x, run to run).
_PACK_ONLY = """
import os, sys, time
os.sched_setaffinity(0, [int(sys.argv[2])])
from feeder.sources.formats import Options, open_any
from feeder.sources.pack_blocks import pack_block
src = open_any(sys.argv[1], Options(vocab_size=256, eos_id=0), name="m")
print("ready", flush=True)
sys.stdin.readline()   # (all started and imported: the clock runs from here)
for b in map(int, sys.argv[4].split(",")):
    pack_block(src, b, int(sys.argv[3]), 1 << 30)
"""


def _build_alone(prefix: Path, cache: Path, cores: int) -> dict:
    """The packing built by a process of its own held to `cores` cores (one thread each)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _BUILD, str(prefix), str(cache), str(cores), str(PACK_SEQ)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _pack_ceiling(prefix: Path) -> float:
    """Seconds for up to 24 blocks packed by one process on core 0 over those for two processes
    on cores 0 and 1, half each, timed from when both are ready (the host's 2-core ratio for the
    packer's work)."""
    import subprocess
    import sys

    from feeder.sources.formats import Options, open_any
    from feeder.sources.pack_blocks import n_blocks

    def run(parts):
        procs = [subprocess.Popen([sys.executable, "-c", _PACK_ONLY, str(prefix), str(core), str(PACK_SEQ),
                                   ",".join(map(str, part))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True) for core, part in parts]
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a packing process failed to start")
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        if any(p.wait() for p in procs):
            raise RuntimeError("a packing process failed")
        return time.perf_counter() - t0

    n_tokens = open_any(str(prefix), Options(vocab_size=256, eos_id=0), name="m").n_tokens
    every = list(range(min(24, n_blocks(n_tokens, 1 << 30))))
    return run([(0, every)]) / run([(0, every[0::2]), (1, every[1::2])])


def pack_figures(cfg: BenchConfig, root: Path | None = None, sizes=None) -> list[dict]:
    """Best-fit packing of Megatron corpora of 10^7, 10^8 (and 10^9: FEEDER_SCALE_PACK_1E9=1, a
    20 GB index and a 13 GB sidecar) documents: a fresh feeder's first batch (the packing built
    on all cores), its build time, peak RSS and padding; the build on 1 and on 2 threads; a
    second feeder on the built cache; `concat` with boundaries at the largest size."""
    import json
    import shutil

    root = Path(root or tempfile.mkdtemp(prefix="feeder-pack-", dir=os.environ.get("FEEDER_SCALE_DIR")))
    if sizes is None:
        sizes = PACK_SIZES[:1] if cfg.quick else \
            PACK_SIZES if os.environ.get("FEEDER_SCALE_PACK_1E9") else PACK_SIZES[:2]
    rows = []
    for n in sizes:
        prefix = megatron_corpus(root, n)
        cache = root / f"cache-{n}"
        say(f"scale: packing {n:.0e} documents (seq_len {PACK_SEQ}): first batch of a fresh feeder")
        row = {"documents": n, **_packed_first_batch(prefix, cache)}
        stats = json.loads(next((cache / "packing").glob("*/stats.json")).read_text())
        row.update(build_s=stats["build_s"], workers=stats["workers"], padding_fraction=stats["padding_fraction"],
                   bins=stats["bins"], blocks=stats["blocks"], cpu_s=stats["read_s"] + stats["cpu_pack_s"])
        say(f"scale: packing {n:.0e} documents: a second feeder on the built cache")
        again = _packed_first_batch(prefix, cache)
        row.update(again_first_batch_s=again["first_batch_s"], again_peak_rss_mb=again["feeder_peak_rss_mb"],
                   again_peak_anon_mb=again["feeder_peak_anon_mb"])
        shutil.rmtree(cache)
        if n <= 10**8 and len(os.sched_getaffinity(0)) >= 2:
            # 1 core, 2 cores, alternated three times (medians): this machine's two cores are shared
            times = {1: [], 2: []}
            ceiling = []
            for _ in range(3):
                for cores in (1, 2):
                    say(f"scale: packing {n:.0e} documents on {cores} core(s), a process of its own")
                    times[cores].append(_build_alone(prefix, root / f"cache-{n}-{cores}", cores)["build_s"])
                    shutil.rmtree(root / f"cache-{n}-{cores}")
                ceiling.append(_pack_ceiling(prefix))
            row.update({f"build_{c}_core_s": statistics.median(t) for c, t in times.items()},
                       build_runs={str(c): t for c, t in times.items()},
                       host_2_core_ratio=statistics.median(ceiling), host_ratio_runs=ceiling)
        rows.append(row)
        if n == sizes[-1]:
            for perm in ("stateless", "torch"):   # (torch's order of 2.4·10^8 windows is built first)
                say(f"scale: concat with boundaries over {n:.0e} documents, {perm} order: first batch, fresh feeder")
                rows.append({"documents": n, "concat_boundaries": True, "order": perm,
                             **_packed_first_batch(prefix, root / "cache-concat", packing="concat", boundaries=True,
                                                   permutation=perm)})
                shutil.rmtree(root / "cache-concat")
        for path in (f"{prefix}.idx", f"{prefix}.bin"):   # (the index is real: 20 GB at 10^9)
            os.unlink(path)
    return rows


def pack_table(rows: list[dict]) -> str:
    lines = ["documents  first batch  build (threads)   per 10^6 docs  1 core    2 cores (ratio; host's)  peak RSS   padding   again"]
    for r in rows:
        if r.get("concat_boundaries"):
            lines.append(f"{r['documents']:.0e}      concat + boundaries, {r['order']} order: first batch "
                         f"{r['first_batch_s']:.2f} s, peak RSS {r['feeder_peak_rss_mb']:.0f} MB, anon "
                         f"{r['feeder_peak_anon_mb']:.0f} MB")
            continue
        per = r["build_s"] / r["documents"] * 1e6
        one = f"{r['build_1_core_s']:.1f} s" if "build_1_core_s" in r else "-"
        two = f"{r['build_2_core_s']:.1f} s" if "build_2_core_s" in r else "-"
        if "build_1_core_s" in r:
            two += f" ({r['build_1_core_s'] / r['build_2_core_s']:.2f}x; host {r['host_2_core_ratio']:.2f}x)"
        lines.append(f"{r['documents']:.0e}   {r['first_batch_s']:>9.1f} s  {r['build_s']:>6.1f} s ({r['workers']})"
                     f"  {per:>10.2f} s  {one:>8}  {two:>9}  {r['feeder_peak_rss_mb']:>5.0f} MB"
                     f" ({r['feeder_peak_anon_mb']:.0f} anon)"
                     f"  {100 * r['padding_fraction']:.4f}%  {r['again_first_batch_s']:.2f} s")
    return "\n".join(lines)
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
    return {"scale": rows, "orders_tokens_s": _orders_tokens_s(cfg), "packing_scale": pack_figures(cfg, root)}


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
    if res.get("packing_scale"):
        lines.append(pack_table(res["packing_scale"]))
    o = res.get("orders_tokens_s")
    if o:
        lines.append(f"bench corpus: stateless {o['stateless_tokens_s'] / 1e6:.1f} M tokens/s, torch "
                     f"{o['torch_tokens_s'] / 1e6:.1f} M tokens/s: {o['ratio']:.3f}x")
    return "\n".join(lines)

