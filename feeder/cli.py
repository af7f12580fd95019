"""`feeder prep | serve | status | ...`: the command line. User mistakes end in one clear line
(exit 2), never a traceback."""
from __future__ import annotations

import argparse
import os
import sys

from feeder.ops.cli_serve import add_format_flags, add_serve
from feeder.core.errors import FeederError

EXIT_USER = 2


def cmd_prep(args) -> int:
    from feeder.core.tool_config import PrepConfig
    from feeder.ops.prep import prep

    cfg = PrepConfig(inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer, eos_token=args.eos_token,
                     shard_tokens=args.shard_tokens, chunk_tokens=args.chunk_tokens, workers=args.workers,
                     progress=not args.quiet)
    m = prep(cfg, force=args.force)
    print(f"wrote {len(m.shards)} shard(s), {m.n_documents:,} documents, {m.n_tokens:,} tokens to {args.out} "
          f"(vocab {m.vocab_size}, {m.dtype}, fingerprint {m.fingerprint[:16]})")
    return 0


def cmd_publish(args) -> int:
    from feeder.core.tool_config import PublishConfig
    from feeder.ops.publish import publish

    cfg = PublishConfig(inputs=tuple(args.inputs), to=args.to, partitions=args.partitions, tokenizer=args.tokenizer,
                        eos_token=args.eos_token, key=args.key, workers=args.workers, progress=not args.quiet)
    r = publish(cfg)
    print(f"published {r['records']:,} records to {r['topic']} ({r['partitions']} partitions, vocab "
          f"{r['vocab_size']}, eos {r['eos_id']})")
    return 0


def cmd_status(args) -> int:
    from feeder.ops.status import show

    return show(args.target, job=args.job, watch=args.watch, interval=args.interval,
                security=client_security(args))


def _client_security_flags(s) -> None:
    s.add_argument("--ca", default="", help="CA of the feeder's certificate (TLS)")
    s.add_argument("--cert", default="", help="client certificate, for feeders with mutual TLS")
    s.add_argument("--key", default="", help="key of --cert")
    s.add_argument("--token-file", default="", help="file holding a bearer token (or env FEEDER_TOKEN)")
    s.add_argument("--server-name", default="", help="name to expect in the feeder's certificate, when it is "
                   "not the target's host")


def client_security(args):
    from feeder.service.security import ClientSecurity

    return ClientSecurity(ca=args.ca, cert=args.cert, key=args.key, token_file=args.token_file,
                          token="" if args.token_file else os.environ.get("FEEDER_TOKEN", ""),
                          server_name=args.server_name)


def cmd_token(args) -> int:
    from feeder.service.security import new_token, token_hash

    from feeder.core.errors import InvalidArgument

    if not args.job and not args.metrics:
        raise InvalidArgument("feeder token needs --job NAME (repeat; '*': all) or --metrics")
    tok = new_token()
    jobs = ", ".join(f'"{j}"' for j in args.job or ())
    print(f"token: {tok}")
    print("# append to the feeders' tokens file (the token itself is not stored there):")
    print(f'[[token]]\nname = "{args.name or (args.job or ["metrics"])[0]}"\njobs = [{jobs}]')
    if args.dataset:
        print("datasets = [" + ", ".join(f'"{d}"' for d in args.dataset) + "]")
    if args.metrics:
        print("metrics = true")
    print(f'sha256 = "{token_hash(tok)}"')
    return 0


def cmd_certs(args) -> int:
    from feeder.ops import certs

    if args.what == "ca":
        crt, _ = certs.make_ca(args.out, days=args.days or 3650)
    else:
        if not args.name or not args.ca_dir:
            raise FeederError("certs issue needs a NAME and --ca-dir DIR (with ca.crt and ca.key)")
        crt, _ = certs.issue(args.ca_dir, args.out, args.name, args.host or ["localhost", "127.0.0.1"],
                             days=args.days or 365)
    print(f"wrote {crt} and {crt.with_suffix('.key')}")
    return 0


def cmd_health(args) -> int:
    """For probes (Kubernetes exec, systemd, load balancers): one line, exit 0 when SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from feeder.service.security import ClientSecurity, explain

    target, security = args.target, client_security(args)
    if args.config:
        from feeder.core.config import ServeConfig
        from feeder.ops.regions import load_region

        cfg = ServeConfig(**{"source": "-", **{k: v for k, v in load_region(args.config).items()
                                               if k != "cursor_secret_file"}})
        if not target:
            host, _, port = cfg.listen.rpartition(":")
            target = f"{'127.0.0.1' if host in ('0.0.0.0', '::', '[::]') else host}:{port}"
        if cfg.tls and not args.ca:
            # The feeder's own certificate doubles as the probe's client certificate under mTLS
            # (certificates from `feeder certs` are valid for both ends).
            mtls = bool(cfg.tls_client_ca)
            security = ClientSecurity(ca=cfg.tls_ca or cfg.tls_client_ca, cert=cfg.tls_cert if mtls else "",
                                      key=cfg.tls_key if mtls else "", server_name=args.server_name)
            if not security.ca:
                raise FeederError(f"{args.config} has TLS but no tls.ca (the CA that signed tls.cert): the probe "
                                  "cannot verify the feeder; add it, or pass --ca")
    if not target:
        raise FeederError("health needs --target HOST:PORT or --config REGION.toml")
    with security.channel(target) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                      timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"feeder health: {explain(e, target, security)}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(f"{target}: {name}")
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def _elastic_verdict(r: dict) -> str:
    head = f"job {r['job']} epoch {r['epoch']}: {r['samples']} samples in {r['committed_steps']} committed steps"
    if r["exactly_once"]:
        return (f"{head}: every sample trained in exactly one committed step ({r['n_duplicate_deliveries']} repeats "
                "are DistributedSampler padding)")
    return (f"{head}: NOT exactly once: {r['n_missing']} missing {r['missing'][:20]}, {r['n_duplicate_deliveries']} "
            f"duplicates {r['duplicates'][:20]} (padding allows {r['padding_allowed']}), "
            f"{len(r['incomplete_steps'])} committed steps with parts never sent {r['incomplete_steps'][:3]}, "
            f"{len(r['conflicts'])} conflicts")


def cmd_audit(args) -> int:
    import json

    from feeder.ops.audit import audit

    results = audit(args.ledgers, job=args.job)
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        if r.get("elastic"):
            print(_elastic_verdict(r))
            continue
        head = f"job {r['job']} epoch {r['epoch']}: {r['samples']} samples in {r['batches']} batches"
        if r["exactly_once"]:
            print(f"{head}: every sample delivered exactly once ({r['resent_batches']} batches resent after "
                  f"failover counted once; {r['n_duplicate_deliveries']} repeats are DistributedSampler padding)")
        else:
            print(f"{head}: NOT exactly once: {r['n_missing']} missing {r['missing'][:20]}, "
                  f"{r['n_duplicate_deliveries']} duplicate deliveries {r['duplicates'][:20]} "
                  f"(padding allows {r['padding_allowed']}), {len(r['conflicts'])} conflicting batches")
        if "per_source" in r:
            print("  per source (positions filled / weight x samples): " + ", ".join(
                f"{n} {v['samples']}/{'?' if v['expected'] is None else format(v['expected'], 'g')}"
                for n, v in r["per_source"].items())
                + ("" if all(v["expected"] is not None for v in r["per_source"].values())
                   else " (the job's weights changed, by a remix or a schedule: no one set of weights)"))
    if not results:
        print("no batches in the ledger" + (f" for job {args.job!r}" if args.job else ""))
        return 1
    return 0 if all(r["exactly_once"] for r in results) else 1


def _add_prep(sub) -> None:
    s = sub.add_parser("prep", help="tokenize documents into Arrow IPC shards + manifest.json",
                       description="Tokenize documents into a dataset directory that `feeder serve` serves: Arrow "
                                   "IPC shard files (shard-NNNNN.arrow) and manifest.json (counts, checksums, "
                                   "tokenizer, and the dataset's fingerprint, the same for every replica). Reads "
                                   "INPUTS; writes only under --out, and refuses a directory that already holds a "
                                   "dataset unless --force. Exit 0 when the dataset is written; 2, with one line, "
                                   "on bad input (an unreadable or malformed file, a bad tokenizer, a dataset in "
                                   "--out).")
    s.add_argument("inputs", nargs="+", help=".jsonl (field text), .txt (one document), .parquet (column text), "
                   ".tfrecord (int64 input_ids); all but Parquet may be gzip/bzip2/xz/zstd compressed. Text is UTF-8")
    s.add_argument("--out", required=True, help="output directory (a Lustre path in production)")
    s.add_argument("--tokenizer", default="byte", help="'byte' or a path to a Hugging Face tokenizer.json")
    s.add_argument("--eos-token", default="", help="end-of-document token of a tokenizer.json")
    s.add_argument("--shard-tokens", type=int, default=64 << 20, help="tokens per shard file")
    s.add_argument("--chunk-tokens", type=int, default=1 << 20, help="tokens per record batch (checksum unit)")
    s.add_argument("--workers", type=int, default=0, help="tokenizer processes (0: one per core)")
    s.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    s.add_argument("--quiet", action="store_true", help="no progress output")
    s.set_defaults(fn=cmd_prep)


def _add_publish(sub) -> None:
    s = sub.add_parser("publish", help="tokenize documents into a Kafka topic, one record per document",
                       description="Tokenize documents into a Kafka topic, one record per document, for `feeder "
                                   "serve --source kafka://...`. Reads INPUTS; creates the topic when missing "
                                   "(--partitions) and writes the records to it. Exit 0 when the broker has "
                                   "acknowledged every record; 2, with one line, on bad input, an unreachable "
                                   "broker, a topic with other partitions than asked, or records not delivered.")
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


def cmd_index(args) -> int:
    from feeder.sources.formats import Options
    from feeder.sources.formats.sidecar import index

    r = index(args.source, Options(vocab_size=args.vocab_size or 0, eos_id=-1 if args.eos_id is None else args.eos_id,
                                   column=args.column or "", dtype=args.dtype or "", chunk_tokens=args.chunk_tokens),
              out=args.out or "", workers=args.workers, progress=not args.quiet)
    print(f"indexed {r['chunks']} chunk(s), {r['n_tokens']:,} tokens, {r['bytes']:,} bytes of {args.source}: "
          f"{r['path']} (fingerprint {r['fingerprint'][:16]})")
    return 0


def _add_index(sub) -> None:
    s = sub.add_parser("index", help="checksum a corpus in another tool's format (Megatron, HF, MDS, nanoGPT, llm.c) "
                       "into a sidecar: chunks verified on first read, a content fingerprint")
    s.add_argument("source", help="what `feeder serve --source` is given")
    s.add_argument("--out", help="write the sidecar here (a directory) instead of next to the data; "
                   "then `feeder serve --index DIR`")
    s.add_argument("--vocab-size", type=int)
    s.add_argument("--eos-id", type=int)
    add_format_flags(s)
    s.add_argument("--chunk-tokens", type=int, default=0,
                   help="tokens per checked chunk of a memory-mapped file (default 16Mi)")
    s.add_argument("--workers", type=int, default=0, help="hashing threads (default: the cores, at most 8)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_index)


def _add_token(sub) -> None:
    s = sub.add_parser("token", help="make a bearer token for jobs, and the line for a feeder's tokens file",
                       description="Make a new bearer token for the given jobs. Prints the token (give it to the "
                                   "job, e.g. --token-file) and the entry to append to the feeders' tokens file "
                                   "(--tokens-file), which holds only its hash. Writes no file. Exit 0.")
    s.add_argument("--job", action="append", help="a job the token may read (repeat; '*': all)")
    s.add_argument("--dataset", action="append", help="a dataset (source name) the token's jobs may read (repeat; "
                   "default: every dataset of the feeder)")
    s.add_argument("--metrics", action="store_true", help="the token may scrape /metrics (Prometheus)")
    s.add_argument("--name", default="", help="a name for logs (default: the first job)")
    s.set_defaults(fn=cmd_token)


def _add_certs(sub) -> None:
    s = sub.add_parser("certs", help="make a deployment CA, or a certificate it signs (TLS, mutual TLS)",
                       description="`certs ca`: a new deployment CA (ca.crt, ca.key) in --out. `certs issue NAME`:"
                                   " NAME.crt and NAME.key in --out, signed by the CA in --ca-dir, valid for "
                                   "server and client use (feeders, ranks, probes). Exit 0 when written; 2, with "
                                   "one line, when arguments are missing or wrong.")
    s.add_argument("what", choices=["ca", "issue"], help="ca: a new CA in --out; issue: NAME.crt/.key signed by --ca-dir")
    s.add_argument("name", nargs="?", default="", help="issue: the certificate's name (file stem, common name)")
    s.add_argument("--out", required=True, help="directory to write to")
    s.add_argument("--ca-dir", default="", help="issue: directory with ca.crt and ca.key")
    s.add_argument("--host", action="append", default=[], help="issue: DNS name or IP it is valid for "
                   "(repeat; default localhost and 127.0.0.1)")
    s.add_argument("--days", type=int, default=0, help="validity (default 3650 for a CA, 365 otherwise)")
    s.set_defaults(fn=cmd_certs)


def _add_health(sub) -> None:
    s = sub.add_parser("health", help="check a feeder's gRPC health service (exit 0 when SERVING)",
                       description="Ask a feeder's gRPC health service, for probes (Kubernetes exec, systemd, load"
                                   " balancers). The target and TLS material come from the flags or from a region "
                                   "file (--config). Prints one line. Exit 0 when the feeder is SERVING; 1 when it"
                                   " is not or does not answer; 2, with one line, for bad arguments.")
    s.add_argument("--target", help="feeder HOST:PORT (default: from --config, with loopback for 0.0.0.0)")
    s.add_argument("--config", help="region file: the target and TLS material are taken from it")
    s.add_argument("--timeout", type=float, default=3.0)
    _client_security_flags(s)
    s.set_defaults(fn=cmd_health)


def _add_audit(sub) -> None:
    s = sub.add_parser("audit", help="prove from ledgers that each epoch was delivered exactly once",
                       description="Read the ledgers (`serve --ledger`) of every feeder that served a job and "
                                   "prove, per job and epoch, that each sample was delivered exactly once (batches"
                                   " resent after a failover counted once, DistributedSampler's padding allowed). "
                                   "Prints one line (or, with --json, one object) per job and epoch. Exit 0 when "
                                   "every epoch is exactly once; 1 when one is not or the ledgers hold no batches;"
                                   " 2, with one line, when a file cannot be read or is no ledger.")
    s.add_argument("ledgers", nargs="+", help="ledger files of every feeder that served the job")
    s.add_argument("--job", default="")
    s.add_argument("--json", action="store_true", help="one JSON object per (job, epoch)")
    s.set_defaults(fn=cmd_audit)


def _add_status(sub) -> None:
    s = sub.add_parser("status", help="show a feeder's jobs and ranks",
                       description="Show a feeder's jobs and each rank's progress, rate, region, data-wait and "
                                   "failovers, once or, with --watch, refreshed every --interval seconds until "
                                   "Ctrl-C. Reads the feeder's Status over gRPC; writes nothing. Exit 0; 2, with "
                                   "one line, when the feeder cannot be reached, refuses the credentials, or does "
                                   "not know --job.")
    s.add_argument("--target", required=True, help="feeder HOST:PORT")
    _client_security_flags(s)
    s.add_argument("--job", default="", help="only this job")
    s.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    s.add_argument("--interval", type=float, default=2.0)
    s.set_defaults(fn=cmd_status)


def _add_mix(sub) -> None:
    s = sub.add_parser("mix", help="change a running job's mixture schedule live",
                       description="Replace a running job's mixture schedule from a point on, without a restart: "
                                   "every rank switches at the same progress, past every sample any of the feeders "
                                   "had planned, so nothing already sent changes (docs/mixtures.md, \"Live changes\")."
                                   " Name every feeder serving the job with --target. Needs a token with the job's "
                                   "scope where the feeders ask for tokens. Exit 0 when every feeder took the "
                                   "change; 2, with one line, otherwise.")
    s.add_argument("job")
    s.add_argument("--schedule", help="TOML file of the new schedule ([[segment]] tables, as mixture_schedule "
                   "takes)")
    s.add_argument("--abort", action="store_true", help="end a change prepared and never committed (a `feeder mix` "
                   "that died between its phases): the feeders' streams of the job go on under their schedule")
    s.add_argument("--target", action="append", required=True, help="feeder HOST:PORT (repeat for each)")
    s.add_argument("--relative", action="store_true", help="count the schedule's `until`s from where the change "
                   "takes effect, not from the job's start")
    s.add_argument("--seq-len", type=int, default=0, help="the job's seq_len, for a schedule in tokens")
    _client_security_flags(s)
    s.set_defaults(fn=cmd_mix)


def cmd_mix(args) -> int:
    from feeder.ops.mix import abort, mix

    if args.abort:
        abort(args.target, args.job, security=client_security(args))
        return 0
    if not args.schedule:
        raise FeederError("feeder mix needs --schedule FILE.toml (or --abort)")
    mix(args.target, args.job, args.schedule, relative=args.relative, seq_len=args.seq_len,
        security=client_security(args))
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """`feeder`'s parser; given the arguments it will parse, it reads the installed plugin
    commands only when they do not name a built-in one (reading entry points costs every start
    tens of milliseconds)."""
    p = argparse.ArgumentParser(prog="feeder", description="Token feeder: prepare datasets and serve token "
                                "batches to training ranks over gRPC.")
    sub = p.add_subparsers(dest="command", required=True)

    _add_prep(sub)
    _add_publish(sub)
    add_serve(sub)
    _add_index(sub)
    _add_token(sub)
    _add_certs(sub)
    _add_health(sub)
    _add_audit(sub)
    _add_status(sub)
    _add_mix(sub)
    if not argv or argv[0] not in sub.choices:
        add_plugin_commands(sub)
    return p


def add_plugin_commands(sub) -> None:
    """Subcommands that other installed packages add through the `feeder.commands` entry-point
    group (each entry point is a function given the subparsers): `feeder bench` is the
    benchmark's (bench/cli.py), so `feeder` runs it without importing the bench package, which
    sits above both the feeder and its client. One that cannot be loaded (a stale or partial
    install) becomes a command that says so in one line, rather than an unknown command."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="feeder.commands"):
        try:
            register = ep.load()
        except ImportError as e:
            # no option prefix: whatever flags follow land in `rest`, and fn says why it cannot run
            s = sub.add_parser(ep.name, help=f"(cannot be loaded: {e})", add_help=False, prefix_chars="\0")
            s.add_argument("rest", nargs=argparse.REMAINDER)
            s.set_defaults(fn=_unloadable(ep.name, ep.value, e))
            continue
        register(sub)


def _unloadable(name: str, value: str, err: ImportError):
    def fn(args) -> int:
        raise FeederError(f"`feeder {name}` is registered ({value}) but cannot be loaded: {err}; "
                          "reinstall token-feeder (`make env` in a checkout)")
    return fn


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    args.argv = argv   # `serve --processes N` starts N of itself
    try:
        return args.fn(args)
    except FeederError as e:
        print(f"feeder {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
