"""Live elasticity (issue 43): what a change of world costs a surviving replica.

Four replicas (threads of this process, each an ElasticFeeder as a trainer process would hold)
train in lockstep: each step, every replica takes its part, then "computes" for `step_ms`, then
waits at a barrier (the all-reduce). At step 20 a replica dies inside the step (its attempt does
not commit, and the step is dealt again over three); at step 40 a new replica joins with no
state. The figure is the survivors' (not the newcomer's) longest data wait per step: in the steady state, and in the
attempts right after each change, against the step time. The target is a wait of at most one
step time around a change (a survivor never restarts).
"""
from __future__ import annotations

import statistics
import threading
import time

from .clients import Feeder
from .config import BenchConfig, say

W0, ACC, STEPS = 4, 2, 60
STEP_MS = 200


def _run(address: str, cfg: BenchConfig, policy: str) -> dict:
    from feeder_client.elastic import ElasticFeeder

    job = f"bench-elastic-{policy}-{time.monotonic_ns()}"   # (one job for every replica of the run)

    def make() -> ElasticFeeder:
        return ElasticFeeder([address], job=job, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch,
                             accumulation=ACC, replicas=W0, global_batch=policy, num_epochs=0)

    live = [make() for _ in range(W0)]
    waits: list[dict] = []   # per attempt: step, world, change, each survivor's wait
    step, attempt = 0, 0
    try:
        while step < STEPS:
            change = ""
            dying = None
            if step == 20 and len(live) == W0 and not any(w["change"] == "death" for w in waits):
                dying, change = live[-1], "death"
            joined = None
            if step == 40 and len(live) == W0 - 1:
                joined = make()
                live.append(joined)
                change = "join"
            world = len(live)
            got: dict[int, float] = {}
            barrier = threading.Barrier(world)

            def work(r: int, f) -> None:
                t0 = time.perf_counter()
                f.step(step, r, world)
                got[r] = time.perf_counter() - t0
                time.sleep(STEP_MS / 1000)
                barrier.wait()

            threads = [threading.Thread(target=work, args=(r, f)) for r, f in enumerate(live)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            survivors = [got[r] for r, f in enumerate(live) if f is not dying and f is not joined]
            waits.append({"attempt": attempt, "step": step, "world": world, "change": change,
                          "wait_s": max(survivors), "committed": dying is None})
            if dying is not None:   # dead before the all-reduce: the attempt fails for everyone
                live.remove(dying)
                dying.close()
                for f in live:
                    f.commit(step, False)
                waits.append({"attempt": attempt, "step": step, "world": world - 1, "change": "after death",
                              "wait_s": None, "committed": False})
            else:
                for f in live:
                    f.commit(step, True)
                step += 1
            attempt += 1
    finally:
        for f in live:
            f.close()
    return _summary(waits, policy)


def _summary(waits: list[dict], policy: str) -> dict:
    measured = [w for w in waits if w["wait_s"] is not None]
    # The attempt after a change is the one whose world is new to the survivors' streams.
    after = []
    for i, w in enumerate(measured):
        if i and measured[i - 1]["world"] != w["world"]:
            after.append(w)
    steady = [w["wait_s"] for w in measured[5:] if w not in after and not w["change"]]
    out = {"policy": policy, "step_s": STEP_MS / 1000, "steady_wait_s_median": statistics.median(steady),
           "steady_wait_s_max": max(steady),
           "after_change": [{"step": w["step"], "world": w["world"], "wait_s": round(w["wait_s"], 4)} for w in after],
           "worst_after_change_in_steps": max(w["wait_s"] for w in after) / (STEP_MS / 1000)}
    changes = ", ".join(f"{w['wait_s'] * 1e3:.0f} ms" for w in out["after_change"])
    say(f"elastic ({policy}): steady wait {out['steady_wait_s_median'] * 1e3:.1f} ms (median), after a change of world "
        f"{changes} (step {STEP_MS} ms)")
    return out


def elastic_figures(cfg: BenchConfig, data: dict) -> dict:
    feeder = Feeder(data["shards"], message_bytes=cfg.message_bytes)
    try:
        runs = {policy: _run(feeder.address, cfg, policy) for policy in ("constant", "shrink")}
    finally:
        feeder.stop()
    return {"elastic": {"replicas": W0, "accumulation": ACC, "micro_batch": cfg.micro_batch, "seq_len": cfg.seq_len,
                        "steps": STEPS, "step_ms": STEP_MS, "runs": runs,
                        "target": "a survivor's wait after a change of world <= one step time"}}
