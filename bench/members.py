"""Model parallelism (issue 33): what members and context-parallel slices cost the feeder.

* feeder CPU per delivered token for 8 members of one data-parallel rank against 8 independent
  ranks (the same clients, zstd): members share one read, locate, compression and cursor signing
  per message (the target is <= 0.6x); interleaved rounds, medians;
* bytes on the wire per context-parallel member for C = 1, 2, 4 (zigzag and contiguous), from the
  feeder's own count of what it sent (compression off, so the figure is the tokens' share; the
  target is <= 1.05 / C of C = 1).
"""
from __future__ import annotations

import statistics

from .clients import Clients, Feeder
from .config import BenchConfig, say

K = 8   # members of the rank, or independent ranks


def members_figures(cfg: BenchConfig, data: dict, clients: Clients) -> dict:
    feeder = Feeder(data["shards"], message_bytes=cfg.message_bytes)
    runs: dict[str, list[dict]] = {"members": [], "ranks": []}
    try:
        for i in range(cfg.rounds):
            say(f"members, round {i + 1} of {cfg.rounds}: {K} members of one rank, then {K} ranks (zstd)")
            for mode in ("members", "ranks"):
                cpu0 = feeder.cpu_s()
                got = clients.run([feeder.address], f"mp-{mode}-{i}", K, seq_len=cfg.seq_len, mb=cfg.micro_batch,
                                  compression="zstd", seconds=cfg.seconds, members=K if mode == "members" else 0)
                cpu = feeder.cpu_s() - cpu0
                if got["errors"]:
                    raise RuntimeError(f"{mode}: {got['errors'][:2]}")
                # per token delivered over the whole run (warm-up included, as the CPU is)
                total = got["tokens"] * (cfg.seconds + 1.0) / cfg.seconds
                runs[mode].append({"feeder_cpu_s": cpu, "tokens_s": got["tokens_s"],
                                   "feeder_cpu_s_per_mtok": cpu / (total / 1e6) if total else None})
        med = {m: statistics.median(r["feeder_cpu_s_per_mtok"] for r in v) for m, v in runs.items()}
        wire = _wire(cfg, feeder)
    finally:
        feeder.stop()
    out = {"members": K, "runs": runs, "feeder_cpu_s_per_mtok": med,
           "members_vs_ranks": med["members"] / med["ranks"], "target_members_vs_ranks": 0.6, "wire": wire}
    say(f"members: feeder CPU per token {med['members']:.3f} vs {med['ranks']:.3f} s/Mtok "
        f"({out['members_vs_ranks']:.2f}x); wire per CP member {wire}")
    return out


def _wire(cfg: BenchConfig, feeder: Feeder, batches: int = 64) -> dict:
    """Bytes the feeder sent per batch to context-parallel rank 0 of C, uncompressed, and the
    ratio to C = 1's."""
    from feeder_client import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec

    out = {}
    for size, layout in ((1, "zigzag"), (2, "zigzag"), (4, "zigzag"), (2, "contiguous"), (4, "contiguous")):
        job = f"cp-{size}-{layout}"
        spec = StreamSpec(job=job, rank=0, world_size=1, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch,
                          num_epochs=0, compression="none", cp_size=size, cp_rank=0, cp_layout=layout)
        cli = FeederClient(ClientConfig(targets=(feeder.address,), spec=spec, read_ahead=1))
        for _ in range(batches):
            next(cli)
        r = next(j for j in feeder.status().jobs if j.job == job).ranks[0]
        cli.close()
        out[f"C={size} {layout}"] = r.bytes_sent / r.batches_sent
    base = out["C=1 zigzag"]
    return {k: {"bytes_per_batch": round(v), "of_C1": round(v / base, 4),
                "target": round(1.05 / int(k.split()[0][2:]), 4)} for k, v in out.items()}
