"""The seam between sources and the pipeline: `Source` and the `Plan` it makes per stream.

A source presents one packed token stream (its Info: name, fingerprint, sizes, dtype) and,
for each rank's stream, makes a Plan: the rank's batches as runs (`PlannedRun`), or `PENDING`
while its next run is not ready, and where each run's rows lie (`Plan.locate`). The pipeline
(feeder.pipeline.stream) knows nothing else about a source: one build path takes runs, reads
their rows, writes cursors and frames messages, whatever the source.

Sources here: `posix.PosixSource` (shards on any POSIX path; its plans are `StreamPlan`s) and
`kafka.KafkaSource` (a bounded epoch's snapshot is served by a StreamPlan over it; a follow
stream by `kafka.follow.FollowPlan`, which reads and packs records itself). A new source
implements both protocols in full; tests/test_seam.py checks each against them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Protocol, runtime_checkable

import numpy as np

from feeder.core import packing
from feeder.core.config import PackingConfig, StreamSpec
from feeder.core.cursor import Cursor
from feeder.core.layout import Bounds
from feeder.core.planning import Pending, PlanBase, PlannedRun, Start
from feeder.core.rows import Rows
from feeder.sources import kafka_positions  # noqa: F401  (registers Kafka's cursor positions)
from feeder.sources import packed  # noqa: F401  (registers the best_fit packing)


@runtime_checkable
class Plan(Protocol):
    """One rank's stream, as the source planned it. Made by `Source.plan`, used from one
    thread at a time (the pipeline's producer), closed when the stream ends.

    What every plan must do; a plan also derives from `PlanBase` (feeder.core.planning), which
    has the rest with defaults (`executor`, `lag`, `bad_records`, `waiting`, `taken`, `close`)
    for the plans that differ to override (tests/test_seam.py checks both)."""

    spec: StreamSpec
    n: int               # samples in an epoch (0: unbounded, Kafka follow)
    fingerprint: str     # of the data this stream reads (carried in every cursor)
    start: Start         # where the stream starts (for logs)
    dtype: np.dtype      # of the tokens

    def runs(self, max_batches: int) -> Iterator[PlannedRun | Pending]:
        """The stream's batches as runs of at most `max_batches` batches of one epoch, in
        order; PENDING when the next is not ready yet. May raise FeederError (a bad record)."""

    def locate(self, starts: np.ndarray, n: int) -> Rows | np.ndarray:
        """Where rows [starts[i], starts[i] + n) lie (for runs that carry no tokens)."""

    def boundaries(self, starts: np.ndarray, n: int) -> Bounds:
        """Where documents start inside rows [starts[i], starts[i] + n) (asked only of streams
        with boundaries; a plan that cannot know them refuses such a stream when it is made)."""

    def cursor_template(self) -> Cursor:
        """A cursor with the stream's fixed fields (the pipeline writes the moving ones)."""


@dataclass(frozen=True)
class Context:
    """What a server hands every `Source.plan`: where what is built once lives. Nothing of it is
    process-wide, so two servers in one process (tests, benchmarks, an embedding) keep theirs
    apart."""

    cache_dir: str = ""          # best-fit sidecars under <cache_dir>/packing ("": the user's cache)
    orders: object = None        # the order store (get, prepare) of large torch orders; None: drawn in memory
    packing: PackingConfig = PackingConfig()   # how best-fit bins are built (block size, threads)
    schedules: object = None     # scheduled mixtures' books (feeder.domain.schedules); None: the process's own
    # Set when the server stops (SIGTERM): its builds (a packing's blocks) end within a block.
    stopping: threading.Event = field(default_factory=threading.Event, compare=False)


NO_CONTEXT = Context()


@runtime_checkable
class Source(Protocol):
    """A dataset a feeder serves: its Info, and the Plan of each rank's stream."""

    name: str
    fingerprint: str
    n_tokens: int        # 0 where unknown until a job freezes its epoch (Kafka)
    n_documents: int
    vocab_size: int
    eos_id: int
    dtype: np.dtype

    def plan(self, spec: StreamSpec, cursor: Cursor | None, ctx: Context = NO_CONTEXT) -> Plan:
        """The plan of one rank's stream, resumed after `cursor` (verified) if given, with what
        the server keeps (`ctx`: its cache directory and order store). May block
        (a Kafka snapshot is built, metadata read): the engine calls it off the event loop.
        Raises FeederError: WrongReplica when this is not the data the job reads,
        FailedPrecondition when the cursor does not fit the request."""

    def close(self) -> None:
        """The feeder is stopping: let go of clients and files."""


@runtime_checkable
class PerJob(Protocol):
    """A source whose data a job fixes when it starts, not the feeder once (a Kafka topic: its
    size is 0 until then). How a mixture (sources/mixture.py) takes one: a bounded topic as the
    job's frozen epoch of it, a source of fixed size like any other; a tailed one only with
    other tailed ones, record by record (`interleave`)."""

    tailed: bool   # followed without end: no epoch to freeze

    def epoch(self, spec: StreamSpec, pinned: str = "") -> tuple[str, Source]:
        """(the text naming the job's epoch of it, that epoch as a source of fixed size, with
        `bad_records`: the records it skipped); `pinned` is that text from a cursor ("" for a
        job's first stream). May block (a snapshot is built)."""

    def hold(self, job: str, epoch: str) -> object:
        """Keep the job's epoch agreed while the returned token lives (a stream is open)."""

    def release(self, job: str, token: object) -> None:
        """The stream that held `token` closed."""

    def interleave(self, names: tuple[str, ...], weights: tuple[float, ...], sources: list, spec: StreamSpec,
                   cursor: Cursor | None) -> Plan:
        """The plan of a mixture of the tailed `sources` (this one among them)."""


@runtime_checkable
class ChunkTable(Protocol):
    """A source whose tokens lie in chunks it can hand out (a PosixSource, the formats): the
    sources of a mixture that all are, are located as one table (feeder.sources.posix.locate_rows)."""

    chunk_starts: np.ndarray   # int64 [chunks + 1]: chunk k covers tokens [chunk_starts[k], chunk_starts[k + 1])
    n_tokens: int
    dtype: np.dtype

    def chunk(self, k: int) -> np.ndarray:
        """Chunk k's tokens (may raise DataLoss)."""

    def read(self, start: int, out: np.ndarray) -> None:
        """Tokens [start, start + len(out)) into out, across chunks."""


@runtime_checkable
class Documents(Protocol):
    """A source that can say where its documents lie, a token range at a time: what best-fit
    packing (feeder.sources.packed) reads, block by block, in bounded memory. PosixSource and
    the formats implement it, from the format's own table where it has one (Megatron's index)."""

    n_tokens: int

    def doc_spans(self, lo: int, hi: int) -> tuple[np.ndarray, int]:
        """(starts, end): the sorted int64 starts of the documents that start in tokens [lo, hi),
        and where the last of them ends (the next document's start, or n_tokens)."""


@runtime_checkable
class PackedSamples(Protocol):
    """What a packing kind's wrap (feeder.core.packing) returns over a source: the table a plan
    reads the stream's samples from. Sample i is addressed as concat's window i, rows
    [i·seq_len, i·seq_len + seq_len + 1), so dealing, cursors and resume are one code path."""

    n_samples: int
    fingerprint: str     # the cursors': begins with the kind's prefix
    dtype: np.dtype

    def locate(self, starts: np.ndarray, n: int) -> Rows | np.ndarray:
        """The samples whose rows start at `starts` (multiples of seq_len), n = seq_len + 1 tokens each."""

    def boundaries(self, starts: np.ndarray, n: int) -> Bounds:
        """Where their documents start, and where their padding begins."""


def packed_samples(source, spec: StreamSpec, ctx: Context) -> PackedSamples | None:
    """`source`'s samples under the stream's packing: the kind's table over it, or None for
    concat (the source's own windows). InvalidArgument for a packing this feeder lacks."""
    kind = packing.get(spec.packing)
    return kind.wrap(source, spec.seq_len, ctx) if kind.wrap is not None else None


__all__ = ["ChunkTable", "Context", "Documents", "NO_CONTEXT", "PackedSamples", "PerJob", "Plan", "PlanBase", "Source",
           "Pending", "PlannedRun", "Start", "Rows", "packed_samples"]
