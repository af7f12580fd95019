"""Frozen, keyword-only configuration. Every value is checked in __post_init__ and a bad
one raises InvalidArgument saying what was given and what was expected."""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field

from feeder.core.context import LAYOUTS, divisibility
from feeder.core.errors import InvalidArgument
from feeder.core import order

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

COMPRESSIONS = ("none", "zstd")
BAD_RECORD_POLICIES = ("", "skip", "fail")
MAX_SEQ_LEN = 1 << 20
MAX_MICRO_BATCH = 1 << 16
MAX_MEMBERS = 1 << 16    # processes of one data-parallel rank
MAX_CP = 1 << 10


# What the wire (protos/feeder/v1/feeder.proto) can carry: a value beyond these fails when the
# client builds its request, in the stream thread, instead of here where the caller sees it.
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
MAX_NAME = 256
# A global batch's policies under live elasticity (feeder.core.steps); "": a fixed world.
GLOBAL_BATCH = ("", "constant", "shrink")
MAX_SOURCES = 256    # sources in one mixture
# A mixture's positions per epoch: 3.5·10^13 (10^17 tokens at 4096 a sample). Each position's source is
# computed alone (feeder/core/blend.py coupling), whose float margin stays small up to ~2^46.
MAX_EPOCH_SAMPLES = 2**45
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
SHOWN_CHARS = 64


def shown(value) -> str:
    """repr(value) for an error message, cut short: messages echo what was given, and a 1 MiB
    job name echoed whole would make a 1 MiB gRPC status (over the metadata limit, so the
    caller would get RESOURCE_EXHAUSTED instead of the refusal) or a screenful on the CLI.
    Huge integers are described, not printed (str() of one past 4300 digits raises)."""
    if isinstance(value, (str, bytes)) and len(value) > SHOWN_CHARS:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:SHOWN_CHARS]!r}... ({len(value):,} {unit} in all)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length():,} bits"
    r = repr(value)
    return r if len(r) <= 2 * SHOWN_CHARS else f"{r[:2 * SHOWN_CHARS]}... ({len(r):,} characters in all)"


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(name: str, value: int, *, upper: int | None = None) -> None:
    if not _integer(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a positive integer, got {shown(value)}")
    if upper is not None and value > upper:
        raise InvalidArgument(f"{name} must be at most {upper}, got {shown(value)}")


def _non_negative(name: str, value: int, *, upper: int | None = None) -> None:
    if not _integer(value) or value < 0:
        raise InvalidArgument(f"{name} must be a non-negative integer, got {shown(value)}")
    if upper is not None and value > upper:
        raise InvalidArgument(f"{name} must be at most {upper}, got {shown(value)}")


def _flag(name: str, value) -> None:
    # numpy's bool_ and the integers 0 and 1 pass (protobuf takes them); a string such as "no" does not.
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if not (isinstance(value, bool) or numpy_bool or (_integer(value) and value in (0, 1))):
        raise InvalidArgument(f"{name} must be True or False, got {shown(value)}")


def _text(name: str, value, *, limit: int | None = None) -> None:
    # Protobuf strings are UTF-8: a lone surrogate ("\ud800") cannot be sent.
    ok = isinstance(value, str) and (limit is None or len(value) <= limit)
    if ok and _LONE_SURROGATE.search(value):
        ok = False
    if not ok:
        raise InvalidArgument(f"{name} must be a string of Unicode characters"
                              f"{f' (at most {limit})' if limit else ''}, got {shown(value)}")


def _mixture(mixture, dataset: str) -> None:
    """Names unique and printable, weights finite and >= 0, at least one > 0."""
    if not isinstance(mixture, tuple) or not all(isinstance(m, tuple) and len(m) == 2 for m in mixture):
        raise InvalidArgument(f"mixture must be (source, weight) pairs, got {shown(mixture)}")
    if not mixture:
        return
    if dataset:
        raise InvalidArgument(f"a stream asks for one dataset or a mixture, not both: got dataset={shown(dataset)} "
                              "and a mixture")
    if len(mixture) > MAX_SOURCES:
        raise InvalidArgument(f"a mixture has at most {MAX_SOURCES} sources, got {len(mixture)}")
    seen = set()
    for name, weight in mixture:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable() \
                or _LONE_SURROGATE.search(name):
            raise InvalidArgument(f"mixture source names must be printable names of 1..{MAX_NAME} characters, "
                                  f"got {shown(name)}")
        if name in seen:
            raise InvalidArgument(f"mixture names source {shown(name)} twice; each source once, with one weight")
        seen.add(name)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight < 0:
            raise InvalidArgument(f"mixture weight of {shown(name)} must be a finite number >= 0, got {shown(weight)}")
    if not any(w > 0 for _, w in mixture):
        raise InvalidArgument(f"mixture weights must not all be 0, got {shown(dict(mixture))}")
    if not math.isfinite(sum(float(w) for _, w in mixture)):   # (normalized by an infinite sum, all would be 0)
        raise InvalidArgument(f"mixture weights must have a finite sum (they are normalized by it), got "
                              f"{shown(dict(mixture))}")


def _compression(name: str, value: str, level: int) -> None:
    if value not in COMPRESSIONS:
        raise InvalidArgument(f"{name} must be one of {', '.join(COMPRESSIONS)}, got {shown(value)}")
    if not _integer(level) or not INT32_MIN <= level <= INT32_MAX:
        raise InvalidArgument(f"compression level must be an integer, got {shown(level)}")
    if value == "zstd" and not -7 <= level <= 22:
        raise InvalidArgument(f"zstd level must be in [-7, 22], got {shown(level)}")


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
    # Not part of the samples: when the trainer process that opened the stream started (ns
    # since the epoch; 0: unknown), and whether the stream continues one the same client had
    # open. Together they fence a replaced trainer off its replacement's rank (Jobs.attach).
    client_started_ns: int = 0
    continued: bool = False
    # Not part of the samples either: a side stream, a second copy of batches the rank also reads
    # from another feeder (a hedged read or a probe; docs/guarantees.md). It takes no slot.
    hedge: bool = False
    # A mixture of named sources ((name, weight), in order; () = one dataset), the positions
    # of its epoch (0: the sources' samples summed, filled in by the feeder), and whether a
    # cursor of another mixture is re-dealt under this one (feeder.mixture).
    mixture: tuple[tuple[str, float], ...] = ()
    epoch_samples: int = 0
    remix: bool = False
    # A scheduled mixture's schedule (feeder.core.schedule's canonical JSON; "": fixed weights).
    # `mixture` then names its sources, with the first segment's weights.
    mixture_schedule: str = ""
    # The epoch's order (feeder.core.order.kinds()): torch's randperm as the client's torch release
    # draws it ("torch" from 2.7, "torch-legacy" before; "" from an older client), or "stateless".
    permutation: str = ""
    # Document-aware samples (docs/packing.md): "concat" (windows of the packed stream) or
    # "best_fit" (bins of whole documents, padded); and whether each batch carries where its
    # documents start (packed batches always do).
    packing: str = "concat"
    boundaries: bool = False
    # Model parallelism (docs/model-parallel.md). `rank`/`world_size` stay data-parallel: the
    # DistributedSampler deal is over them only. `members` processes consume one rank (its
    # tensor-parallel ranks, its first and last pipeline stages), each the same batches bit for
    # bit; each is its own slot (fenced, failed over and resumed on its own). A context-parallel
    # member (cp_rank of cp_size) receives only its positions of each sample (feeder.core.context).
    member: int = 0
    members: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    cp_layout: str = "zigzag"
    # Live elasticity (docs/elastic.md, feeder.core.steps): "" deals a fixed world (rank of
    # world_size); "constant" or "shrink" deals global steps over the replicas live at each
    # (rank of world_size are then this replica and the live replicas), `accumulation`
    # micro-batches per replica per step, a constant global batch sized for `start_replicas`,
    # from global step `first_step` (a cursor overrides it).
    global_batch: str = ""
    accumulation: int = 1
    start_replicas: int = 0
    first_step: int = 0

    def __post_init__(self):
        if not isinstance(self.job, str) or not 0 < len(self.job) <= MAX_NAME or not self.job.isprintable():
            raise InvalidArgument(f"job must be a printable name of 1..{MAX_NAME} characters, got {shown(self.job)}")
        _positive("world_size", self.world_size, upper=1 << 20)
        _non_negative("rank", self.rank)
        if self.rank >= self.world_size:
            raise InvalidArgument(f"rank must be < world_size ({self.world_size}), got {shown(self.rank)}")
        _positive("seq_len", self.seq_len, upper=MAX_SEQ_LEN)
        _positive("micro_batch", self.micro_batch, upper=MAX_MICRO_BATCH)
        _non_negative("seed", self.seed, upper=UINT64_MAX)
        _non_negative("client_started_ns", self.client_started_ns, upper=UINT64_MAX)
        _non_negative("epoch", self.epoch, upper=UINT32_MAX)
        _non_negative("num_epochs", self.num_epochs, upper=UINT32_MAX)
        if self.epoch + self.num_epochs > UINT32_MAX:
            raise InvalidArgument(f"epoch + num_epochs must be at most {UINT32_MAX} (epochs are uint32 on the wire), "
                                  f"got {self.epoch} + {self.num_epochs}")
        _mixture(self.mixture, self.dataset)
        if self.mixture_schedule:
            from feeder.core.schedule import check_spec   # (the schedule's rules live with it)

            check_spec(self.mixture_schedule, tuple(n for n, _ in self.mixture), self.remix)
        _non_negative("epoch_samples", self.epoch_samples, upper=MAX_EPOCH_SAMPLES)
        for flag in ("shuffle", "drop_last", "reshard", "continued", "hedge", "remix", "boundaries"):
            _flag(flag, getattr(self, flag))
        # "": the feeder chooses, and it may choose zstd at this level.
        _compression("compression", self.compression or "zstd", self.compression_level)
        _positive("num_workers", self.num_workers, upper=1024)
        _text("dataset", self.dataset, limit=MAX_NAME)
        _text("expected_fingerprint", self.expected_fingerprint)   # Kafka's lists every partition: no limit
        if self.permutation not in order.kinds():
            raise InvalidArgument(f"permutation must be torch or stateless (torch-legacy: torch before 2.7), "
                                  f"got {shown(self.permutation)}")
        # Which packings a feeder serves is its own (feeder.core.packing, registered there and by
        # the layers that build them): a name it lacks is refused when it plans the stream.
        if not isinstance(self.packing, str) or not 0 < len(self.packing) <= MAX_NAME or not self.packing.isprintable():
            raise InvalidArgument(f"packing must be the name of a packing (concat, best_fit, or one the feeder "
                                  f"registers), got {shown(self.packing)}")
        if self.packing != "concat" and not self.boundaries:   # a packing's documents are what it is for
            object.__setattr__(self, "boundaries", True)
        if self.bad_records not in BAD_RECORD_POLICIES:
            raise InvalidArgument(f"bad_records must be skip or fail (or empty for the source's default), "
                                  f"got {shown(self.bad_records)}")
        if not _integer(self.worker_index) or not 0 <= self.worker_index < self.num_workers:
            raise InvalidArgument(
                f"worker_index must be in [0, num_workers={self.num_workers}), got {shown(self.worker_index)}")
        if not _integer(self.worker_phase) or not 0 <= self.worker_phase < self.num_workers:
            raise InvalidArgument(
                f"worker_phase must be in [0, num_workers={self.num_workers}), got {shown(self.worker_phase)}")
        _positive("members", self.members, upper=MAX_MEMBERS)
        if not _integer(self.member) or not 0 <= self.member < self.members:
            raise InvalidArgument(f"member must be in [0, members={self.members}) (the index of this process among "
                                  f"those that consume data-parallel rank {self.rank}), got {shown(self.member)}")
        _positive("cp_size", self.cp_size, upper=MAX_CP)
        if not _integer(self.cp_rank) or not 0 <= self.cp_rank < self.cp_size:
            raise InvalidArgument(f"cp_rank must be in [0, cp_size={self.cp_size}), got {shown(self.cp_rank)}")
        if self.cp_layout not in LAYOUTS:
            raise InvalidArgument(f"cp_layout must be zigzag (Megatron's ring attention) or contiguous (Ulysses), "
                                  f"got {shown(self.cp_layout)}")
        why = divisibility(self.seq_len, self.cp_size, self.cp_layout)
        if why:
            raise InvalidArgument(why)
        self._check_elastic()

    def _check_elastic(self) -> None:
        if self.global_batch not in GLOBAL_BATCH:
            raise InvalidArgument(f"global_batch must be constant or shrink (or empty for a fixed world), "
                                  f"got {shown(self.global_batch)}")
        _positive("accumulation", self.accumulation, upper=MAX_MICRO_BATCH)
        _non_negative("first_step", self.first_step, upper=UINT64_MAX)
        _non_negative("start_replicas", self.start_replicas, upper=1 << 20)
        if not self.global_batch:
            return
        if self.global_batch == "constant" and self.start_replicas == 0:
            object.__setattr__(self, "start_replicas", self.world_size)
        # Each of these re-deals or splits a fixed world's stream; a step's part is dealt anew
        # over each step's live replicas instead.
        for flag in ("reshard", "remix"):
            if getattr(self, flag):
                raise InvalidArgument(f"{flag} does not apply to an elastic stream (global_batch="
                                      f"{self.global_batch}): every step is dealt over the replicas live at it")
        if self.num_workers != 1:
            raise InvalidArgument(f"an elastic stream (global_batch={self.global_batch}) is read by one process per "
                                  f"replica member, got num_workers={self.num_workers}; use num_workers=1")

    @property
    def elastic(self) -> bool:
        """Whether global steps are dealt over the replicas live at each (feeder.core.steps)."""
        return bool(self.global_batch)

    @property
    def end_epoch(self) -> int:
        """One past the last epoch; an unbounded stream (num_epochs=0) runs through the last
        epoch the wire and the cursor can name (2**32 - 1) and then ends."""
        return UINT32_MAX + 1 if self.num_epochs == 0 else self.epoch + self.num_epochs


# NAME=DATASET: a name is any printable text without "=" or "/" (so no path is read as one).
_NAMED = re.compile(r"([^=/]+)=(.+)", re.S)


def named_sources(values: list[str]) -> dict:
    """`--source` values (or a region file's): one unnamed DIR|URL, or NAME=DIR|URL each, as
    ServeConfig's `source` or `sources`."""
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise InvalidArgument(f"source must be a dataset or a list of NAME=DATASET, got {shown(values)}")
    named = [_NAMED.fullmatch(v) for v in values]
    if len(values) == 1 and (not named[0] or os.path.exists(values[0])):   # a directory named date=2024-01-01
        return {"source": values[0]}
    unnamed = [v for v, m in zip(values, named) if not m]
    if unnamed:
        why = " (a name may not hold '/')" if "/" in unnamed[0].partition("=")[0] and "=" in unnamed[0] else ""
        raise InvalidArgument(f"with several sources each needs a name: --source NAME=DIR|URL, got "
                              f"{shown(unnamed[0])}{why}")
    return {"sources": tuple((m.group(1), m.group(2)) for m in named)}


@dataclass(frozen=True, kw_only=True)
class PackingConfig:
    """How best-fit bins are built. `block_tokens` is part of the packing's identity (the bins
    depend on it); `workers` is not (any number builds the same bytes)."""

    # 2^30 tokens: ~10^6 web documents per block (some 15 MB of bins, ~0.3 s to pack), so a
    # build's memory is a few blocks whatever the corpus, SIGTERM is heard within a block, and
    # a block's padding is that of a whole-corpus pass to within 0.01 percentage point (docs/scale.md).
    block_tokens: int = 1 << 30
    workers: int = 0                  # threads packing blocks in this process; 0: one per core it may use

    def __post_init__(self):
        if self.block_tokens < 1:
            raise InvalidArgument(f"block_tokens: got {self.block_tokens}, expected >= 1")
        if self.workers < 0:
            raise InvalidArgument(f"workers: got {self.workers}, expected >= 0 (0: one per core)")

    def threads(self, n_blocks: int) -> int:
        return max(1, min(n_blocks, self.workers or len(os.sched_getaffinity(0))))


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    source: str = ""             # one dataset, named after its directory or topic
    # Or several, by name (`--source NAME=DIR|URL`, repeated): a stream asks for one by name
    # (`dataset`), or for a mixture of them; the first is the default.
    sources: tuple[tuple[str, str], ...] = ()
    listen: str = "127.0.0.1:7070"
    region: str = "local"
    # Per-stream prefetch: at most this many messages and bytes wait in the queue.
    prefetch_messages: int = 8
    prefetch_bytes: int = 32 << 20
    # The members of a model-parallel rank share one window of its messages, built once: the
    # newest this many bytes of them (a member further behind reads on its own).
    member_window_bytes: int = 64 << 20

    @property
    def window_bytes(self) -> int:
        """A rank's window holds at least the fastest member's prefetch and one message more."""
        return max(self.member_window_bytes, self.prefetch_bytes + 2 * self.message_bytes)
    # Several micro-batches are packed into one message up to this size: Python gRPC
    # moves far more bytes/s with ~1 MiB messages than with small ones.
    message_bytes: int = 1 << 20
    default_compression: str = "zstd"
    default_level: int = 3
    threads: int = 4
    cursor_secret: bytes = field(default=b"", repr=False)
    grace_s: float = 10.0
    vocab_size: int = 0          # only for datasets without manifest.json that do not record it
    eos_id: int = -1
    # Corpora in other tools' formats (feeder.sources.formats): the token column (HF, MDS), the
    # token width (nanoGPT .bin, MDS bytes column), the `feeder index` sidecar if not beside the data.
    column: str = ""
    token_dtype: str = ""
    index: str = ""
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
    # Share the port with other feeder processes started separately (SO_REUSEPORT), as the
    # siblings of `--processes` do. Off by default: a feeder started twice on one port, say
    # with other data, must fail to bind rather than get half the connections.
    reuse_port: bool = False
    # What is built once and shared by every process and feeder that can read it: epoch orders
    # of torch's kind (under orders/) and Kafka epoch snapshots (under kafka/). On the region's
    # shared filesystem, each is built once per region. "": orders in the user's cache
    # ($XDG_CACHE_HOME/feeder, else ~/.cache/feeder), snapshots where the Kafka URL's spool says.
    cache_dir: str = ""
    cache_max_gb: float = 64.0
    # How best-fit bins are built (block size, threads): the defaults, but for tests and embeddings.
    packing: PackingConfig = PackingConfig()
    # The background scrub (feeder.scrub): MB/s of verified, memory-mapped chunks re-hashed, so
    # a byte changed on disk after its chunk's first read is found and never served again. 0: off.
    scrub_mb_s: float = 16.0
    # The process's budget for messages built ahead of what its peers read, over all its streams
    # and members' windows (feeder.pipeline.stream.MemoryBudget): past half of it streams queue
    # one message each (their read-ahead shrinks), past all of it new streams get
    # RESOURCE_EXHAUSTED. 0: fitted to the host (an eighth of its or its cgroup's memory,
    # shared by the --processes, 64 MiB to 16 GiB).
    memory_budget_mb: float = 0.0
    # A source read (a stream's next message being built) that has not returned for this long is
    # stuck (a hung filesystem): its streams end UNAVAILABLE so their ranks move, new streams of
    # its sources are refused here while it lasts, and status, metrics and the log say so.
    stuck_after_s: float = 10.0

    def __post_init__(self):
        if isinstance(self.memory_budget_mb, bool) or not isinstance(self.memory_budget_mb, (int, float)) \
                or not 0 <= self.memory_budget_mb < 2**31:
            raise InvalidArgument("memory_budget_mb must be a non-negative number of MiB (0: fitted to the host), "
                                  f"got {shown(self.memory_budget_mb)}")
        if bool(self.source) == bool(self.sources):
            raise InvalidArgument("serve needs one dataset (source) or several named ones (sources), got "
                                  f"{'both' if self.source else 'neither'}")
        names = [n for n, _ in self.sources]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"source names must be unique, got {names}")
        for name, where in self.sources:
            if not _NAMED.fullmatch(f"{name}={where}") or len(name) > MAX_NAME or not name.isprintable():
                raise InvalidArgument(f"a source needs a printable name without = or / and a dataset, got "
                                      f"{shown(name)}={shown(where)}")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise InvalidArgument(f"listen must be HOST:PORT, got {shown(self.listen)}")
        _positive("prefetch_messages", self.prefetch_messages)
        _positive("prefetch_bytes", self.prefetch_bytes)
        _positive("member_window_bytes", self.member_window_bytes)
        _positive("message_bytes", self.message_bytes, upper=64 << 20)
        _compression("default_compression", self.default_compression, self.default_level)
        _positive("threads", self.threads, upper=256)
        _positive("processes", self.processes, upper=256)
        if isinstance(self.cache_max_gb, bool) or not isinstance(self.cache_max_gb, (int, float)) \
                or not 0 < self.cache_max_gb < float("inf"):
            raise InvalidArgument(f"cache_max_gb must be a positive number of GiB, got {shown(self.cache_max_gb)}")
        if isinstance(self.stuck_after_s, bool) or not isinstance(self.stuck_after_s, (int, float)) \
                or not 0 < self.stuck_after_s < float("inf"):
            raise InvalidArgument(f"stuck_after_s must be a positive number of seconds, got {shown(self.stuck_after_s)}")
        if isinstance(self.scrub_mb_s, bool) or not isinstance(self.scrub_mb_s, (int, float)) \
                or not 0 <= self.scrub_mb_s < float("inf"):
            raise InvalidArgument(f"scrub_mb_s must be a non-negative number (0: off), got {shown(self.scrub_mb_s)}")
        if self.metrics_listen:
            mhost, msep, mport = self.metrics_listen.rpartition(":")
            if not msep or not mport.isdigit() or int(mport) > 65535:
                raise InvalidArgument(f"metrics_listen must be HOST:PORT, got {shown(self.metrics_listen)}")
        if self.log_format not in ("text", "json"):
            raise InvalidArgument(f"log_format must be text or json, got {shown(self.log_format)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("TLS needs both tls_cert and tls_key (--tls-cert/--tls-key), got only "
                                  f"{'tls_cert' if self.tls_cert else 'tls_key'}")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("tls_client_ca (mutual TLS) needs tls_cert and tls_key too")
        if not isinstance(self.remote_rtt_ms, (int, float)) or self.remote_rtt_ms < 0:
            raise InvalidArgument(f"remote_rtt_ms must be a non-negative number, got {shown(self.remote_rtt_ms)}")
        if not isinstance(self.peers, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) and x for x in p) for p in self.peers):
            raise InvalidArgument(f"peers must be (region, HOST:PORT) pairs, got {shown(self.peers)}")
        from feeder.core.net import is_loopback

        for what, address in (("listen", self.listen), ("metrics_listen", self.metrics_listen)):
            if address and not self.tls_cert and not self.insecure and not is_loopback(address.rpartition(":")[0]):
                raise InvalidArgument(
                    f"{what} {address} is beyond loopback and would be plain text: give --tls-cert and --tls-key "
                    "(TLS), or --insecure to serve plain text anyway")
        # The development key is in the source: beyond loopback anyone could forge cursors
        # with it (resume another job's stream, skip or repeat data), so it is never a default there.
        if not self.cursor_secret and not is_loopback(self.listen.rpartition(":")[0]):
            raise InvalidArgument(
                f"listen {self.listen} is beyond loopback and no cursor secret was given (the development key is "
                "public): give --cursor-secret-file FILE (or FEEDER_CURSOR_SECRET), shared by every feeder of the "
                "deployment")

    @property
    def cache(self) -> str:
        """The cache directory in use."""
        return self.cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "feeder")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def replace(self, **changes) -> "ServeConfig":
        return dataclasses.replace(self, **changes)


def load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"{path} is not valid TOML: {e}") from None
