"""Handing batches to the loop: each stream's batches are numbered in the order the loop takes
them, so of two streams read from the same cursor (a hedged read, a probe: client/gray.py) the
first copy of a batch is handed over and the other dropped, its cursor checked equal.

A part of FeederClient (its base class): it uses the client's queue (_q), its gate lock and
counters (_gate, _seq, _handed, _recent, cursor, _phase), its decoding settings and its Gray.
"""
from __future__ import annotations

import time

from feeder.core.cursor import same_place
from feeder.core.errors import Code, FeederError
from feeder.v1 import feeder_pb2 as pb

from .decode import decode

# Cursors of the batches handed over lately, kept to check a later copy of one against.
RECENT = 1024


class Reader:
    """One stream's place: its target, the number of its next batch, and (a hedge or a probe)
    its side stream."""
    __slots__ = ("target", "next", "side")

    def __init__(self, target: str, first: int, side=None):
        self.target, self.next, self.side = target, first, side


class Handing:
    """FeederClient's side that hands a stream's batches over (see the module doc)."""

    @staticmethod
    def reader(target: str, first: int, side=None) -> Reader:
        return Reader(target, first, side)

    def _hand(self, run: list, reader: Reader) -> bool:
        """Queue a stream's decoded batches (numbered, in order) but those another stream handed
        over first; the stream resumes after the last one queued, and a worker's stream with
        the batch after its own in the round-robin."""
        with self._gate:
            fresh = [b for k, b in run if k >= self._seq]
            if not fresh:
                return True
            if run[-len(fresh)][0] != self._seq:   # a stream never skips a batch: a bug, said plainly
                raise FeederError(f"stream from {reader.target} handed batch {run[-len(fresh)][0]} when "
                                  f"{self._seq} was next", code=Code.INTERNAL)
            if not self._q.put_many(fresh, self._stop):
                return False
            for k, b in run[-len(fresh):]:
                self._recent[k] = b.cursor
                self._recent.pop(k - RECENT, None)
            self._seq += len(fresh)
            self.cursor = fresh[-1].cursor
        if reader.side is None:
            self._handed += len(fresh)
        else:
            reader.side.handed += len(fresh)
        self.gray.delivery.arrived(time.monotonic(), len(fresh))
        s = self.cfg.spec
        self._phase = (s.worker_index + 1) % s.num_workers
        return True

    def _copy(self, k: int, b, reader: Reader) -> None:
        """Batch k arrived again (another stream handed it over first): dropped, counted, and
        its cursor checked against the one handed over (same cursor, same batch, any feeder)."""
        self.gray.hedged_bytes += len(b.tokens) + len(b.sample_ids)
        if reader.side is not None:
            reader.side.dropped_bytes += len(b.tokens)
        want = self._recent.get(k)
        if want is not None and not same_place(want, b.cursor):
            raise FeederError(f"batch {k} from {reader.target} is not the batch handed over under that number (its "
                              "cursor differs): feeders disagree about this stream", code=Code.INTERNAL)

    def _hand_reply(self, reply: pb.StreamReply, reader: Reader) -> bool:
        """Decode a reply's batches in runs of up to half the read-ahead, each handed over at once
        (a batch another stream handed over first is dropped undecoded). False on close(); a
        corrupt batch raises FeederError after the good ones before it."""
        run, size = [], max(1, self._q.capacity // 2)
        try:
            sources = reply.sources   # a mixture's: one entry per batch
            bounds = reply.boundaries   # a stream's with boundaries: one entry per batch
            if self.cfg.spec.boundaries and len(bounds) != len(reply.batches):
                raise FeederError(f"the feeder sent {len(bounds)} batches' boundaries for {len(reply.batches)} batches "
                                  "of a stream that asked for them (a feeder release without boundaries?)",
                                  code=Code.FAILED_PRECONDITION)
            s = self.cfg.spec
            cp = (s.seq_len, s.cp_size, s.cp_rank, s.cp_layout) if s.cp_size > 1 else None
            steps = reply.elastic   # an elastic stream's: one entry per batch
            if s.elastic and len(steps) != len(reply.batches):
                raise FeederError(f"the feeder sent {len(steps)} batches' step fields for {len(reply.batches)} batches "
                                  "of an elastic stream (a feeder release without live elasticity?)",
                                  code=Code.FAILED_PRECONDITION)
            for j, b in enumerate(reply.batches):
                k = reader.next
                reader.next += 1
                if k < self._seq:   # (it only grows: a stale read errs toward decoding a copy)
                    self._copy(k, b, reader)
                    continue
                run.append((k, decode(b, reply.region, self._alloc, sources[j] if sources else None,
                                      bounds[j] if bounds else None, cp, steps[j] if steps else None)))
                if len(run) >= size:
                    if not self._hand(run, reader):
                        return False
                    run = []
        finally:  # the good batches before a corrupt one are still delivered
            if run and not self._hand(run, reader):
                return False
        return True
