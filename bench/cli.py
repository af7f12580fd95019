"""`feeder bench` and `python -m bench`: the bench's command line.

`feeder` does not import this package: it finds `register` through the `feeder.commands`
entry-point group that pyproject.toml declares, so the product package keeps no import of
its benchmark (which drives the client, and so torch). This module imports nothing heavy at
import time: every `feeder` command loads it to list `bench` in its help.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The bench's flags, the same under `feeder bench` and `python -m bench`."""
    s.add_argument("--json", default="", help="write every figure here")
    s.add_argument("--plot", default="", help="draw throughput against ranks and the data-wait share (PNG)")
    s.add_argument("--data", default="bench/data", help="where the corpus, tokenizer and shards are kept")
    s.add_argument("--ranks", type=int, default=8)
    s.add_argument("--seq-len", type=int, default=2048)
    s.add_argument("--micro-batch", type=int, default=8)
    s.add_argument("--seconds", type=float, default=4.0, help="measuring time per figure")
    s.add_argument("--rounds", type=int, default=3,
                   help="rounds of the ceilings and the feeder, interleaved; each figure is their median")
    s.add_argument("--message-bytes", type=int, default=8 << 20,
                   help="the feeders' --message-bytes and the ceilings' message size (256 batches of 8 x 2049)")
    s.add_argument("--kafka", default="127.0.0.1:9092", help="broker for the Kafka figures ('' to skip)")
    s.add_argument("--quick", action="store_true", help="small corpus, short runs (a smoke test)")
    s.add_argument("--only", choices=["formats", "mixture", "scale", "kafka", "packing", "members", "elastic", "gray",
                                           "schedule"],
                   default="",
                   help="formats: only tokens/s from each other tool's format against our shards; mixture: "
                        "only a mixture of 3 sources against one source; scale: first batch and feeder memory "
                        "from 10^6 to 10^10 samples per order, and mixtures of 10^9 and 10^10 positions; kafka: "
                        "only the Kafka figures; packing: tokens/s with boundaries and with best-fit bins against "
                        "plain windows, the boundaries' bytes on the wire, and the packer's time; members: feeder "
                        "CPU per token for 8 members of one rank against 8 ranks, and the bytes each "
                        "context-parallel member gets (docs/model-parallel.md); elastic: a surviving replica's data wait "
                        "around a change of world, against the step time (docs/elastic.md); gray: a rank's data-wait with one "
                        "slow feeder of two, before and after moving and hedging (docs/guarantees.md); schedule: a "
                        "10-segment mixture schedule's first batch against a fixed mixture's at 10^9 positions of 8 "
                        "sources (docs/mixtures.md)")


HELP = "measure the feeder against a raw socket, bare gRPC and a local DataLoader"


def register(sub) -> None:
    """The `feeder.commands` entry point: add `bench` to `feeder`'s subcommands."""
    s = sub.add_parser("bench", help=HELP)
    add_arguments(s)
    s.set_defaults(fn=cmd_bench)


def cmd_bench(args) -> int:
    """Run the bench from parsed arguments, print its table; 0."""
    from feeder.core.errors import FeederError

    try:
        import feeder_client  # noqa: F401  (the ranks' side: torch)
    except ImportError as e:
        raise FeederError(f"the bench drives the client, which needs {e.name}: "
                          "pip install 'token-feeder[bench]'") from None
    from .config import BenchConfig
    from .report import table
    from .run import run

    cfg = BenchConfig(data=args.data, ranks=args.ranks, seq_len=args.seq_len, micro_batch=args.micro_batch,
                      seconds=args.seconds, message_bytes=args.message_bytes, kafka=args.kafka, quick=args.quick,
                      rounds=args.rounds, only=args.only, corpus_bytes=(2 << 20) if args.quick else (12 << 20))
    r = run(cfg, json_path=args.json, plot_path=args.plot)
    if args.only == "scale":
        from .scale import scale_table

        print(scale_table(r))
        return 0
    if args.only == "gray":
        g = r["gray"]
        for name, e in g["runs"].items():
            print(f"{name:8s} data-wait {100 * e['data_wait']:5.1f}% ({100 * e['data_wait_after_5s']:.2f}% after 5 s), "
                  f"left the slow feeder at {e['left_slow_feeder_at_s']} s, hedged bytes {100 * e['hedged_share']:.1f}% "
                  f"of those used")
        print(f"(one feeder of two at {g['slow_link_kb_per_s']} KB/s for a rank taking {g['demand_kb_per_s']} KB/s; "
              f"{g['proxy']})")
        return 0
    if args.only == "schedule":
        from .schedule import schedule_line

        print(schedule_line(r))
        return 0
    if args.only == "elastic":
        for policy, e in r["elastic"]["runs"].items():
            print(f"{policy}: a survivor's data wait {e['steady_wait_s_median'] * 1e3:.1f} ms a step (median), "
                  + ", ".join(f"{w['wait_s'] * 1e3:.0f} ms at step {w['step']} (world {w['world']})"
                              for w in e["after_change"])
                  + f" after a change of world; step {e['step_s'] * 1e3:.0f} ms")
        return 0
    print(table(r))
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bench`: the same command without the `feeder` front end (user mistakes end
    in one line and exit 2, as `feeder`'s do)."""
    from feeder.core.errors import FeederError

    p = argparse.ArgumentParser(prog="python -m bench", description=HELP)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return cmd_bench(args)
    except FeederError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
