"""`feeder audit`: prove from visitation ledgers that an epoch was delivered exactly once
per sample, or list the gaps and duplicates.

A batch is identified by (world, rank, step) within (job, epoch). The same batch sent twice
(by a feeder that failed, then by the one the rank failed over to) is one delivery to
training: only its first copy counts, and a copy with other ids is a conflict. A batch a rank
read twice at once (a hedged read, a probe of a slow feeder: `"hedge": true` on the side
stream's records) is one delivery too, counted apart (`hedged_batches`).
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
    hedged: int = 0      # copies sent on side streams (hedged reads, probes): the rank took one copy
    hedge_first: set = field(default_factory=set)   # batches whose first copy was a side stream's

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
                "resent_batches": self.resent, "hedged_batches": self.hedged, "missing": missing[:50], "n_missing": n_missing,
                "duplicates": sorted(repeats)[:50], "n_duplicate_deliveries": extra, "padding_allowed": padding,
                "conflicts": self.conflicts[:10], "exactly_once": ok}


def audit(paths: list[str], job: str = "") -> list[dict]:
    epochs: dict[tuple, EpochAudit] = {}
    meta: dict[str, dict] = {}
    pending = defaultdict(list)
    commits, parts = defaultdict(list), defaultdict(list)
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
                if not isinstance(rec, dict) or not ("open" in rec or "commit" in rec or "mix" in rec
                                                     or {"job", "epoch"} <= rec.keys()):
                    raise InputError(f"{path}:{lineno}: not a ledger line")
                if "mix" in rec:   # a live change of a scheduled mixture: the batches say what they hold
                    continue
                if "commit" in rec:   # an elastic job's step ended (committed or not)
                    if not job or rec["commit"] == job:
                        commits[rec["commit"]].append(rec)
                elif "elastic" in rec and "open" not in rec:   # a global step's part: held to the step's commit
                    if not job or rec["job"] == job:
                        parts[rec["job"]].append(rec)
                elif "open" in rec:
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
                if r.get("hedge"):
                    ea.hedge_first.add(key)
                if "sources" in r:
                    ea.sources[key] = r["sources"]
            elif seen == r["ids"]:
                if r.get("hedge") or key in ea.hedge_first:
                    ea.hedged += 1
                else:
                    ea.resent += 1
            else:
                ea.conflicts.append({"batch": key, "first": seen, "then": r["ids"]})
    out = [e.verdict() for e in epochs.values()]
    for j in sorted(set(parts) | set(commits)):
        m = meta.get(j)
        if m is None:
            raise InputError(f"ledger has steps of job {j!r} but no stream-open record")
        out += elastic_audit(j, m, parts.get(j, []), commits.get(j, []))
    return out


def elastic_audit(job: str, meta: dict, parts: list[dict], commits: list[dict]) -> list[dict]:
    """An elastic job (feeder.core.steps): every committed step's parts, over the replicas live
    at its committed attempt, each delivered; every sample of an epoch in exactly one committed
    step (DistributedSampler's padding aside). A part sent again (failover, a step asked again
    in the same world) counts once; one with other ids is a conflict."""
    # A step's dealing is its world and, under shrink, where the committed steps before it left
    # the order (`at`: the cursor after the step); a stream reading ahead deals the steps after
    # its own as if each committed in its world: those parts are never trained if one did not.
    got: dict[tuple, tuple] = {}       # (step, world, at, rank, part) -> (epoch, ids, parts)
    conflicts: list = []
    for r in parts:
        key = (r["step"], r["world"], tuple(r["at"]), r["rank"], r["part"])
        seen = got.setdefault(key, (r["epoch"], r["ids"], r["parts"]))
        if seen[1] != r["ids"]:
            conflicts.append({"part": key, "first": seen[1], "then": r["ids"]})
    worlds: dict[int, tuple] = {}      # committed step -> its dealing (world, at)
    for c in commits:
        if c["committed"] and c.get("at") is not None:
            dealing = (c["replicas"], tuple(c["at"]))
            if worlds.setdefault(c["step"], dealing) != dealing:
                conflicts.append({"step": c["step"], "committed_as": sorted({worlds[c["step"]], dealing})})
    # A step commits only after every step before it did: one whose report never came (a
    # replica killed before sending it) is committed too, in the one world it was dealt in.
    dealt = defaultdict(set)
    for (step, world, at, _, _) in got:
        dealt[step].add((world, at))
    unreported = [s for s in range(max(worlds, default=-1)) if s not in worlds]
    for s in unreported:
        if len(dealt[s]) == 1:
            worlds[s] = next(iter(dealt[s]))
    counts: dict[int, Counter] = defaultdict(Counter)
    incomplete, steps_of = [], defaultdict(int)
    for step, (world, at) in sorted(worlds.items()):
        epoch = None
        for rank in range(world):
            first = got.get((step, world, at, rank, 0))
            n_parts = max(1, first[2]) if first else 1
            for k in range(n_parts):
                p = got.get((step, world, at, rank, k))
                if p is None:
                    incomplete.append({"step": step, "world": world, "rank": rank, "part": k})
                    continue
                epoch = p[0]
                counts[epoch].update(p[1])
        if epoch is not None:
            steps_of[epoch] += 1
    n, out = meta["n"], []
    # A constant global batch is dealt as its start world's DistributedSampler (its padding);
    # shrink's last segment is dealt over the world live then (at most the widest).
    deal = meta.get("elastic") or {}
    widest = deal.get("start_replicas") or max([w for w, _ in worlds.values()] + [meta.get("world", 1)])
    for epoch in sorted(counts):
        c = counts[epoch]
        repeats = {i: k for i, k in c.items() if k > 1}
        extra = sum(k - 1 for k in repeats.values())
        n_missing = n - sum(1 for i in c if 0 <= i < n)
        allowed = widest - 1   # one dealing's padding (or, with drop_last, what it leaves out)
        ok = not conflicts and not incomplete and (extra <= allowed if not meta["drop_last"] else not repeats) \
            and n_missing <= (allowed if meta["drop_last"] else 0)
        out.append({"job": job, "epoch": epoch, "samples": n, "elastic": True, "committed_steps": steps_of[epoch],
                    "n_missing": n_missing, "missing": sorted(set(range(n)) - c.keys())[:50] if n <= 1 << 20 else [],
                    "duplicates": sorted(repeats)[:50], "n_duplicate_deliveries": extra, "padding_allowed": allowed,
                    "incomplete_steps": incomplete[:10], "unreported_commits": unreported[:10],
                    "conflicts": conflicts[:10], "exactly_once": ok})
    return out
