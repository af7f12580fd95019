"""Document-aware samples (issue 27): what boundaries cost and what packing costs.

* tokens/s of the same ranks over the bench's shards with plain concat windows, with
  boundaries (the feeder finds the document starts of every sample and sends them; the client
  makes position_ids and cu_seqlens of them), and with best-fit bins (boundaries included), in
  interleaved rounds, medians; the target is <= 3 % fewer tokens/s with boundaries;
* the boundaries' share of the bytes on the wire (their per-batch entries against the tokens);
* the packer: the bench corpus's padding and packing time, and 10^7 documents of web-like
  (log-normal) lengths packed into bins of seq_len + 1.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from .clients import Clients, Feeder
from .config import BenchConfig, say

MODES = {"concat": dict(), "boundaries": dict(boundaries=True), "best_fit": dict(packing="best_fit")}


def packing_figures(cfg: BenchConfig, data: dict, clients: Clients) -> dict:
    from feeder.core import layout
    from feeder.sources.posix import PosixSource

    feeder = Feeder(data["shards"], message_bytes=cfg.message_bytes)
    runs: dict[str, list[float]] = {k: [] for k in MODES}
    try:
        for i in range(cfg.rounds):
            say(f"packing, round {i + 1} of {cfg.rounds}: {', '.join(MODES)} ({cfg.ranks} ranks, compression off)")
            for name, kw in MODES.items():
                got = clients.run([feeder.address], f"pack-{name}-{i}", cfg.ranks, seq_len=cfg.seq_len,
                                  mb=cfg.micro_batch, seconds=cfg.seconds, **kw)
                if got["errors"]:
                    raise RuntimeError(f"{name}: {got['errors'][:2]}")
                runs[name].append(got["tokens_s"])
    finally:
        feeder.stop()
    med = {k: statistics.median(v) for k, v in runs.items()}
    src = PosixSource(data["shards"])
    rng = np.random.default_rng(0)
    n = 1 + (src.n_tokens - cfg.seq_len - 2) // cfg.seq_len
    rows = np.sort(rng.choice(n, size=min(n, 4096), replace=False)) * cfg.seq_len
    b = src.boundaries(rows, cfg.seq_len + 1)
    wire = len(b.to_bytes()) + 2 * (len(rows) // cfg.micro_batch)         # + each batch entry's key and length
    token_bytes = len(rows) * (cfg.seq_len + 1) * src.dtype.itemsize
    t0 = time.perf_counter()
    starts = src.all_doc_starts()
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = layout.best_fit(starts, src.n_tokens, cfg.seq_len + 1)
    corpus_s = time.perf_counter() - t0
    lengths = np.maximum(1, rng.lognormal(6, 1.2, size=10_000_000)).astype(np.int64)   # web-like: mean ~800
    web_starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    total = int(lengths.sum())
    t0 = time.perf_counter()
    web = layout.best_fit(web_starts, total, cfg.seq_len + 1)
    web_s = time.perf_counter() - t0
    return {"packing": {
        "tokens_s": med, "rounds": runs,
        "boundaries_ratio": med["boundaries"] / med["concat"], "best_fit_ratio": med["best_fit"] / med["concat"],
        "boundaries_wire_share": wire / token_bytes,
        "corpus": {"documents": int(len(starts)), "bins": p.n_bins, "read_doc_starts_s": read_s, "pack_s": corpus_s,
                   "padding_fraction": 1 - src.n_tokens / (p.n_bins * (cfg.seq_len + 1)),
                   "truncated": int(np.count_nonzero(np.diff(np.append(starts, src.n_tokens)) > cfg.seq_len + 1))},
        "web_10M": {"documents": len(lengths), "bins": web.n_bins, "pack_s": web_s,
                    "padding_fraction": 1 - total / (web.n_bins * (cfg.seq_len + 1))}}}
