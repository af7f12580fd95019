"""The sampling key: the one definition of the fields that decide a rank's samples.

Pure (no I/O). Three things derive from it, so a field added here reaches all three:
  * the job key: what every rank of one job must share, or a feeder refuses the rank
    (pipeline.jobs.Jobs);
  * what a cursor records (feeder.cursor.Cursor has these fields; tests/test_core.py checks);
  * the mismatch message when a cursor does not fit the stream it is sent with
    (planning.StreamPlan, and Kafka's follow plan).
"""
from __future__ import annotations

from feeder.core import packing
from feeder.core.config import StreamSpec
from feeder.core.errors import FailedPrecondition

# The epoch's order and its samples (with the dataset's fingerprint). `permutation` as the plan
# agreed it (feeder.order.agreed): "" wherever the torch releases' orders are the same.
SAMPLES = ("seq_len", "seed", "shuffle", "drop_last", "permutation")
# Which of them are this rank's.
DEAL = ("world_size", "rank")
# How many batches each rank gets: ranks that disagree run different numbers of steps, and
# the ones that finish first leave the others hanging in their collectives.
BATCHES = ("micro_batch", "epoch", "num_epochs")

# What every rank of a job must share.
# `packing` decides the samples too, but through the fingerprint a plan gives its cursors (a
# packed stream's is its packing's: feeder.sources.packed); `boundaries` decides what a batch
# carries, and ranks of one model must see the same.
# An elastic job (live replicas, feeder.core.steps) shares its policy, accumulation and the world
# its constant global batch is sized for; its live world changes from step to step.
ELASTIC = ("global_batch", "accumulation", "start_replicas")
JOB = ("dataset", "mixture", "mixture_schedule", "epoch_samples", "world_size", *SAMPLES, *BATCHES, "packing", "boundaries", *ELASTIC)
# What a cursor records of the stream that wrote it, and a resumed stream must match
# (world_size and rank only without reshard: re-dealing to another world is what reshard is for).
CURSOR = ("job", "fingerprint", *SAMPLES, *DEAL)


def job_key(spec: StreamSpec) -> tuple:
    """The values of JOB, in order (an elastic job's world_size is its live world's: not shared)."""
    return tuple(0 if name == "world_size" and spec.elastic else getattr(spec, name) for name in JOB)


def job_mismatch(job: str, running: tuple, asked: tuple) -> FailedPrecondition:
    """The refusal of a rank whose job key differs from the one its job runs with."""
    name, ours, theirs = next((n, a, b) for n, a, b in zip(JOB, running, asked) if a != b)
    if name == "world_size" and 0 in (ours, theirs):   # (an elastic job's key has no world)
        said = {True: "with live elasticity (global_batch)", False: "with a fixed world (no global_batch)"}
        return FailedPrecondition(f"job {job!r} is running {said[ours == 0]}; this stream asks for "
                                  f"{'live elasticity' if theirs == 0 else 'a fixed world'}. Every rank of a job "
                                  "must agree.")
    hint = ""
    if name == "permutation":   # "": torch's, where every release draws the same (feeder.order.agreed)
        ours, theirs = ours or "torch", theirs or "torch"
    if name == "permutation" and {ours, theirs} <= {"torch", "torch-legacy"}:
        hint = (" The ranks' torch versions differ: torch before 2.7 ('torch-legacy') and from 2.7 ('torch') shuffle "
                "this many samples differently, so the ranks would not share one order; install one torch release "
                "on every rank (or choose permutation='stateless').")
    return FailedPrecondition(f"job {job!r} is running with {name}={ours!r}; this stream asks for "
                              f"{name}={theirs!r}. Every rank of a job must agree.{hint}")


def cursor_mismatch(cursor, spec: StreamSpec, fingerprint: str, *, fields: tuple[str, ...] | None = None
                    ) -> FailedPrecondition | None:
    """Why `cursor` cannot resume the stream `spec` over data `fingerprint` (None: it fits).

    `fields`: those to compare, in order; by default all of CURSOR, less DEAL when the
    request reshards. A plan whose samples depend on fewer (Kafka follow: no order to
    shuffle) passes its own and gets no reshard hint. A fingerprint that differs is this
    replica's problem, not the job's: the error says another feeder may serve it."""
    reshardable = fields is None
    if fields is None:
        fields = tuple(n for n in CURSOR if not (spec.reshard and n in DEAL))
    for name in fields:
        theirs = getattr(cursor, name)
        ours = fingerprint if name == "fingerprint" else getattr(spec, name)
        if theirs != ours:
            kinds = (packing.of_fingerprint(theirs), packing.of_fingerprint(ours)) if name == "fingerprint" else ()
            if kinds and kinds[0] != kinds[1]:   # not another replica's data
                return FailedPrecondition(f"cursor does not fit this stream: packing differs: the cursor is of "
                                          f"{kinds[0]} samples, the request asks for {kinds[1]}")
            if name == "permutation":   # "": torch's, where every release draws the same (feeder.order.agreed)
                theirs, ours = theirs or "torch", ours or "torch"
            shown = "dataset fingerprint" if name == "fingerprint" else name
            hint = " (set reshard to re-deal the epoch's remaining samples over a new world size)" \
                if reshardable and name in DEAL else ""
            return FailedPrecondition(f"cursor does not fit this stream: {shown} differs: the cursor has "
                                      f"{theirs!r}, the request has {ours!r}{hint}",
                                      elsewhere=name == "fingerprint")
    return None
