"""Frozen, keyword-only configuration. Every value is checked in __post_init__ and a bad
one raises InvalidArgument saying what was given and what was expected."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from feeder.errors import InvalidArgument

COMPRESSIONS = ("none", "zstd")
BAD_RECORD_POLICIES = ("", "skip", "fail")
MAX_SEQ_LEN = 1 << 20
MAX_MICRO_BATCH = 1 << 16


def _positive(name: str, value: int, *, upper: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    if upper is not None and value > upper:
        raise InvalidArgument(f"{name} must be at most {upper}, got {value}")


def _non_negative(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{name} must be a non-negative integer, got {value!r}")


def _compression(name: str, value: str, level: int) -> None:
    if value not in COMPRESSIONS:
        raise InvalidArgument(f"{name} must be one of {', '.join(COMPRESSIONS)}, got {value!r}")
    if value == "zstd" and not -7 <= level <= 22:
        raise InvalidArgument(f"zstd level must be in [-7, 22], got {level}")


@dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """One rank's request, validated. Everything that decides which samples it gets."""

    job: str
    rank: int
    world_size: int
    seq_len: int
    micro_batch: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    epoch: int = 0
    num_epochs: int = 1          # 0: no end
    compression: str = "zstd"    # "": the feeder decides (its default; zstd for a remote rank)
    compression_level: int = 3
    worker_index: int = 0
    num_workers: int = 1
    # The round-robin index of the first batch after the cursor (see the proto): a worker
    # that reopens from its own last batch's cursor is one past its own index.
    worker_phase: int = 0
    reshard: bool = False
    expected_fingerprint: str = ""
    dataset: str = ""
    bad_records: str = ""        # Kafka: "skip" | "fail" | "" (the source's default)

    def __post_init__(self):
        if not self.job or len(self.job) > 256 or not self.job.isprintable():
            raise InvalidArgument(f"job must be a printable name of 1..256 characters, got {self.job!r}")
        _positive("world_size", self.world_size, upper=1 << 20)
        _non_negative("rank", self.rank)
        if self.rank >= self.world_size:
            raise InvalidArgument(f"rank must be < world_size ({self.world_size}), got {self.rank}")
        _positive("seq_len", self.seq_len, upper=MAX_SEQ_LEN)
        _positive("micro_batch", self.micro_batch, upper=MAX_MICRO_BATCH)
        _non_negative("seed", self.seed)
        _non_negative("epoch", self.epoch)
        _non_negative("num_epochs", self.num_epochs)
        if self.compression:
            _compression("compression", self.compression, self.compression_level)
        _positive("num_workers", self.num_workers, upper=1024)
        if self.bad_records not in BAD_RECORD_POLICIES:
            raise InvalidArgument(f"bad_records must be skip or fail (or empty for the source's default), "
                                  f"got {self.bad_records!r}")
        if not 0 <= self.worker_index < self.num_workers:
            raise InvalidArgument(
                f"worker_index must be in [0, num_workers={self.num_workers}), got {self.worker_index}")
        if not 0 <= self.worker_phase < self.num_workers:
            raise InvalidArgument(
                f"worker_phase must be in [0, num_workers={self.num_workers}), got {self.worker_phase}")

    @property
    def end_epoch(self) -> int | None:
        return None if self.num_epochs == 0 else self.epoch + self.num_epochs


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    source: str
    listen: str = "127.0.0.1:7070"
    region: str = "local"
    # Per-stream prefetch: at most this many messages and bytes wait in the queue.
    prefetch_messages: int = 8
    prefetch_bytes: int = 32 << 20
    # Several micro-batches are packed into one message up to this size: Python gRPC
    # moves far more bytes/s with ~1 MiB messages than with small ones.
    message_bytes: int = 1 << 20
    default_compression: str = "zstd"
    default_level: int = 3
    threads: int = 4
    cursor_secret: bytes = field(default=b"", repr=False)
    grace_s: float = 10.0
    vocab_size: int = 0          # only for Parquet datasets without manifest.json
    eos_id: int = -1
    log_format: str = "text"
    ledger: str = ""             # append one JSON line per delivered batch here ("" = off)
    metrics_listen: str = ""     # HOST:PORT for Prometheus /metrics ("" = off, port 0 = any)
    # Security. A listener beyond loopback needs TLS, or insecure=True said out loud.
    tls_cert: str = ""           # PEM certificate chain and key of this feeder (reloaded when they change)
    tls_key: str = ""
    tls_client_ca: str = ""      # mutual TLS: clients must present a certificate signed by this CA
    tls_ca: str = ""             # the CA that signed tls_cert: what `feeder health --config` verifies against
    tokens_file: str = ""        # per-job bearer tokens (TOML, reloaded when it changes); "" = no tokens
    insecure: bool = False
    # Regions: the other regions' feeders (name, HOST:PORT), told to clients by Info.
    peers: tuple[tuple[str, str], ...] = ()
    # A rank whose measured round-trip time is at least this far is remote: when it does not
    # choose, it gets zstd even if default_compression is none.
    remote_rtt_ms: float = 5.0
    # Processes serving this one port (SO_REUSEPORT), started and restarted by `feeder serve`:
    # one process is bound by its GIL near 1 GB/s, a host with more cores serves more with more.
    processes: int = 1
    # Set by that supervisor for each process it starts: where the processes leave their
    # status for each other (so any one answers `feeder status` for all), and which one this is.
    sibling_dir: str = ""
    process_index: int = 0

    def __post_init__(self):
        if not self.source:
            raise InvalidArgument("source must name a dataset directory, got ''")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise InvalidArgument(f"listen must be HOST:PORT, got {self.listen!r}")
        _positive("prefetch_messages", self.prefetch_messages)
        _positive("prefetch_bytes", self.prefetch_bytes)
        _positive("message_bytes", self.message_bytes, upper=64 << 20)
        _compression("default_compression", self.default_compression, self.default_level)
        _positive("threads", self.threads, upper=256)
        _positive("processes", self.processes, upper=256)
        if self.metrics_listen:
            mhost, msep, mport = self.metrics_listen.rpartition(":")
            if not msep or not mport.isdigit() or int(mport) > 65535:
                raise InvalidArgument(f"metrics_listen must be HOST:PORT, got {self.metrics_listen!r}")
        if self.log_format not in ("text", "json"):
            raise InvalidArgument(f"log_format must be text or json, got {self.log_format!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("TLS needs both tls_cert and tls_key (--tls-cert/--tls-key), got only "
                                  f"{'tls_cert' if self.tls_cert else 'tls_key'}")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        if not isinstance(self.remote_rtt_ms, (int, float)) or self.remote_rtt_ms < 0:
            raise InvalidArgument(f"remote_rtt_ms must be a non-negative number, got {self.remote_rtt_ms!r}")
        if not isinstance(self.peers, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) and x for x in p) for p in self.peers):
            raise InvalidArgument(f"peers must be (region, HOST:PORT) pairs, got {self.peers!r}")
        from feeder.net import is_loopback

        for what, address in (("listen", self.listen), ("metrics_listen", self.metrics_listen)):
            if address and not self.tls_cert and not self.insecure and not is_loopback(address.rpartition(":")[0]):
                raise InvalidArgument(
                    f"{what} {address} is beyond loopback and would be plain text: give --tls-cert and --tls-key "
                    "(TLS), or --insecure to serve plain text anyway")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def replace(self, **changes) -> "ServeConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class PrepConfig:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str = "byte"          # "byte" or a path to a Hugging Face tokenizer.json
    eos_token: str = ""              # HF tokenizers: which token ends a document
    shard_tokens: int = 64 << 20     # a shard file is closed once it holds this many tokens
    chunk_tokens: int = 1 << 20      # a record batch (the unit checksummed when read)
    workers: int = 0                 # 0: one per core
    batch_docs: int = 256            # documents per unit of parallel work
    progress: bool = True

    def __post_init__(self):
        if not self.inputs:
            raise InvalidArgument("feeder prep needs at least one input file, got none")
        if not self.out:
            raise InvalidArgument("--out must name a directory, got ''")
        _positive("shard_tokens", self.shard_tokens)
        _positive("chunk_tokens", self.chunk_tokens)
        _non_negative("workers", self.workers)
        _positive("batch_docs", self.batch_docs)


@dataclass(frozen=True, kw_only=True)
class PublishConfig:
    inputs: tuple[str, ...]
    to: str                          # kafka://HOST:PORT/TOPIC
    partitions: int = 0              # 0: the topic's count, or 3 for a new topic
    tokenizer: str = "byte"
    eos_token: str = ""
    key: str = ""                    # "" : document i -> partition i mod P; "index": key = i, broker hashes
    workers: int = 0
    batch_docs: int = 256
    progress: bool = True

    def __post_init__(self):
        if not self.inputs:
            raise InvalidArgument("feeder publish needs at least one input file, got none")
        if not self.to.startswith("kafka://"):
            raise InvalidArgument(f"--to must be kafka://HOST:PORT/TOPIC, got {self.to!r}")
        _non_negative("partitions", self.partitions)
        if self.key not in ("", "index"):
            raise InvalidArgument(f"--key must be 'index' (or left out for round-robin), got {self.key!r}")
        _non_negative("workers", self.workers)
        _positive("batch_docs", self.batch_docs)
