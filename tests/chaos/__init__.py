"""The fault-combination harness (issue 16): seeded scenarios (scenario.py) run against real
feeder and rank processes (runner.py, rank.py) and judged by an independent oracle
(oracle.py). `python -m tests.chaos --seed N` replays one; `--seeds N` runs many."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from tests.chaos.scenario import FAULT_KINDS, Fault, Scenario

__all__ = ["FAULT_KINDS", "Fault", "Scenario", "run_scenario"]


_CACHE: Path | None = None


def _cache() -> Path:
    """This process's prepped corpora (one per size), made on first use."""
    global _CACHE
    if _CACHE is None:
        import atexit

        _CACHE = Path(tempfile.mkdtemp(prefix="chaos-corpora-"))
        atexit.register(shutil.rmtree, _CACHE, True)   # tens of MB with the large corpus
    return _CACHE


def run_scenario(sc: Scenario, workdir: Path | None = None, cache: Path | None = None, keep: bool = False):
    """Run one scenario; returns runner.Result. The work directory (rank outputs, feeder logs,
    ledgers) is removed when the scenario passes unless `keep`."""
    from tests.chaos.oracle import Oracle
    from tests.chaos.runner import Result, ScenarioRun

    t0 = time.monotonic()
    cache = cache or _cache()
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{sc.seed}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = ScenarioRun(sc, workdir, cache)
    oracle = Oracle(run)
    try:
        errors = run.run()
        errors = errors + oracle.check()
    except Exception as e:  # noqa: BLE001 - the harness's own failure is a failed scenario, named
        import traceback

        errors = [f"harness error: {type(e).__name__}: {e}"]
        (workdir / "harness-error.txt").write_text(traceback.format_exc())
    res = Result(scenario=sc, ok=not errors, errors=errors, faults=run.injected, samples=oracle.samples,
                 wall_s=time.monotonic() - t0, workdir=str(workdir))
    if res.ok and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return res
