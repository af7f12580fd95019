"""`feeder prep | serve | status`: the command line. User mistakes end in one clear line
(exit 2), never a traceback."""
from __future__ import annotations

import argparse
import os
import sys

from feeder.errors import FeederError

EXIT_USER = 2


def _secret(args) -> bytes:
    if getattr(args, "cursor_secret_file", None):
        with open(args.cursor_secret_file, "rb") as f:
            return f.read().strip()
    return os.environ.get("FEEDER_CURSOR_SECRET", "").encode()


def cmd_prep(args) -> int:
    from feeder.config import PrepConfig
    from feeder.prep import prep

    cfg = PrepConfig(inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer, eos_token=args.eos_token,
                     shard_tokens=args.shard_tokens, chunk_tokens=args.chunk_tokens, workers=args.workers,
                     progress=not args.quiet)
    m = prep(cfg, force=args.force)
    print(f"wrote {len(m.shards)} shard(s), {m.n_documents:,} documents, {m.n_tokens:,} tokens to {args.out} "
          f"(vocab {m.vocab_size}, {m.dtype}, fingerprint {m.fingerprint[:16]})")
    return 0


def cmd_publish(args) -> int:
    from feeder.config import PublishConfig
    from feeder.publish import publish

    cfg = PublishConfig(inputs=tuple(args.inputs), to=args.to, partitions=args.partitions, tokenizer=args.tokenizer,
                        eos_token=args.eos_token, key=args.key, workers=args.workers, progress=not args.quiet)
    r = publish(cfg)
    print(f"published {r['records']:,} records to {r['topic']} ({r['partitions']} partitions, vocab "
          f"{r['vocab_size']}, eos {r['eos_id']})")
    return 0


def cmd_bench(args) -> int:
    from feeder.bench import BenchConfig, run, table

    cfg = BenchConfig(data=args.data, ranks=args.ranks, seq_len=args.seq_len, micro_batch=args.micro_batch,
                      seconds=args.seconds, message_bytes=args.message_bytes, kafka=args.kafka, quick=args.quick,
                      corpus_bytes=(2 << 20) if args.quick else (12 << 20))
    r = run(cfg, json_path=args.json, plot_path=args.plot)
    print(table(r))
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def serve_config(args):
    from feeder.config import ServeConfig

    return ServeConfig(source=args.source, listen=args.listen, region=args.region,
                       prefetch_messages=args.prefetch_messages, prefetch_bytes=args.prefetch_bytes,
                       message_bytes=args.message_bytes, default_compression=args.compression,
                       default_level=args.compression_level, threads=args.threads, cursor_secret=_secret(args),
                       grace_s=args.grace, vocab_size=args.vocab_size, eos_id=args.eos_id,
                       log_format=args.log_format, ledger=args.ledger,
                       metrics_listen=f"{args.metrics_host or args.listen.rpartition(':')[0]}:{args.metrics_port}"
                       if args.metrics_port is not None else "")


def cmd_serve(args) -> int:
    from feeder import logs
    from feeder.service.server import new_loop, serve_forever

    cfg = serve_config(args)
    logs.setup(cfg.log_format)

    def ready(server):
        print(f"feeder region={cfg.region} listening on {server.address}", flush=True)
        if server.metrics_address:
            print(f"metrics on {server.metrics_address}", flush=True)

    loop = new_loop()
    try:
        loop.run_until_complete(serve_forever(cfg, ready))
    finally:
        loop.close()
    return 0


def cmd_status(args) -> int:
    from feeder.status import show

    return show(args.target, job=args.job, watch=args.watch, interval=args.interval)


def cmd_audit(args) -> int:
    import json

    from feeder.audit import audit

    results = audit(args.ledgers, job=args.job)
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        head = f"job {r['job']} epoch {r['epoch']}: {r['samples']} samples in {r['batches']} batches"
        if r["exactly_once"]:
            print(f"{head}: every sample delivered exactly once ({r['resent_batches']} batches resent after "
                  f"failover counted once; {r['n_duplicate_deliveries']} repeats are DistributedSampler padding)")
        else:
            print(f"{head}: NOT exactly once: {r['n_missing']} missing {r['missing'][:20]}, "
                  f"{r['n_duplicate_deliveries']} duplicate deliveries {r['duplicates'][:20]} "
                  f"(padding allows {r['padding_allowed']}), {len(r['conflicts'])} conflicting batches")
    if not results:
        print("no batches in the ledger" + (f" for job {args.job!r}" if args.job else ""))
        return 1
    return 0 if all(r["exactly_once"] for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="feeder", description="Token feeder: prepare datasets and serve token "
                                "batches to training ranks over gRPC.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prep", help="tokenize documents into Arrow IPC shards + manifest.json")
    s.add_argument("inputs", nargs="+", help=".jsonl (field text), .txt (one document), .parquet (column text), "
                   ".tfrecord (int64 input_ids)")
    s.add_argument("--out", required=True, help="output directory (a Lustre path in production)")
    s.add_argument("--tokenizer", default="byte", help="'byte' or a path to a Hugging Face tokenizer.json")
    s.add_argument("--eos-token", default="", help="end-of-document token of a tokenizer.json")
    s.add_argument("--shard-tokens", type=int, default=64 << 20, help="tokens per shard file")
    s.add_argument("--chunk-tokens", type=int, default=1 << 20, help="tokens per record batch (checksum unit)")
    s.add_argument("--workers", type=int, default=0, help="tokenizer processes (0: one per core)")
    s.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    s.add_argument("--quiet", action="store_true", help="no progress output")
    s.set_defaults(fn=cmd_prep)

    s = sub.add_parser("publish", help="tokenize documents into a Kafka topic, one record per document")
    s.add_argument("inputs", nargs="+", help="same inputs as prep: .jsonl, .txt, .parquet, .tfrecord")
    s.add_argument("--to", required=True, help="kafka://HOST:PORT/TOPIC (the topic is created when missing)")
    s.add_argument("--partitions", type=int, default=0, help="partitions of a new topic (default 3)")
    s.add_argument("--tokenizer", default="byte", help="'byte' or a path to a Hugging Face tokenizer.json")
    s.add_argument("--eos-token", default="", help="end-of-document token of a tokenizer.json")
    s.add_argument("--key", default="", choices=["", "index"],
                   help="'index': key records by document index (the broker partitions by key); "
                        "default: document i -> partition i mod P")
    s.add_argument("--workers", type=int, default=0, help="tokenizer processes (0: one per core)")
    s.add_argument("--quiet", action="store_true", help="no progress output")
    s.set_defaults(fn=cmd_publish)

    s = sub.add_parser("serve", help="serve a dataset to training ranks")
    s.add_argument("--source", required=True, help="dataset directory (manifest.json, or Parquet token files), "
                   "or kafka://HOST:PORT/TOPIC[?mode=bounded|follow&bad_records=fail|skip&...]")
    s.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT (port 0: any free port)")
    s.add_argument("--region", default="local")
    s.add_argument("--prefetch-messages", type=int, default=8, help="messages queued ahead per stream")
    s.add_argument("--prefetch-bytes", type=int, default=32 << 20, help="bytes queued ahead per stream")
    s.add_argument("--message-bytes", type=int, default=1 << 20, help="target size of one stream message")
    s.add_argument("--compression", default="zstd", choices=["zstd", "none"], help="default for streams")
    s.add_argument("--compression-level", type=int, default=3)
    s.add_argument("--threads", type=int, default=4, help="batch-building threads")
    s.add_argument("--cursor-secret-file", help="file with the deployment's cursor secret "
                   "(or env FEEDER_CURSOR_SECRET); all feeders of a deployment share it")
    s.add_argument("--grace", type=float, default=10.0, help="seconds to drain streams on SIGTERM")
    s.add_argument("--vocab-size", type=int, default=0, help="Parquet token datasets without manifest.json")
    s.add_argument("--eos-id", type=int, default=-1, help="Parquet token datasets without manifest.json")
    s.add_argument("--log-format", default="text", choices=["text", "json"])
    s.add_argument("--ledger", default="", help="append one JSON line per delivered batch (for `feeder audit`)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: any free port; printed at start)")
    s.add_argument("--metrics-host", default="", help="address for /metrics (default: the --listen host)")
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("bench", help="measure the feeder against a raw socket, bare gRPC and a local DataLoader")
    s.add_argument("--json", default="", help="write every figure here")
    s.add_argument("--plot", default="", help="draw throughput against ranks and the data-wait share (PNG)")
    s.add_argument("--data", default="bench/data", help="where the corpus, tokenizer and shards are kept")
    s.add_argument("--ranks", type=int, default=8)
    s.add_argument("--seq-len", type=int, default=2048)
    s.add_argument("--micro-batch", type=int, default=8)
    s.add_argument("--seconds", type=float, default=4.0, help="measuring time per figure")
    s.add_argument("--message-bytes", type=int, default=4 << 20)
    s.add_argument("--kafka", default="127.0.0.1:9092", help="broker for the Kafka figures ('' to skip)")
    s.add_argument("--quick", action="store_true", help="small corpus, short runs (a smoke test)")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser("audit", help="prove from ledgers that each epoch was delivered exactly once")
    s.add_argument("ledgers", nargs="+", help="ledger files of every feeder that served the job")
    s.add_argument("--job", default="")
    s.add_argument("--json", action="store_true", help="one JSON object per (job, epoch)")
    s.set_defaults(fn=cmd_audit)

    s = sub.add_parser("status", help="show a feeder's jobs and ranks")
    s.add_argument("--target", required=True, help="feeder HOST:PORT")
    s.add_argument("--job", default="", help="only this job")
    s.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0)
    s.set_defaults(fn=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except FeederError as e:
        print(f"feeder {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
