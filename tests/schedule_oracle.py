"""An oracle for scheduled mixtures, written from docs/mixtures.md ("Schedules"), not from the
feeder's code: DistributedSampler (shuffle off) for the progress indexes a rank gets, splitmix64
in Python integers for each block's shuffle, the closed-form integral and Megatron's rule for each
slot's source, torch.randperm for each source's permutations."""
from __future__ import annotations

from tests.mixture_oracle import source_perm

BLOCK = 256
M64 = (1 << 64) - 1


def splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def block_slots(seed: int, block: int) -> list[int]:
    """Offsets within the block, in the order progress takes them: sorted by their keys."""
    key = splitmix((seed & M64) ^ splitmix(block))
    keys = [splitmix((x + key) & M64) for x in range(BLOCK)]
    return sorted(range(BLOCK), key=lambda x: (keys[x], x))


def slot_of(g: int, seed: int, _cache={}) -> int:
    b, off = divmod(g, BLOCK)
    perm = _cache.get((seed, b))
    if perm is None:
        perm = _cache[(seed, b)] = block_slots(seed, b)
    return b * BLOCK + perm[off]


def normalized(w: dict, names) -> list[float]:
    import numpy as np

    v = np.array([float(w.get(n, 0.0)) for n in names], dtype=np.float64)
    return (v / np.sum(v)).tolist()


class Segments:
    """A schedule as the docs define it: segment k active from at_k, ramping from a_k at start_k
    to b_k at until_k; T_d(x) = D_kd + u (a_kd + u h_kd), u = x - start_k, T continuous."""

    def __init__(self, segs):
        # segs: [(at, start, until or 0, a list, b list)]
        self.segs = segs
        self.D = []
        for k, (at, start, until, a, b) in enumerate(segs):
            h = [(bb - aa) / (2.0 * float(until - start)) if until else 0.0 for aa, bb in zip(a, b)]
            if k == 0:
                D = [0.0] * len(a)
            else:
                pat, pstart, puntil, pa, pb = segs[k - 1]
                ph = self.h[k - 1]
                pu = float(at - pstart)
                t_end = [self.D[k - 1][d] + pu * (pa[d] + pu * ph[d]) for d in range(len(a))]
                u0 = float(at - start)
                D = [t_end[d] - u0 * (a[d] + u0 * h[d]) for d in range(len(a))]
            self.D.append(D)
            self.h = getattr(self, "h", []) + [h]

    @classmethod
    def from_table(cls, names, table: list[dict]):
        segs, at = [], 0
        for seg in table:
            a = normalized(seg["weights"], names)
            b = normalized(seg["to"], names) if "to" in seg else a
            until = seg.get("until")
            segs.append((at, at, until if b != a else 0, a, b))
            at = until if until is not None else at
        return cls(segs)

    def spliced(self, new: "Segments", at: int) -> "Segments":
        before = [s for s in self.segs if s[0] < at] if at else []
        after = []
        for k, s in enumerate(new.segs):
            end = new.segs[k + 1][0] if k + 1 < len(new.segs) else None
            if end is not None and end <= at:
                continue
            after.append(s if s[0] >= at else (at, *s[1:]))
        return Segments(before + after)

    def T(self, x: int) -> list[float]:
        k = max(j for j, s in enumerate(self.segs) if s[0] <= x)
        at, start, until, a, b = self.segs[k]
        u = float(max(x, 1) - start)
        return [self.D[k][d] + u * (a[d] + u * self.h[k][d]) for d in range(len(a))]


class Blend:
    """(source, draw) of every slot up to what is asked, by Megatron's rule over T."""

    def __init__(self, segments: Segments, k: int):
        self.s, self.k = segments, k
        self.src: list[int] = []
        self.draw: list[int] = []
        self.count = [0] * k

    def at(self, slot: int) -> tuple[int, int]:
        while len(self.src) <= slot:
            j = len(self.src)
            t = self.s.T(j)
            best, err = 0, t[0] - self.count[0]
            for d in range(1, self.k):
                e = t[d] - self.count[d]
                if e > err:
                    best, err = d, e
            self.src.append(best)
            self.draw.append(self.count[best])
            self.count[best] += 1
        return self.src[slot], self.draw[slot]


def sample(blend: Blend, names, sizes, seed: int, shuffle: bool, g: int, permutation: str = "torch") -> tuple[int, int]:
    """(source, id within it) at progress g."""
    d, k = blend.at(slot_of(g, seed))
    cycle, r = divmod(k, sizes[d])
    return d, source_perm(sizes[d], seed, names[d], cycle, shuffle, permutation)[r]
