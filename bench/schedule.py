"""`feeder bench --only schedule` (issue 46): a scheduled mixture's first batch against a fixed
mixture's, at 10^9 positions of 8 sources, and how fast a schedule's blending is computed.

Each source is a sparse nanoGPT .bin of zeros (bench/scale.py's: they cost no disk), seq_len 16,
the stateless order (torch's at 10^9 is an 8 GB build of its own, measured by --only scale). Each
first batch is one fresh `feeder serve` with an empty cache directory and rank 0 of 8 asking; the
fixed mixture and the 10-segment schedule are measured one after the other in this run."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from .config import BenchConfig, say
from .scale import _corpus, _first_batch

N = 10**9
SIZES = (3 * 10**8, 2 * 10**8, 10**8, 10**8, 10**8, 10**8, 5 * 10**7, 5 * 10**7)


def ten_segments(names) -> dict:
    """10 segments over [0, N): constant and linear by turns, the weight moving between sources."""
    segs, k = [], len(names)
    for j in range(10):
        w = {n: 1 + ((d + j) % k) for d, n in enumerate(names)}
        seg = {"weights": w}
        if j < 9:
            seg["until"] = (j + 1) * N // 10
            if j % 2:
                seg["to"] = {n: 1 + ((d + j + 1) % k) for d, n in enumerate(names)}
        segs.append(seg)
    return {"segment": segs}


def schedule_figures(cfg: BenchConfig, root: Path | None = None) -> dict:
    root = Path(root or tempfile.mkdtemp(prefix="feeder-schedule-"))
    names = [f"s{d}" for d in range(len(SIZES))]
    paths = [_corpus(root, n) for n in SIZES]
    extra = [x for name, p in zip(names[1:], paths[1:]) for x in ("--source", f"{name}={p}")]
    first = f"{names[0]}={paths[0]}"
    weights = {n: 1 + d for d, n in enumerate(names)}
    rows = {}
    for what, kw in (("fixed", {"mixture": weights}), ("scheduled", {"mixture_schedule": ten_segments(names)})):
        say(f"schedule: {what} mixture of {len(names)} sources over {N:.0e} positions: first batch, fresh process")
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
        mixture = kw.pop("mixture", None)
        rows[what] = _first_batch(first, cache, permutation="stateless", mixture=mixture, epoch_samples=N,
                                  extra=extra, **kw)
    # the blending's own speed: a pass over 10^8 slots of the 10-segment schedule (what a resume
    # far into a job waits for once per schedule, in the background, before its first batch)
    from feeder.core import schedule as sc

    b = sc.Blending(sc.parse(ten_segments(names)))
    t0 = time.perf_counter()
    b._grow(10**8)
    scan = time.perf_counter() - t0
    return {"schedule": {"positions": N, "sources": len(names), "segments": 10, **rows,
                         "difference_s": rows["scheduled"]["first_batch_s"] - rows["fixed"]["first_batch_s"],
                         "blend_ns_per_slot": scan / 10**8 * 1e9}}


def schedule_line(r: dict) -> str:
    s = r["schedule"]
    return (f"{s['positions']:.0e} positions, {s['sources']} sources: first batch fixed "
            f"{s['fixed']['first_batch_s']:.2f} s ({s['fixed']['feeder_peak_rss_mb']:.0f} MB), scheduled "
            f"({s['segments']} segments) {s['scheduled']['first_batch_s']:.2f} s "
            f"({s['scheduled']['feeder_peak_rss_mb']:.0f} MB): {s['difference_s']:+.2f} s; the schedule's blending "
            f"{s['blend_ns_per_slot']:.1f} ns a slot")
