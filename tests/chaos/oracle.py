"""The oracle: what the ranks consumed against torch's own DistributedSampler and the packed
stream computed independently (tests/helpers.py), and the feeders' ledgers through the real
`feeder audit` CLI.

A rank's history is a chain of processes (incarnations). Each process's batches are checked
at their positions, the ones training would discard too (after a restart the batches past
the checkpoint are redone, but they still had to be right). The rank's effective sequence
is each process's batches up to the checkpoint its successor resumed from, then the last
process's batches to the end; it must be complete.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np

from feeder.core.sampler import per_rank
from tests.chaos.rank import token_hash
from tests.helpers import reference_ids


class ScheduleFills:
    """What fills each index of an epoch of a scheduled mixture: the sample at progress e*N + i
    under the scenario's schedule spliced with each live change the run reported taken."""

    blend = None   # (every epoch is listed)

    def __init__(self, run):
        sc = run.sc
        self.run, self.sc, self.n = run, sc, run.n
        self.names = [m[0] for m in sc.mixture]
        self.sizes = [c.samples(sc.seq_len, sc.packing) for c in run.sources]
        self._blend = None

    @property
    def blend_of(self):
        """Built when first asked (after the run: the changes it reported are known then)."""
        from tests.schedule_oracle import Blend, Segments

        if self._blend is None:
            seg = Segments.from_table(self.names, self.run.schedule)
            for version, at, table in sorted(self.run.mixes, key=lambda m: m[0]):
                new = Segments.from_table(self.names, table)
                new = Segments([(a + at, s0 + at, u + at if u else 0, w, t) for a, s0, u, w, t in new.segs])
                seg = seg.spliced(new, at)
            self._blend = Blend(seg, len(self.names))
        return self._blend

    def fills(self, epoch: int) -> list:
        from tests.schedule_oracle import sample

        return [sample(self.blend_of, self.names, self.sizes, self.sc.data_seed, self.sc.shuffle, epoch * self.n + i,
                       self.sc.permutation) for i in range(self.n)]


class Oracle:
    def __init__(self, run):
        self.run, self.sc, self.n = run, run.sc, run.n
        self.stream = run.corpus.stream
        self.errors: list[str] = []
        self.samples = 0
        self._ref: dict = {}
        # A mixture: what fills each position (tests/mixture_oracle.py, from the README's rules);
        # a batch's "ids" are then (source, id) pairs, compared and counted as such.
        self.mix = None
        self.positions_shuffled = self.sc.shuffle
        if self.sc.schedule:   # (tests/schedule_oracle.py, from docs/mixtures.md "Schedules")
            self.mix = ScheduleFills(run)
            self.positions_shuffled = False   # a scheduled mixture deals progress indexes: the identity order
            self._fills = {}
        elif self.sc.mixture:
            from tests.mixture_oracle import Oracle as MixtureOracle

            L = self.sc.seq_len
            self.mix = MixtureOracle([m[0] for m in self.sc.mixture], [c.samples(L, self.sc.packing) for c in run.sources],
                                     [m[1] for m in self.sc.mixture], self.n, seed=self.sc.data_seed,
                                     shuffle=self.sc.shuffle, drop_last=self.sc.drop_last,
                                     permutation=self.sc.permutation)
            self._fills: dict[int, list] = {}

    def fills(self, epoch: int) -> list:
        """What fills each position of the epoch: the position itself, or a mixture's (source, id)."""
        if self.mix is None:
            return list(range(self.n))
        if epoch not in self._fills:
            self._fills[epoch] = [tuple(f) for f in self.mix.fills(epoch)]
        return self._fills[epoch]

    def ids(self, line: dict) -> list:
        """A rank's batch as the oracle compares it: its ids, or a mixture's (source, id) pairs."""
        return line["ids"] if self.mix is None else [tuple(x) for x in zip(line.get("src", []), line["ids"])]

    def fail(self, msg: str) -> None:
        self.errors.append(msg)

    def epoch_ids(self, world: int, rank: int, epoch: int, stop: int | None = None) -> list:
        """The rank's first `stop` samples of the epoch (None: all of them)."""
        if self.mix is not None and self.mix.blend is not None:
            # An epoch too large to list (10^9 positions): each position on its own.
            return self.mix.rank(world, rank, epoch, stop=stop)
        key = (world, rank, epoch)
        if key not in self._ref:
            pos = reference_ids(self.n, world, rank, shuffle=self.positions_shuffled, seed=self.sc.data_seed,
                                drop_last=self.sc.drop_last, epoch=epoch, permutation=self.sc.permutation)
            fill = self.fills(epoch)
            self._ref[key] = [fill[p] for p in pos]
        return self._ref[key][:stop]

    def expected(self, world: int, rank: int, count: int) -> list[tuple[int, int, list[int]]]:
        """(epoch, step, ids) of the first `count` batches of a rank that starts at the scenario's epoch."""
        sc, out, epoch = self.sc, [], self.sc.start_epoch
        mb = sc.micro_batch
        while len(out) < count:
            ids = self.epoch_ids(world, rank, epoch, stop=(count - len(out)) * mb)
            out += [(epoch, s, ids[s * mb:(s + 1) * mb]) for s in range(-(-len(ids) // mb))]
            epoch += 1
            if sc.num_epochs and epoch >= sc.start_epoch + sc.num_epochs:
                break
        return out[:count]

    def check_tokens(self, where: str, line: dict) -> None:
        L, packing = self.sc.seq_len, self.sc.packing
        sources = [0] * len(line["ids"]) if self.mix is None else line.get("src", [])
        corpora = [self.run.corpus] if self.mix is None else self.run.sources
        rows = [corpora[d].rows([i], L, packing) if 0 <= d < len(corpora) else None
                for d, i in zip(sources, line["ids"])]
        if any(r is None for r in rows):
            self.fail(f"{where}: a sample of batch epoch {line['e']} step {line['s']} is not in its source")
            return
        rows = np.concatenate(rows) if rows else np.zeros((0, L + 1), np.int64)
        if token_hash(rows.astype(np.int64).tobytes()) != line["h"]:
            self.fail(f"{where}: tokens of batch epoch {line['e']} step {line['s']} differ from the packed stream")
        self.samples += len(line["ids"])

    # -- the rank chains
    def chains(self, phase: int) -> dict[int, list]:
        out: dict[int, list] = {}
        for inc in self.run.incs:
            if inc.phase == phase:
                out.setdefault(inc.slot, []).append(inc)
        return out

    def effective(self, chain: list) -> list[dict]:
        """The batches training kept: each process's up to where its successor resumed."""
        kept: list[dict] = []
        successors = {id(a): b for a, b in zip(chain, chain[1:])}
        for inc in chain:
            nxt = successors.get(id(inc))
            upto = nxt.start_pos if nxt is not None else None
            for ln in inc.lines:
                if upto is None or ln["p"] <= upto:
                    kept.append(ln)
        kept.sort(key=lambda ln: ln["p"])
        # a position may come from two processes only if they agree (checked elsewhere): keep one
        dedup = {}
        for ln in kept:
            dedup.setdefault(ln["p"], ln)
        return [dedup[p] for p in sorted(dedup)]

    def check_ends(self, chain: list, want_total: int | None) -> None:
        # Where the stream ends when no count is known beforehand (the re-dealt rest after a
        # world-size change): where the processes that were not superseded ended it.
        ends = [inc.end["p"] for inc in chain if inc.role != "superseded" and inc.end and inc.end["end"] == "ok"]
        complete_at = want_total if want_total is not None else (max(ends) if ends else None)
        for inc in chain:
            who = f"rank {inc.slot} (phase {inc.phase}, process {inc.out.name}, {inc.role})"
            end = inc.end
            last = inc.start_pos + len(inc.lines)
            if inc.role == "restarted" or (inc.role == "superseded" and inc.killed):
                # killed by us at a random point (a superseded process too, when a restart
                # fault met it): anything it did is checked by position
                continue
            if end is None:
                self.fail(f"{who} died without finishing (exit code {inc.exitcode}) at position {last}")
                continue
            if end["end"] == "bug":
                self.fail(f"{who} crashed: {end['code']}: {end['msg'].strip().splitlines()[-1]}")
                continue
            if inc.role == "superseded":
                if end["end"] == "error" and end["code"] == "FAILED_PRECONDITION":
                    continue
                if end["end"] == "ok" and complete_at is not None and last >= complete_at:
                    continue   # it had everything before the newer one took over
                self.fail(f"{who}: a superseded stream must stop with FAILED_PRECONDITION, it ended "
                          f"{end['end']} {end.get('code', '')} at position {last}")
                continue
            if end["end"] == "error":
                self.fail(f"{who} got {end['code']}: {end['msg']}")
                continue
            if want_total is not None and end["p"] != want_total:
                self.fail(f"{who} ended cleanly after {end['p']} batches, expected {want_total}: "
                          "a stream ended early (or late) without an error")

    def check_phase_one(self) -> dict[int, list[dict]]:
        run, sc = self.run, self.sc
        world = sc.world
        stop = run.stop_at()
        want = stop if stop else run.total(world)
        kept = {}
        for slot, chain in sorted(self.chains(1).items()):
            exp = self.expected(world, slot, want)
            for inc in chain:
                for ln in inc.lines:
                    where = f"rank {slot} process {inc.out.name} position {ln['p']}"
                    p = ln["p"]
                    if p > len(exp):
                        self.fail(f"{where}: a batch past the end (epoch {ln['e']} step {ln['s']})")
                        break
                    e, s, ids = exp[p - 1]
                    if (ln["e"], ln["s"], self.ids(ln)) != (e, s, ids):
                        self.fail(f"{where}: got epoch {ln['e']} step {ln['s']} ids {self.ids(ln)[:8]}, expected "
                                  f"epoch {e} step {s} ids {ids[:8]} (DistributedSampler, world {world})")
                        break
                    self.check_tokens(where, ln)
            self.check_ends(chain, want)
            kept[slot] = self.effective(chain)
            if len(kept[slot]) != want and not any(e.startswith(f"rank {slot}") for e in self.errors):
                self.fail(f"rank {slot} kept {len(kept[slot])} batches, expected {want}")
        return kept

    def check_phase_two(self, old: dict[int, list[dict]]) -> None:
        """After a world-size change: the epoch of the change re-dealt once (padding only), the
        later epochs DistributedSampler's for the new world size."""
        run, sc = self.run, self.sc
        chains = self.chains(2)
        if not chains:
            return
        new = int(run.reshard.detail)
        s = run.stop_at()
        unbounded = sc.num_epochs == 0
        kept = {}
        for slot, chain in sorted(chains.items()):
            self.check_ends(chain, sc.take if unbounded else None)
            kept[slot] = self.effective(chain)
            by_pos = {ln["p"]: ln for ln in kept[slot]}
            for inc in chain:   # what a restarted process delivered again must be the same
                for ln in inc.lines:
                    self.check_tokens(f"rank {slot} (world {new}) {inc.out.name} position {ln['p']}", ln)
                    k = by_pos.get(ln["p"])
                    if k is not None and (k["e"], k["s"], self.ids(k)) != (ln["e"], ln["s"], self.ids(ln)):
                        self.fail(f"rank {slot} (world {new}) position {ln['p']}: two processes got different "
                                  f"batches ({k['e']},{k['s']}) vs ({ln['e']},{ln['s']}) from one cursor")
        old_last = old[0][-1] if old.get(0) else None
        if old_last is None:
            return
        ec = old_last["e"]
        # the epoch of the change: old ranks' ids in it + the re-dealt rest
        consumed = [i for seq in old.values() for ln in seq if ln["e"] == ec for i in self.ids(ln)]
        redealt = {slot: [ln for ln in seq if ln["e"] == ec] for slot, seq in kept.items()}
        counts = {slot: len(v) for slot, v in redealt.items()}
        if len(set(counts.values())) > 1:
            self.fail(f"after the change to world {new}, ranks got different numbers of batches of epoch {ec}: "
                      f"{counts}")
        everything = consumed + [i for v in redealt.values() for ln in v for i in self.ids(ln)]
        # Counted against what fills the epoch (a multiset: a mixture may draw one sample at two
        # positions); for one dataset that is each id once.
        ref = Counter(self.fills(ec))
        rem = self.n - sum((Counter(consumed) & ref).values())
        c = Counter(everything)
        dups = sum((c - ref).values())
        missing = sorted((ref - c).elements())
        complete = unbounded is False or all(
            any(ln["e"] > ec for ln in seq) for seq in kept.values())
        W = sc.world
        if sc.drop_last:
            allowed_missing = (self.n - per_rank(self.n, W, True) * W) + (rem - per_rank(rem, new, True) * new)
            if dups:
                self.fail(f"world {W}->{new} epoch {ec}: {dups} samples delivered twice (drop_last: none may be)")
            if complete and len(missing) > allowed_missing:
                self.fail(f"world {W}->{new} epoch {ec}: {len(missing)} samples never delivered, DistributedSampler "
                          f"drops at most {allowed_missing}: {sorted(missing)[:10]}")
        else:
            allowed = (per_rank(self.n, W, False) * W - self.n) + (per_rank(rem, new, False) * new - rem)
            if dups > allowed:
                self.fail(f"world {W}->{new} epoch {ec}: {dups} duplicate deliveries, padding allows {allowed}")
            if complete and missing:
                self.fail(f"world {W}->{new} epoch {ec}: {len(missing)} samples never delivered: "
                          f"{sorted(missing)[:10]}")
        # later epochs: exactly DistributedSampler for the new world
        for slot, seq in kept.items():
            later = [ln for ln in seq if ln["e"] > ec]
            if not later:
                continue
            exp, epoch = [], ec + 1
            while len(exp) < len(later):
                ids = self.epoch_ids(new, slot, epoch)
                mb = sc.micro_batch
                exp += [(epoch, st, ids[st * mb:(st + 1) * mb]) for st in range(-(-len(ids) // mb))]
                epoch += 1
                if sc.num_epochs and epoch >= sc.start_epoch + sc.num_epochs:
                    break
            got = [(ln["e"], ln["s"], self.ids(ln)) for ln in later]
            if not unbounded and len(got) != len(exp):
                self.fail(f"rank {slot} (world {new}) got {len(got)} batches after epoch {ec}, expected {len(exp)}")
            for g, e in zip(got, exp):
                if g != e:
                    self.fail(f"rank {slot} (world {new}): got epoch {g[0]} step {g[1]} ids {g[2][:8]}, expected "
                              f"epoch {e[0]} step {e[1]} ids {e[2][:8]}")
                    break

    def check_audit(self) -> None:
        ledgers = self.run.ledgers()
        if not ledgers:
            return
        r = subprocess.run([sys.executable, "-m", "feeder.cli", "audit", *ledgers, "--job", self.sc.job, "--json"],
                           capture_output=True, text=True, timeout=120)
        if "no batches" in r.stdout:
            return
        try:
            verdicts = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
        except ValueError:
            self.fail(f"feeder audit exited {r.returncode} without a verdict: {(r.stdout + r.stderr)[-300:]}")
            return
        finite = self.sc.num_epochs > 0
        change = self.change_epoch()
        for v in verdicts:
            if change is not None and v["epoch"] >= change:
                # The ledger records what was sent, not what was consumed: batches the old world's
                # streams had in flight at the change count as deliveries, and the re-dealt rest
                # (another world, other keys) as duplicates of them. Only conflicts mean something.
                if v.get("conflicts"):
                    self.fail(f"feeder audit: epoch {v['epoch']}: conflicting batches {v['conflicts'][:2]}")
                continue
            if v.get("conflicts"):
                self.fail(f"feeder audit: epoch {v['epoch']}: conflicting batches {v['conflicts'][:2]}")
            elif v.get("n_duplicate_deliveries", 0) > v.get("padding_allowed", 0):
                self.fail(f"feeder audit: epoch {v['epoch']}: {v['n_duplicate_deliveries']} duplicate deliveries "
                          f"(padding allows {v['padding_allowed']}): {v['duplicates'][:10]}")
            elif finite and not v.get("exactly_once") and not self.errors:
                self.fail(f"feeder audit: epoch {v['epoch']} not exactly once: {v['n_missing']} missing "
                          f"{v['missing'][:10]}")
        if finite and change is None and not self.errors and r.returncode != 0:
            self.fail(f"feeder audit exited {r.returncode}: {r.stdout[-300:]}")

    def change_epoch(self) -> int | None:
        """The epoch of the world-size change (None: no change happened)."""
        if self.run.reshard is None or not self.chains(2):
            return None
        first = next((inc for inc in self.run.incs if inc.phase == 1 and inc.slot == 0 and inc.lines), None)
        s = self.run.stop_at()
        for inc in self.run.incs:
            if inc.phase == 1 and inc.slot == 0:
                for ln in inc.lines:
                    if ln["p"] == s:
                        return ln["e"]
        return first.lines[-1]["e"] if first else 0

    def check_members(self) -> None:
        """Each rank's members and context-parallel slices got its stream (issue 33)."""
        for inc in self.run.incs:
            v = inc.members
            if v is None:
                continue
            who = f"rank {inc.slot} (phase {inc.phase}, process {inc.out.name})"
            if v["members"] != "ok":
                self.fail(f"{who}: its members' batches are not its own: {v['bad']}")
            for key, err in v["errors"].items():
                if not err.startswith("FAILED_PRECONDITION"):   # (a newer process took the rank's slots over)
                    self.fail(f"{who}: member {key} ended with {err}")

    def check(self) -> list[str]:
        self.check_members()
        old = self.check_phase_one()
        if self.run.reshard is not None:
            self.check_phase_two(old)
        self.check_audit()
        return self.errors
