"""python -m tests.chaos --seed N            replay one scenario (exit 1 if it fails)
python -m tests.chaos --seeds N [--start S] [--json OUT]   run N scenarios, write a summary"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, help="replay this one scenario")
    p.add_argument("--seeds", type=int, help="run this many scenarios")
    p.add_argument("--start", type=int, help="first seed of --seeds (default: random)")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--kinds", help="only these fault kinds (comma-separated)")
    p.add_argument("--keep", action="store_true", help="keep every scenario's work directory")
    p.add_argument("--print", action="store_true", help="print the scenario(s) and run nothing")
    p.add_argument("--model-parallel", action="store_true",
                   help="only scenarios whose ranks have members (issue 33): --seeds N of them from --start on")
    p.add_argument("--elastic", action="store_true",
                   help="live-elasticity scenarios (issue 43; tests/chaos/elastic.py): replica churn, joins and "
                        "leaves, steps that do not commit, feeder faults")
    p.add_argument("--seed-list", help=argparse.SUPPRESS)   # (a slice of a parallel run)
    p.add_argument("--jobs", type=int, default=1,
                   help="run the seeds in this many processes at once (a scenario spends most of its time "
                        "waiting on slow links and timers, not on the cores)")
    args = p.parse_args(argv)
    if (args.seed is None) == (args.seeds is None) and not args.seed_list:
        p.error("give --seed N or --seeds N")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tests.chaos import FAULT_KINDS, Scenario, run_scenario

    kinds = tuple(args.kinds.split(",")) if args.kinds else None
    if kinds and set(kinds) - set(FAULT_KINDS):
        p.error(f"unknown fault kinds {sorted(set(kinds) - set(FAULT_KINDS))}; known: {', '.join(FAULT_KINDS)}")
    if args.seed_list:
        seeds = [int(x) for x in args.seed_list.split(",")]
    elif args.seed is not None:
        seeds = [args.seed]
    else:
        start = args.start if args.start is not None else random.SystemRandom().randrange(1_000_000)
        if args.model_parallel:
            seeds, s = [], start
            while len(seeds) < args.seeds:
                if Scenario.from_seed(s, kinds).members > 1:
                    seeds.append(s)
                s += 1
        else:
            seeds = list(range(start, start + args.seeds))
    if args.jobs > 1 and len(seeds) > 1 and not args.print:
        return _parallel(args, seeds)
    t0 = time.monotonic()
    faults, failures, samples, passed = Counter(), [], 0, 0
    if args.elastic:
        from tests.chaos.elastic import ElasticScenario, run_elastic
    for k, seed in enumerate(seeds, 1):
        sc = ElasticScenario.from_seed(seed) if args.elastic else Scenario.from_seed(seed, kinds)
        if args.print:
            print(sc.describe())
            continue
        res = run_elastic(sc, keep=args.keep) if args.elastic else run_scenario(sc, keep=args.keep)
        faults.update(res.faults)
        samples += res.samples
        if res.ok:
            passed += 1
        else:
            failures.append({"seed": seed, "scenario": sc.describe(), "first_error": res.errors[0],
                             "errors": res.errors[:5], "workdir": res.workdir})
        print(f"[{k}/{len(seeds)}] {'ok  ' if res.ok else 'FAIL'} {res.wall_s:5.1f}s "
              f"{dict(res.faults) or '{}'} {sc.describe()}", file=sys.stderr, flush=True)
        if not res.ok:
            print(f"    first error: {res.errors[0]}\n    replay: python -m tests.chaos --seed {seed}"
                  f"{' --kinds ' + args.kinds if args.kinds else ''}   (work dir {res.workdir})",
                  file=sys.stderr, flush=True)
    if args.print:
        return 0
    summary = {"scenarios": len(seeds), "passed": passed, "failed": len(failures), "start": seeds[0],
               "faults_injected": dict(sorted(faults.items())), "samples_checked": samples,
               "wall_s": round(time.monotonic() - t0, 1), "failures": failures}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}), file=sys.stderr)
    return 1 if failures else 0


def _parallel(args, seeds: list[int]) -> int:
    """Contiguous slices of the seeds, each in a `python -m tests.chaos` of its own (each has
    its own proxy server and ports), and one summary of theirs."""
    import subprocess
    import tempfile

    t0 = time.monotonic()
    k = min(args.jobs, len(seeds))
    size = -(-len(seeds) // k)
    parts, procs = [], []
    tmp = Path(tempfile.mkdtemp(prefix="chaos-jobs-"))
    for j in range(k):
        chunk = seeds[j * size:(j + 1) * size]
        if not chunk:
            continue
        out = tmp / f"part{j}.json"
        cmd = [sys.executable, "-m", "tests.chaos", "--seed-list", ",".join(map(str, chunk)), "--json", str(out)] + (["--kinds", args.kinds] if args.kinds else []) + (["--keep"] if args.keep else []) + (["--elastic"] if args.elastic else [])
        procs.append(subprocess.Popen(cmd))
        parts.append(out)
    for proc in procs:
        proc.wait()
    faults, failures, samples, passed = Counter(), [], 0, 0
    for out in parts:
        if not out.exists():   # a slice that died before its summary: its seeds count as failed
            failures.append({"seed": None, "scenario": str(out), "first_error": "the slice wrote no summary"})
            continue
        part = json.loads(out.read_text())
        faults.update(part["faults_injected"])
        failures += part["failures"]
        samples += part["samples_checked"]
        passed += part["passed"]
    summary = {"scenarios": len(seeds), "passed": passed, "failed": len(seeds) - passed, "start": seeds[0],
               "jobs": k, "faults_injected": dict(sorted(faults.items())), "samples_checked": samples,
               "wall_s": round(time.monotonic() - t0, 1), "failures": failures}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}), file=sys.stderr)
    return 1 if failures or passed != len(seeds) else 0


if __name__ == "__main__":
    sys.exit(main())
