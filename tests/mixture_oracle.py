"""An oracle for mixtures, written from the README's rules ("Mixtures"), not from the feeder's
code: torch's DistributedSampler for the positions, Megatron-LM's blending loop (transcribed
from megatron/core/datasets/helpers.cpp) for each position's source, torch.randperm for each
source's permutations. Used by tests/test_mixture.py and tests/test_properties.py."""
from __future__ import annotations

import functools
import hashlib
from collections import Counter
from fractions import Fraction

import numpy as np
import torch

from tests.helpers import reference_ids, reference_slice

# Epochs up to this many slots are blended by the loop itself; larger ones by PeriodicBlend.
LISTED = 1 << 22


def megatron_blend(weights, size):
    """Megatron-LM's build_blending_indices, transcribed: (source, draw) of each slot."""
    w = np.array(weights, dtype=np.float64)
    w = (w / np.sum(w)).tolist()
    current = [0] * len(w)
    index, draw = [], []
    for i in range(size):
        x = max(float(i), 1.0)
        best, err = 0, w[0] * x - current[0]
        for d in range(1, len(w)):
            e = w[d] * x - current[d]
            if e > err:
                best, err = d, e
        index.append(best)
        draw.append(current[best])
        current[best] += 1
    return index, draw


class PeriodicBlend:
    """megatron_blend at any slot of an epoch of any size, for weights whose normalized values
    are dyadic (k / 2^m): the loop's every comparison w_j·x − c_j is then exact in float64, so
    from slot 1 on (x = i) the error vector follows e(i+1) = e(i) + w − 1[chosen] alone, and
    once it repeats (found by running the loop itself), the slots repeat with it. Slot p is
    then the loop's slot in the first cycle plus whole cycles of draws: no 10^9-slot loop."""

    def __init__(self, weights, limit: int = 1 << 16):
        w = np.array(weights, dtype=np.float64)
        w = (w / np.sum(w)).tolist()
        exact = [Fraction(x) for x in w]
        if any(f.denominator & (f.denominator - 1) or f.denominator > (1 << 20) for f in exact):
            raise ValueError(f"weights {weights} do not normalize to dyadic fractions: no closed form here")
        self.index, self.draw = megatron_blend(weights, limit)
        seen: dict[tuple, int] = {}
        counts = [0] * len(w)
        for i in range(limit):
            if i >= 1:
                key = tuple(exact[j] * i - counts[j] for j in range(len(w)))
                if key in seen:
                    self.start, self.period = seen[key], i - seen[key]
                    break
                seen[key] = i
            counts[self.index[i]] += 1
        else:
            raise ValueError(f"the blending of {weights} does not repeat within {limit} slots")
        first = Counter(self.index[self.start:self.start + self.period])
        self.per_cycle = [first[j] for j in range(len(w))]

    def at(self, p: int) -> tuple[int, int]:
        """(source, draw) of slot p."""
        if p < self.start + self.period:
            return self.index[p], self.draw[p]
        q, r = divmod(p - self.start, self.period)
        d = self.index[self.start + r]
        return d, self.draw[self.start + r] + q * self.per_cycle[d]

    def counts(self, n: int) -> list[int]:
        """How many of slots [0, n) each source fills."""
        out = [0] * len(self.per_cycle)
        if n <= self.start + self.period:
            for d in self.index[:n]:
                out[d] += 1
            return out
        q, r = divmod(n - self.start, self.period)
        for d in self.index[:self.start + r]:
            out[d] += 1
        return [o + q * c for o, c in zip(out, self.per_cycle)]


@functools.lru_cache(maxsize=4096)
def source_perm(n, seed, name, cycle, shuffle, permutation="torch"):
    if not shuffle:
        return tuple(range(n))
    s = (seed + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")) % (1 << 63)
    if permutation == "stateless":
        from feeder.core.order import Stateless

        return tuple(Stateless(n, s + cycle)[list(range(n))].tolist())
    return tuple(torch.randperm(n, generator=torch.Generator().manual_seed(s + cycle)).tolist())


class Oracle:
    """What a rank must get, epoch by epoch, for one mixture that never changes."""

    def __init__(self, names, sizes, weights, n, seed, shuffle, drop_last, permutation="torch"):
        self.names, self.sizes, self.n, self.permutation = names, sizes, n, permutation
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        if n <= LISTED:
            self.index, self.draw = megatron_blend(weights, n)
            self.per_epoch = Counter(self.index)
            self.blend = None
        else:   # too many slots to list: the closed form (dyadic weights only)
            self.blend = PeriodicBlend(weights)
            self.per_epoch = dict(enumerate(self.blend.counts(n)))

    def slot(self, p):
        return self.blend.at(p) if self.blend else (self.index[p], self.draw[p])

    def fill(self, epoch, p):
        d, draw = self.slot(p)
        k = epoch * self.per_epoch[d] + draw
        cycle, r = divmod(k, self.sizes[d])
        return d, source_perm(self.sizes[d], self.seed, self.names[d], cycle, self.shuffle, self.permutation)[r]

    def rank(self, world, rank, epoch, start=0, stop=None):
        """(source, id) of the rank's samples [start:stop] of the epoch."""
        pos = reference_slice(self.n, world, rank, shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
                              epoch=epoch, permutation=self.permutation, start=start, stop=stop)
        return [self.fill(epoch, p) for p in pos]

    def fills(self, epoch):
        """(source, id) of every position of the epoch, in position order."""
        if self.blend:
            raise ValueError(f"an epoch of {self.n} slots is not listed: ask for a rank's slice")
        return [self.fill(epoch, p) for p in range(self.n)]


def remixed_rank(names, sizes, old_w, new_w, n, *, world, rank, base, seed, epochs):
    """{epoch: [(source, id)]} a rank gets after a remix from `old_w` (over the first names) to
    `new_w` (over all) once `base` positions of epoch 0 were consumed (shuffle on, drop_last off,
    torch's order; README "Mixtures", Curriculum): the rest of epoch 0's order dealt as
    DistributedSampler deals a list, each remaining position's source by Megatron's rule over
    the remaining positions in ascending order, each source's draws after every draw the old
    mixture made in the epoch; later epochs wholly under the new weights."""
    old_index, _ = megatron_blend(old_w, n)
    draws = [old_index.count(d) for d in range(len(names))]      # the old mixture's draws in epoch 0, all skipped
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    rest = order[base:]
    slot = {p: j for j, p in enumerate(sorted(rest))}
    r_index, r_draw = megatron_blend(new_w, len(rest))
    f_index, f_draw = megatron_blend(new_w, n)

    def fill(d, k):
        cycle, r = divmod(k, sizes[d])
        return d, source_perm(sizes[d], seed, names[d], cycle, True)[r]

    after_rest = [draws[d] + r_index.count(d) for d in range(len(names))]
    per = -(-len(rest) // world)
    padded = (rest * 2)[:per * world]
    out = {0: [fill(r_index[slot[p]], draws[r_index[slot[p]]] + r_draw[slot[p]]) for p in padded[rank::world]]}
    for e in range(1, epochs):
        pos = reference_ids(n, world, rank, shuffle=True, seed=seed, drop_last=False, epoch=e)
        out[e] = [fill(f_index[p], after_rest[f_index[p]] + (e - 1) * f_index.count(f_index[p]) + f_draw[p])
                  for p in pos]
    return out
