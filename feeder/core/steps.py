"""Live elasticity: a global step's part for one of the replicas live at that step.

Pure (numpy only). The unit dealt is the micro-batch; a step is `accumulation` (A) of them per
replica, and where a step lies in the epoch's order depends on the policy:

* constant (the default): the global batch is G = micro_batch * A * W0 samples for the W0
  replicas the job started with, whatever the live world. Step t of an epoch is exactly what
  W0 ranks of DistributedSampler(num_replicas=W0) consume in their micro-batches t*A .. t*A+A-1:
  rank q's micro-batch t*A + k is *unit* u = k*W0 + q, and the live replicas take the units
  round robin (replica r of W: u = r, r + W, ...; some get one more). With W == W0 replica r
  gets exactly rank r's micro-batches, in order: DistributedSampler's ids. A step's positions
  never depend on the worlds before it, so any feeder answers "step S, replica r of W" alone.
* shrink (torchft's default): each live replica keeps micro_batch * A samples, so the global
  batch follows the world. A world of W deals a *segment* (base, W) of the epoch's order with
  DistributedSampler's rules (feeder.core.sampler), A micro-batches of each rank's list a step;
  a new world starts a new segment where the last committed step ended (base + W_old * pos).
  Where step S begins is then carried by the cursor after step S - 1's commit.

Either way a step that did not commit is asked again and dealt again, whole, over the replicas
live at its next attempt: every sample of an epoch is trained in exactly one committed step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from feeder.core import sampler


@dataclass(frozen=True)
class Part:
    """A replica's part of one global step: its micro-batches and the step's size."""
    epoch: int
    step: int               # the global step
    ids: np.ndarray         # int64 [sum(counts)]
    counts: list[int]       # samples of each micro-batch (one entry of 0: nothing in this step)
    step_samples: int       # samples of the whole step over every live replica (loss denominator)

    @property
    def parts(self) -> int:
        return sum(1 for c in self.counts if c)


def steps_per_epoch(per: int, micro_batch: int, accumulation: int) -> int:
    """Steps of an epoch whose ranks each hold `per` samples (the last may be short)."""
    return -(-per // (micro_batch * accumulation))


def constant_units(per: int, t: int, micro_batch: int, accumulation: int, start_replicas: int) -> tuple[int, int]:
    """(units, span) of step t of an epoch under a constant global batch: its micro-batches
    over all ranks, and the samples each of the W0 ranks' lists gives it."""
    span = max(0, min(per - t * micro_batch * accumulation, micro_batch * accumulation))
    return -(-span // micro_batch) * start_replicas, span


def units_of(replica: int, replicas: int, units: int) -> range:
    """The units a replica takes of a step's `units`, round robin."""
    return range(replica, units, replicas)


def constant_part(order, *, n: int, epoch: int, t: int, step: int, replica: int, replicas: int,
                  start_replicas: int, micro_batch: int, accumulation: int, drop_last: bool) -> Part:
    """Replica `replica` of `replicas`'s part of step t of the epoch (global step `step`)."""
    w0, mb = start_replicas, micro_batch
    per = sampler.per_rank(n, w0, drop_last)
    units, span = constant_units(per, t, mb, accumulation, w0)
    first = t * mb * accumulation
    got, counts = [], []
    for u in units_of(replica, replicas, units):
        k, q = divmod(u, w0)
        a = first + k * mb
        ids = sampler.rank_ids(order, base=0, world=w0, rank=q, drop_last=drop_last, start=a,
                               stop=min(a + mb, first + span))
        got.append(ids)
        counts.append(len(ids))
    return _part(epoch, step, got, counts, w0 * span)


def shrink_part(order, *, n: int, epoch: int, base: int, pos: int, step: int, replica: int, replicas: int,
                micro_batch: int, accumulation: int, drop_last: bool) -> Part:
    """Replica `replica` of `replicas`'s part of the step that starts at position `pos` of every
    rank's list in segment (base, replicas) (pos a multiple of micro_batch * accumulation)."""
    mb = micro_batch
    per = sampler.per_rank(n - base, replicas, drop_last)
    span = max(0, min(per - pos, mb * accumulation))
    got, counts = [], []
    for a in range(pos, pos + span, mb):
        ids = sampler.rank_ids(order, base=base, world=replicas, rank=replica, drop_last=drop_last, start=a,
                               stop=min(a + mb, pos + span))
        got.append(ids)
        counts.append(len(ids))
    return _part(epoch, step, got, counts, replicas * span)


def _part(epoch: int, step: int, got: list, counts: list[int], step_samples: int) -> Part:
    if not counts:   # a replica beyond the step's units: one empty batch says so
        return Part(epoch=epoch, step=step, ids=np.empty(0, dtype=np.int64), counts=[0], step_samples=step_samples)
    return Part(epoch=epoch, step=step, ids=np.concatenate(got) if len(got) > 1 else got[0], counts=counts,
                step_samples=step_samples)
