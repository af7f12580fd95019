"""Slow, not dead (issue 45): what one slow feeder of two costs a rank, before and after.

Two `feeder serve` processes on the same data, each behind a proxy (Toxiproxy when `make
toxiproxy` built it, else bench/wanproxy.py's user-space one); the first listed, where the rank
starts, carries a quarter of what the rank consumes (a bandwidth toxic). The rank takes one
micro_batch x seq_len batch every STEP_MS and "trains" in between. Four runs of `SECONDS`:

  * healthy: no toxic (the floor);
  * before: the client as it was (slow_wait=0: it moves on errors and silence, not slowness);
  * move: the default client (moves off the slow feeder, probes it again later);
  * hedge: hedge=True as well (a side stream on the other feeder while the read-ahead is low).

Figures: the loop's data-wait over the whole run and after the first 5 s, when the rank left
the slow feeder, and the bytes of hedged copies received against the bytes the loop used.
"""
from __future__ import annotations

import time

from .clients import Feeder
from .config import BenchConfig, say

STEP_MS = 20
SECONDS = 20.0
SETTLED_S = 5.0


def _run(links: list[str], cfg: BenchConfig, name: str, **kw) -> dict:
    from feeder_client import FeederDataset

    ds = FeederDataset({"a": links[0], "b": links[1]}, job=f"bench-gray-{name}-{time.monotonic_ns()}", rank=0,
                       world_size=1, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch, num_epochs=0, prefer="order",
                       compression="none", **kw)
    log = []   # (seconds since start, wait, region)
    t0 = time.monotonic()
    it = iter(ds)
    try:
        while time.monotonic() - t0 < SECONDS:
            a = time.monotonic()
            b = next(it)
            now = time.monotonic()
            log.append((now - t0, now - a, b.region, b.tokens.numel() * b.tokens.element_size()))
            time.sleep(STEP_MS / 1000)
        client = ds.client
        hedged, used = client.gray.hedged_bytes, sum(r[3] for r in log)
        moves = {"moves": client.policy.moves, "failovers": client.failovers, "failbacks": client.failbacks}
    finally:
        it.close()

    def wait(since: float) -> float:
        rows = [r for r in log[1:] if r[0] >= since]   # (after the first batch)
        if not rows:
            return 1.0
        # (the window's first wait began before it: at most the whole window waited)
        return min(1.0, sum(r[1] for r in rows) / max(1e-9, rows[-1][0] - rows[0][0] + STEP_MS / 1000))

    left = next((r[0] for r in log if r[2] == "b"), None)
    out = {"data_wait": round(wait(0.0), 4), "data_wait_after_5s": round(wait(SETTLED_S), 4),
           "left_slow_feeder_at_s": round(left, 2) if left is not None else None, "batches": len(log),
           "hedged_bytes": hedged, "used_bytes": used, "hedged_share": round(hedged / max(1, used), 4), **moves}
    say(f"gray ({name}): data-wait {100 * out['data_wait']:.1f}% ({100 * out['data_wait_after_5s']:.2f}% after "
        f"{SETTLED_S:.0f} s), left the slow feeder at {out['left_slow_feeder_at_s']} s, hedged bytes "
        f"{100 * out['hedged_share']:.1f}% of those used")
    return out


def gray_figures(cfg: BenchConfig, data: dict) -> dict:
    from .wanproxy import start_proxies

    feeders = [Feeder(data["shards"], message_bytes=cfg.message_bytes, extra=["--region", r]) for r in ("a", "b")]
    proxies = start_proxies()
    try:
        links = [proxies.proxy(f.address) for f in feeders]
        batch_bytes = cfg.micro_batch * (cfg.seq_len + 1) * 2   # (uint16 tokens of the bench corpus)
        quarter_kb = int(batch_bytes / (STEP_MS / 1000) / 4 / 1024)
        runs = {"healthy": _run([k.listen for k in links], cfg, "healthy")}
        for name, kw in (("before", {"slow_wait": 0.0}), ("move", {}), ("hedge", {"hedge": True})):
            links[0].bandwidth(quarter_kb)
            runs[name] = _run([k.listen for k in links], cfg, name, **kw)
            links[0].clear()
    finally:
        proxies.close()
        for f in feeders:
            f.stop()
    return {"gray": {"proxy": proxies.kind, "step_ms": STEP_MS, "seconds": SECONDS, "seq_len": cfg.seq_len,
                     "micro_batch": cfg.micro_batch, "slow_link_kb_per_s": quarter_kb,
                     "demand_kb_per_s": int(batch_bytes / (STEP_MS / 1000) / 1024), "runs": runs}}
