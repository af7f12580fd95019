"""`feeder audit`: prove from visitation ledgers that an epoch was delivered exactly once
per sample, or list the gaps and duplicates.

A batch is identified by (world, rank, step) within (job, epoch). The same batch sent twice
(by a feeder that failed, then by the one the rank failed over to) is one delivery to
training: only its first copy counts, and a copy with other ids is a conflict.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from feeder.core.errors import InputError
from feeder.core.sampler import per_rank


@dataclass
class EpochAudit:
    job: str
    epoch: int
    n: int
    drop_last: bool
    worlds: set = field(default_factory=set)
    batches: dict = field(default_factory=dict)      # (world, rank, step) -> ids
    mixture: dict | None = None                      # {source: weight} of a mixture's epoch ({}: it changed)
    sources: dict = field(default_factory=dict)      # (world, rank, step) -> a mixture's sources
    conflicts: list = field(default_factory=list)
    resent: int = 0

    def verdict(self) -> dict:
        counts = Counter(i for ids in self.batches.values() for i in ids)
        # What was never delivered, counted from what was (O(delivered), not O(n): an epoch of
        # 10^10 samples is audited from its ledger alone); named only when few enough to list.
        n_missing = self.n - sum(1 for i in counts if 0 <= i < self.n)
        missing = sorted(set(range(self.n)) - counts.keys()) if n_missing and self.n <= 1 << 20 else []
        repeats = {i: c for i, c in counts.items() if c > 1}
        extra = sum(c - 1 for c in repeats.values())
        # DistributedSampler itself repeats (drop_last=False) or drops (drop_last=True) fewer
        # than `world` samples per dealing; more than that is our fault.
        padding = sum(per_rank(self.n, w, False) * w - self.n for w in self.worlds) if not self.drop_last else 0
        dropped = sum(self.n - per_rank(self.n, w, True) * w for w in self.worlds) if self.drop_last else 0
        ok = not self.conflicts and extra <= padding and n_missing <= dropped
        out = {}
        if self.mixture is not None:   # each source's positions, against its weight's share
            got = Counter(name for names in self.sources.values() for name in names)
            out["per_source"] = {n: {"samples": got[n], "expected": round(self.mixture[n] * self.n, 1)
                                     if n in self.mixture else None} for n in sorted(got, key=lambda n: -got[n])}
        return {**out, "job": self.job, "epoch": self.epoch, "samples": self.n, "batches": len(self.batches),
                "resent_batches": self.resent, "missing": missing[:50], "n_missing": n_missing,
                "duplicates": sorted(repeats)[:50], "n_duplicate_deliveries": extra, "padding_allowed": padding,
                "conflicts": self.conflicts[:10], "exactly_once": ok}


def audit(paths: list[str], job: str = "") -> list[dict]:
    epochs: dict[tuple, EpochAudit] = {}
    meta: dict[str, dict] = {}
    pending = defaultdict(list)
    for path in paths:
        try:
            f = open(path, "rb")
        except OSError as e:
            raise InputError(f"{path}: {e.strerror}") from None
        with f:
            for lineno, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)   # bytes: a non-UTF-8 line is a ValueError like any other
                except (ValueError, RecursionError):
                    raise InputError(f"{path}:{lineno}: not a ledger line") from None
                if not isinstance(rec, dict) or not ("open" in rec or {"job", "epoch"} <= rec.keys()):
                    raise InputError(f"{path}:{lineno}: not a ledger line")
                if "open" in rec:
                    first = meta.setdefault(rec["open"], rec)
                    if first.get("mixture") != rec.get("mixture"):   # remixed: no one set of weights
                        first["mixture"] = {}
                elif not job or rec["job"] == job:
                    pending[rec["job"], rec["epoch"]].append(rec)
    for (j, epoch), recs in sorted(pending.items()):
        m = meta.get(j)
        if m is None:
            raise InputError(f"ledger has batches of job {j!r} but no stream-open record")
        ea = epochs[j, epoch] = EpochAudit(job=j, epoch=epoch, n=m["n"], drop_last=m["drop_last"],
                                           mixture=m.get("mixture"))
        for r in recs:
            key = (r["world"], r["rank"], r["step"])
            ea.worlds.add(r["world"])
            seen = ea.batches.get(key)
            if seen is None:
                ea.batches[key] = r["ids"]
                if "sources" in r:
                    ea.sources[key] = r["sources"]
            elif seen == r["ids"]:
                ea.resent += 1
            else:
                ea.conflicts.append({"batch": key, "first": seen, "then": r["ids"]})
    return [e.verdict() for e in epochs.values()]
