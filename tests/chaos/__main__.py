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
    args = p.parse_args(argv)
    if (args.seed is None) == (args.seeds is None):
        p.error("give --seed N or --seeds N")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tests.chaos import FAULT_KINDS, Scenario, run_scenario

    kinds = tuple(args.kinds.split(",")) if args.kinds else None
    if kinds and set(kinds) - set(FAULT_KINDS):
        p.error(f"unknown fault kinds {sorted(set(kinds) - set(FAULT_KINDS))}; known: {', '.join(FAULT_KINDS)}")
    if args.seed is not None:
        seeds = [args.seed]
    else:
        start = args.start if args.start is not None else random.SystemRandom().randrange(1_000_000)
        seeds = list(range(start, start + args.seeds))
    t0 = time.monotonic()
    faults, failures, samples, passed = Counter(), [], 0, 0
    for k, seed in enumerate(seeds, 1):
        sc = Scenario.from_seed(seed, kinds)
        if args.print:
            print(sc.describe())
            continue
        res = run_scenario(sc, keep=args.keep)
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


if __name__ == "__main__":
    sys.exit(main())
