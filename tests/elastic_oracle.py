"""The oracle of live elasticity (feeder.core.steps), written from torch's DistributedSampler
alone: what each committed step must hold, under either policy. tests/test_elastic.py and the
chaos harness's elastic scenarios (tests/chaos/elastic.py) judge against it."""
from __future__ import annotations

from collections import Counter

import numpy as np
from torch.utils.data import DistributedSampler

from feeder.core.order import Stateless


def epoch_order(n: int, seed: int, epoch: int, permutation: str, shuffle: bool) -> list[int]:
    """The epoch's order as torch's DistributedSampler draws it (one replica: no padding)."""
    if not shuffle:
        return list(range(n))
    if permutation == "stateless":
        return Stateless(n, seed + epoch)[np.arange(n)].tolist()
    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    s.set_epoch(epoch)
    return list(s)


def ds_list(m: int, world: int, rank: int, drop_last: bool) -> list[int]:
    """DistributedSampler's (unshuffled) list of rank over m positions: indices into a segment."""
    return list(DistributedSampler(range(m), num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last))


class Oracle:
    """What each committed step must hold, derived from DistributedSampler alone."""

    def __init__(self, *, n, w0, mb, acc, drop_last, seed, permutation, shuffle, policy):
        self.n, self.w0, self.mb, self.acc, self.drop_last = n, w0, mb, acc, drop_last
        self.order = lambda e: epoch_order(n, seed, e, permutation, shuffle)
        self.policy = policy
        self.epoch, self.base, self.world, self.pos = 0, 0, None, 0   # shrink: the committed segment

    def constant(self, step: int) -> tuple[int, Counter]:
        lists = [ds_list(self.n, self.w0, q, self.drop_last) for q in range(self.w0)]
        per = len(lists[0])
        spe = -(-per // (self.mb * self.acc))
        epoch, t = divmod(step, spe)
        o = self.order(epoch)
        span = slice(t * self.mb * self.acc, (t + 1) * self.mb * self.acc)
        return epoch, Counter(o[i] for q in range(self.w0) for i in lists[q][span])

    def shrink(self, world: int) -> tuple[int, Counter, tuple]:
        """The step that starts where the last committed one ended, in `world`; and the segment
        state after it (applied by `commit`)."""
        epoch, base, pos = self.epoch, self.base, self.pos
        if self.world is not None and world != self.world:
            m = self.n - base
            consumed = min(self.world * pos, m)
            base, pos = base + consumed, 0
        if pos >= len(ds_list(self.n - base, world, 0, self.drop_last)):
            epoch, base, pos = epoch + 1, 0, 0
        o = self.order(epoch)
        m = self.n - base
        got = Counter()
        for r in range(world):
            for i in ds_list(m, world, r, self.drop_last)[pos:pos + self.mb * self.acc]:
                got[o[base + i]] += 1
        span = min(self.mb * self.acc, len(ds_list(m, world, 0, self.drop_last)) - pos)
        return epoch, got, (epoch, base, world, pos + span)

    def commit(self, after: tuple) -> None:
        self.epoch, self.base, self.world, self.pos = after


    def epoch_whole(self, epoch: int, got: Counter, widest: int) -> str:
        """Why the committed steps of `epoch` (their ids, counted) are not the whole epoch once
        ("" when they are): constant, exactly DistributedSampler(W0)'s lists; shrink, every sample
        once beyond one dealing's padding (or what drop_last leaves out)."""
        n = self.n
        if self.policy == "constant":
            o = self.order(epoch)
            want = Counter(o[i] for q in range(self.w0) for i in ds_list(n, self.w0, q, self.drop_last))
            return "" if got == want else f"epoch {epoch}: {sum((want - got).values())} missing, " \
                                          f"{sum((got - want).values())} extra"
        if self.drop_last:
            bad = (max(got.values(), default=1) > 1) or n - len(got) >= widest * 2
        else:
            bad = set(got) != set(range(n)) or sum(got.values()) - n >= widest
        return f"epoch {epoch}: {n - len(got)} missing, {sum(got.values()) - len(got)} repeated" if bad else ""
