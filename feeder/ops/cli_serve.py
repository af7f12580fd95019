"""`feeder serve`: its flags, and the ServeConfig they make with a region file (the flags win).
Split from feeder.cli, which registers the command."""
from __future__ import annotations

import argparse
import logging
import os

from feeder.core.config import named_sources

# serve flag -> ServeConfig field. Flags default to None so that a region file (--config)
# fills what the command line leaves out, and the command line wins where both speak.
SERVE_FLAGS = {"listen": "listen", "region": "region",
               "prefetch_messages": "prefetch_messages", "prefetch_bytes": "prefetch_bytes",
               "member_window_bytes": "member_window_bytes", "message_bytes": "message_bytes", "compression": "default_compression",
               "compression_level": "default_level", "threads": "threads", "grace": "grace_s",
               "vocab_size": "vocab_size", "eos_id": "eos_id", "log_format": "log_format", "ledger": "ledger",
               "tls_cert": "tls_cert", "tls_key": "tls_key", "tls_client_ca": "tls_client_ca",
               "tokens_file": "tokens_file", "insecure": "insecure", "remote_rtt_ms": "remote_rtt_ms",
               "processes": "processes", "sibling_dir": "sibling_dir", "process_index": "process_index",
               "reuse_port": "reuse_port", "column": "column", "dtype": "token_dtype", "index": "index",
               "cache_dir": "cache_dir", "cache_max_gb": "cache_max_gb", "scrub_mb_s": "scrub_mb_s",
               "memory_budget_mb": "memory_budget_mb", "stuck_after_s": "stuck_after_s"}


def serve_config(args):
    from feeder.core.config import ServeConfig
    from feeder.core.errors import InvalidArgument

    values: dict = {}
    if args.config:
        from feeder.ops.regions import load_region

        values = load_region(args.config)
    if isinstance(values.get("source"), list):   # a region file's list of NAME=DATASET
        values.update(named_sources(values.pop("source")))
    for flag, field in SERVE_FLAGS.items():
        v = getattr(args, flag)
        if v is not None:
            values[field] = v
    if args.source is not None:
        values.pop("source", None)
        values.pop("sources", None)
        values.update(named_sources(args.source))
    if args.peers is not None:
        pairs = [p.partition("=") for p in args.peers.split(",") if p]
        if not all(sep and name and addr for name, sep, addr in pairs):
            raise InvalidArgument(f"--peers must be REGION=HOST:PORT,..., got {args.peers!r}")
        values["peers"] = tuple(sorted((name, addr) for name, _, addr in pairs))
    secret_file = args.cursor_secret_file or values.pop("cursor_secret_file", None)
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                values["cursor_secret"] = f.read().strip()
        except OSError as e:
            raise InvalidArgument(f"cannot read the cursor secret {secret_file}: {e.strerror}") from None
    else:
        values["cursor_secret"] = os.environ.get("FEEDER_CURSOR_SECRET", "").encode()
    if "source" not in values and "sources" not in values:
        raise InvalidArgument("serve needs a dataset: --source DIR|kafka://... (or NAME=DIR|URL, repeated) or a "
                              "--config region file with source = ...")
    cfg = ServeConfig(**values)
    from feeder.domain.order_store import orders_directory

    try:   # before the sources open (their warnings would precede this one)
        orders_directory(cfg.cache)
    except InvalidArgument as e:
        if os.path.exists(cfg.cache) and not os.path.isdir(cfg.cache):
            raise   # a file named for the directory: the operator's mistake, said in one line
        # Not this user's to write, read-only: served all the same from the process's own
        # directory (OrderStore, packed), said loudly here and in `feeder status`.
        logging.getLogger("feeder").warning("%s: the feeder serves without sharing what it builds", e)
    if args.metrics_port is not None:
        # Loopback unless told otherwise: metrics name every job, so reaching them from
        # elsewhere is a choice (--metrics-host), with a metrics token when there is a tokens file.
        host = args.metrics_host or "127.0.0.1"
        cfg = cfg.replace(metrics_listen=f"{host}:{args.metrics_port}")
    return cfg


def load_plugins(plugins) -> list[str]:
    """Import each `--plugin` (a module on this Python's path, or a .py file) before anything is
    served, so the order kinds and packings it registers at import (docs/extending.md) are
    served; what each added, for the log. InvalidArgument, in one line, for one that does not
    import (whatever it raised) or registers what clashes with a registration already there."""
    import importlib
    import importlib.util
    import sys

    from feeder.core import order, packing
    from feeder.core.errors import InvalidArgument

    told = []
    for name in plugins or ():
        before = set(order.kinds()), set(packing.names())
        try:
            if name.endswith(".py"):
                path = os.path.abspath(name)
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"no file {path}")
                spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[spec.name]
                    raise
            else:
                importlib.import_module(name)
        except Exception as e:   # (its own code: anything at all; the operator gets one line, not a traceback)
            where = "a .py file" if name.endswith(".py") else \
                "a module importable by this Python (on PYTHONPATH, or installed in its environment)"
            raise InvalidArgument(f"--plugin {name} cannot be imported: {type(e).__name__}: {e}; a plugin is {where} "
                                  "whose import registers its order kinds and packings") from None
        added = [f"order kind {k}" for k in order.kinds() if k not in before[0]] + \
            [f"packing {k}" for k in packing.names() if k not in before[1]]
        told.append(f"plugin {name}: {', '.join(added) or 'registered no order kind or packing'}")
    return told


def cmd_serve(args) -> int:
    from feeder.ops import logs
    from feeder.core.malloc import keep_freed_memory
    from feeder.service.server import new_loop, serve_forever

    told = load_plugins(args.plugin)   # before the config: what it registers is what the feeder serves
    cfg = serve_config(args)
    logs.setup(cfg.log_format, process=cfg.process_index if cfg.sibling_dir else None)
    for line in told:
        logging.getLogger("feeder").info("%s", line)
    if cfg.processes > 1:
        from feeder.ops.supervise import supervise

        return supervise(cfg, args.argv)

    def ready(server):
        print(f"feeder region={cfg.region} listening on {server.address}", flush=True)
        if server.metrics_address:
            print(f"metrics on {server.metrics_address}", flush=True)

    keep_freed_memory()
    loop = new_loop()
    try:
        loop.run_until_complete(serve_forever(cfg, ready))
    finally:
        loop.close()
    return 0


def add_serve(sub) -> None:
    s = sub.add_parser("serve", help="serve a dataset to training ranks",
                       description="Serve a dataset (a `feeder prep` directory, Parquet token files, or a Kafka "
                                   "topic) to training ranks over gRPC until SIGTERM or SIGINT, then drain streams"
                                   " for --grace seconds. Settings come from --config (a region file) and the "
                                   "flags, which win. Reads the dataset, TLS files and tokens file; never writes "
                                   "to the dataset; appends to --ledger when given. Prints `feeder region=R "
                                   "listening on HOST:PORT` once it accepts streams. Exit 0 after a clean stop; 2,"
                                   " with one line, for a bad setting or dataset.")
    s.add_argument("--config", help="region file (TOML, e.g. deploy/regions/us-east.toml); flags override it")
    s.add_argument("--plugin", action="append", metavar="MODULE",
                   help="import this module (or a .py file) before serving, so the order kinds and packings it "
                        "registers are served (docs/extending.md); repeatable, in order")
    s.add_argument("--source", action="append", help="dataset directory (manifest.json, or Parquet token files), "
                   "or kafka://HOST:PORT/TOPIC[?mode=bounded|follow&bad_records=fail|skip&...]; several as "
                   "NAME=DIR|URL, the flag repeated (streams ask for one by name, or for a mixture; the first "
                   "is the default)")
    s.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:7070; port 0: any free port). Beyond "
                   "loopback it needs --tls-cert/--tls-key, or --insecure")
    s.add_argument("--region", help="this feeder's region name (default local)")
    s.add_argument("--peers", help="the other regions' feeders, told to clients by Info: REGION=HOST:PORT,...")
    s.add_argument("--prefetch-messages", type=int, help="messages queued ahead per stream (default 8)")
    s.add_argument("--prefetch-bytes", type=int, help="bytes queued ahead per stream (default 32 MiB)")
    s.add_argument("--member-window-bytes", type=int,
                   help="bytes of a model-parallel rank's messages kept for its members (default 64 MiB; "
                        "docs/model-parallel.md)")
    s.add_argument("--message-bytes", type=int, help="target size of one stream message (default 1 MiB)")
    s.add_argument("--memory-budget-mb", type=float,
                   help="MiB of messages built ahead of what the peers read, over all streams of a process: past "
                        "half of it each stream queues one message, past all of it new streams get RESOURCE_EXHAUSTED "
                        "(default 0: an eighth of the host's or cgroup's memory, shared by the --processes)")
    s.add_argument("--compression", choices=["zstd", "none"],
                   help="for streams that do not choose (default zstd; remote ranks always get zstd)")
    s.add_argument("--compression-level", type=int, help="zstd level (default 3)")
    s.add_argument("--remote-rtt-ms", type=float, help="a rank this far (measured RTT) is remote (default 5)")
    s.add_argument("--threads", type=int, help="batch-building threads (default 4)")
    s.add_argument("--processes", type=int, help="feeder processes on this one port (default 1): one process is "
                   "bound by its GIL, a host with more cores serves more with more; any one of them answers "
                   "`feeder status` for all, each serves metrics on --metrics-port plus its index")
    # Set by `--processes N` for the processes it starts.
    s.add_argument("--reuse-port", action="store_true", default=None,
                   help="share the port with feeder processes started separately (SO_REUSEPORT); without it a "
                        "port that is taken, by a feeder too, is an error")
    s.add_argument("--sibling-dir", help=argparse.SUPPRESS)
    s.add_argument("--process-index", type=int, help=argparse.SUPPRESS)
    s.add_argument("--cursor-secret-file", help="file with the deployment's cursor secret "
                   "(or env FEEDER_CURSOR_SECRET); all feeders of a deployment share it")
    s.add_argument("--grace", type=float, help="seconds to drain streams on SIGTERM (default 10)")
    s.add_argument("--vocab-size", type=int, help="datasets without manifest.json that do not record it (Parquet, "
                   "Megatron, HF, MDS, nanoGPT)")
    s.add_argument("--eos-id", type=int, help="with --vocab-size")
    add_format_flags(s)
    s.add_argument("--index", help="the `feeder index` sidecar, when it is not next to the data")
    s.add_argument("--scrub-mb-s", type=float, help="re-hash the chunks already verified at this many MB/s in the "
                   "background; a chunk found changed is DATA_LOSS from then on (default 16; 0: off)")
    s.add_argument("--stuck-after-s", type=float, help="a source read that has not returned for this long is stuck "
                   "(a hung filesystem): its streams end UNAVAILABLE so their ranks move elsewhere, and new streams "
                   "of that source are refused here until it returns (default 10)")
    s.add_argument("--log-format", choices=["text", "json"])
    s.add_argument("--ledger", help="append one JSON line per delivered batch (for `feeder audit`)")
    s.add_argument("--cache-dir", help="where what is built once is kept and shared by every feeder and process "
                   "that reads it: epoch orders of torch's permutation (DIR/orders; default ~/.cache/feeder) and "
                   "Kafka bounded epochs' snapshots (DIR/kafka; a Kafka URL's ?spool= wins for its topic). On the "
                   "region's shared filesystem each is built once per region")
    s.add_argument("--cache-max-gb", type=float, help="the cache directory's budget for orders in GiB (2^30 "
                   "bytes; builds under way count), least recently used removed first (default 64)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: any free port; printed at start)")
    s.add_argument("--metrics-host", default="", help="address for /metrics (default 127.0.0.1: loopback; with "
                   "--tokens-file a scrape needs a token with metrics = true, or a client certificate)")
    s.add_argument("--tls-cert", help="PEM certificate chain of this feeder (TLS; reloaded when it changes)")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", help="mutual TLS: require client certificates signed by this CA")
    s.add_argument("--tokens-file", help="per-job bearer tokens (TOML; see `feeder token`); reloaded when it changes")
    s.add_argument("--insecure", action="store_const", const=True, default=None,
                   help="allow plain text on a listener beyond loopback (a warning is logged)")
    s.set_defaults(fn=cmd_serve)


def add_format_flags(s) -> None:
    s.add_argument("--column", help="the token column of a Hugging Face or MDS dataset (default input_ids)")
    s.add_argument("--dtype", choices=["uint16", "uint32", "int32", "int64"],
                   help="the token width of a nanoGPT .bin (uint16|uint32, default uint16) or an MDS bytes column")
