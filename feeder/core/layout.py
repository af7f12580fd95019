"""Document-aware samples: where documents start inside each sample, and best-fit packing.

Pure numpy (and the optional C packer): no gRPC, no I/O. A source says where its documents
start (a sorted array of token positions in its packed stream); this module turns that into
what a batch carries and what a trainer needs:

* `window_bounds`: for `concat` samples (windows of the stream), the document starts inside
  each window;
* `best_fit`: the bins of best-fit-decreasing packing (`best_fit` samples), as a CSR table of
  pieces (token ranges of the stream), and the starts inside each bin;
* `Bounds`: a block's boundaries, compact (per sample: how many starts, the content length,
  the starts), with its wire bytes per batch and the per-token views (`segments`).

Conventions (docs/packing.md): a document starts at its first token; its EOS (where the format
has one) is its last. Offsets are within a sample of `sample_len = seq_len + 1` tokens. A packed
bin's unused tail, from `length` on, is padding: a segment of its own, never a label.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:
    from feeder._native import best_fit as _best_fit   # best-fit decreasing in O(n + capacity)
    from feeder._native import pack as _pack           # the same from the documents' starts, in one call
except ImportError:  # no C compiler at install
    _best_fit = _pack = None

# The packer's identity: a change to the packing rule changes every packed stream's fingerprint.
# bfd/2: best-fit decreasing per block of documents (feeder.sources.pack_blocks), the bins of
# block 0 first; a corpus of one block has bfd/1's bins.
PACKER = "bfd/2"
# How a packed stream's fingerprint begins (feeder.sources.packed.identity), so a cursor of the
# other packing is told apart from one of another replica's data (feeder.sampling_key).
PACKED_PREFIX = "bf-"


@dataclass(frozen=True, slots=True)
class Bounds:
    """The boundaries of k samples: sample r's document starts are
    starts[ptr[r]:ptr[r + 1]] (sorted offsets in [0, sample_len)); its tokens from lengths[r]
    on are padding (lengths[r] == sample_len: none)."""

    counts: np.ndarray    # int32 [k]
    lengths: np.ndarray   # int32 [k]
    starts: np.ndarray    # int32 [sum(counts)]

    def __len__(self) -> int:
        return len(self.counts)

    def part(self, a: int, b: int) -> "Bounds":
        """Samples [a, b)."""
        ptr = self.ptr()
        return Bounds(self.counts[a:b], self.lengths[a:b], self.starts[ptr[a]:ptr[b]])

    def ptr(self) -> np.ndarray:
        out = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=out[1:])
        return out

    def to_bytes(self) -> bytes:
        """One batch's entry of StreamReply.boundaries: int32 LE counts [n], lengths [n], starts."""
        return b"".join(np.ascontiguousarray(a, dtype="<i4").tobytes()
                        for a in (self.counts, self.lengths, self.starts))

    @classmethod
    def from_bytes(cls, data: bytes, n: int, sample_len: int) -> "Bounds":
        """The inverse of to_bytes; ValueError when the bytes are not n samples' boundaries."""
        a = np.frombuffer(data, dtype="<i4")   # (views of the reply's bytes: a few per sample, not copied)
        if len(a) < 2 * n:
            raise ValueError(f"{len(data)} bytes hold no boundaries of {n} samples")
        counts, lengths, starts = a[:n], a[n:2 * n], a[2 * n:]
        if counts.sum() != len(starts) or counts.min(initial=0) < 0 or lengths.min(initial=1) < 1 \
                or lengths.max(initial=0) > sample_len or starts.min(initial=0) < 0 \
                or starts.max(initial=0) >= sample_len:
            raise ValueError(f"the boundaries of {n} samples of {sample_len} tokens are malformed")
        return cls(counts, lengths, starts)

    @classmethod
    def join(cls, parts: list["Bounds"]) -> "Bounds":
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("counts", "lengths", "starts")))

    def segments(self, sample_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(segment_start, is_start), each [k, sample_len]: the offset where the segment holding
        each token begins (a document, the part of one the sample starts with, or the padding),
        and whether a token begins a segment other than the sample's first."""
        k = len(self.counts)
        mark = np.zeros((k, sample_len + 1), dtype=bool)
        rows = np.repeat(np.arange(k), self.counts)
        mark[rows, self.starts] = True
        mark[np.arange(k), self.lengths] = True          # the padding begins a segment (or the column past the end)
        mark = mark[:, :sample_len]
        mark[:, 0] = False                               # the sample's first token begins its first segment anyway
        col = np.arange(sample_len, dtype=np.int64)
        seg_start = np.maximum.accumulate(np.where(mark, col, 0), axis=1)
        return seg_start, mark


def segment_starts(b: Bounds, seq_len: int) -> np.ndarray:
    """int64, sorted: where each segment of the inputs begins in the flattened k·seq_len inputs
    (every sample's first input; each document start and padding start inside its inputs).
    A handful per sample, from the compact boundaries alone: no pass over the tokens."""
    k = len(b.counts)
    row = np.arange(k, dtype=np.int64) * seq_len
    starts = b.starts.astype(np.int64)
    lengths = b.lengths.astype(np.int64)
    cuts = np.concatenate((row, np.repeat(row, b.counts) + starts, row + lengths))
    inside = np.concatenate((np.ones(k, bool), (starts > 0) & (starts < seq_len), lengths < seq_len))
    return np.unique(cuts[inside])


def position_ids(b: Bounds, seq_len: int, cuts: np.ndarray | None = None) -> np.ndarray:
    """int64 [k, seq_len] over the inputs: Megatron's reset_position_ids, counting from the later
    of the sample's start and its segment's. `cuts`: segment_starts, if already made."""
    cuts = segment_starts(b, seq_len) if cuts is None else cuts
    total = len(b.counts) * seq_len
    spans = np.diff(np.append(cuts, total))
    return (np.arange(total, dtype=np.int64) - np.repeat(cuts, spans)).reshape(len(b.counts), seq_len)


def cu_seqlens(b: Bounds, seq_len: int, cuts: np.ndarray | None = None) -> np.ndarray:
    """int32 FlashAttention varlen offsets of the segments over the flattened k·seq_len inputs,
    from 0 to k·seq_len."""
    cuts = segment_starts(b, seq_len) if cuts is None else cuts
    return np.append(cuts, len(b.counts) * seq_len).astype(np.int32)


def label_crosses(b: Bounds, seq_len: int) -> np.ndarray:
    """bool [k, seq_len]: the label of input j (token j + 1) begins another segment (the next
    document, or the padding), or is padding: what is never a target."""
    _, mark = b.segments(seq_len + 1)
    pad = np.arange(1, seq_len + 1) >= b.lengths[:, None]
    return mark[:, 1:] | pad


def window_bounds(doc_starts: np.ndarray, row_starts: np.ndarray, n: int) -> Bounds:
    """The document starts inside windows [row_starts[i], row_starts[i] + n) of a stream whose
    documents start at the sorted positions `doc_starts` (all that lie in the windows, at least)."""
    row_starts = np.asarray(row_starts, dtype=np.int64)
    lo = np.searchsorted(doc_starts, row_starts, side="left")
    hi = np.searchsorted(doc_starts, row_starts + n, side="left")
    counts = (hi - lo).astype(np.int32)
    at = ranges(lo, counts)
    starts = (np.asarray(doc_starts[at], dtype=np.int64) - np.repeat(row_starts, counts)).astype(np.int32)
    return Bounds(counts, np.full(len(row_starts), n, dtype=np.int32), starts)


def ranges(lo: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """concat(arange(lo[i], lo[i] + counts[i])) without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(first - np.asarray(lo, dtype=np.int64), counts)


# ---------------------------------------------------------------------------- best-fit packing

@dataclass(frozen=True)
class Packing:
    """Best-fit-decreasing bins of `capacity` tokens: bin b holds the pieces
    ptr[b]..ptr[b + 1] - 1, piece p being stream tokens [start[p], start[p] + length[p]), in
    that order, then padding. Arrays may be memory-mapped (feeder.sources.packed)."""

    capacity: int
    ptr: np.ndarray       # [bins + 1] (narrow unsigned)
    start: np.ndarray     # [pieces] (narrow unsigned)
    length: np.ndarray    # [pieces] uint32

    @property
    def n_bins(self) -> int:
        return len(self.ptr) - 1

    def pieces(self, bins: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For bins [k]: (pieces per bin [k], piece starts, piece lengths, offsets in the bin)."""
        bins = np.asarray(bins, dtype=np.int64)
        lo = self.ptr[bins].astype(np.int64)
        counts = self.ptr[bins + 1].astype(np.int64) - lo
        at = ranges(lo, counts)
        length = self.length[at].astype(np.int64)
        ends = np.cumsum(length)
        before = np.concatenate(([0], ends))[np.cumsum(counts) - counts]   # tokens of the earlier bins
        return counts, self.start[at].astype(np.int64), length, ends - length - np.repeat(before, counts)

    def bounds(self, bins: np.ndarray) -> Bounds:
        counts, _, length, offset = self.pieces(bins)
        fill = np.bincount(np.repeat(np.arange(len(counts)), counts), weights=length, minlength=len(counts))
        return Bounds(counts.astype(np.int32), fill.astype(np.int32), offset.astype(np.int32))


def narrow(limit: int) -> np.dtype:
    """The narrowest unsigned dtype that holds values up to `limit`."""
    return np.dtype(np.uint32) if limit < 1 << 32 else np.dtype(np.uint64)


def doc_lengths(starts: np.ndarray, end: int) -> np.ndarray:
    """The length of each document of a stream (document j is [starts[j], starts[j + 1]), the
    last to `end`), in one new array: np.diff with `append` makes two, and a packing's block is
    10^6 documents on every core, each array of that size fresh memory to fault in."""
    out = np.empty(len(starts), dtype=np.int64)
    if len(starts):
        np.subtract(starts[1:], starts[:-1], out=out[:-1])
        out[-1] = int(end) - int(starts[-1])   # (an np.uint64 end less an int64 is a float64)
    return out


def best_fit(doc_starts: np.ndarray, n_tokens: int, capacity: int) -> Packing:
    """Best-fit-decreasing packing of the documents of a stream of n_tokens tokens (document j
    is [doc_starts[j], doc_starts[j + 1]), the last to n_tokens) into bins of `capacity` tokens.

    A document longer than a bin is cut into bin-sized pieces first (each a bin of its own) and
    its remainder packed with the rest. The pieces to pack are taken longest first (ties: in
    stream order), each into the fullest bin it fits (ties: the bin that reached that fill last),
    a new bin where none does. Deterministic: a pure function of the documents and capacity."""
    starts = np.ascontiguousarray(doc_starts, dtype=np.int64)
    lengths = doc_lengths(starts, n_tokens)
    if _pack is not None:   # all of it without the GIL: blocks packed on threads run side by side
        longer = lengths[lengths > capacity]   # (cut into ceil(l / capacity) pieces; the rest, one each)
        n_pieces = int(np.count_nonzero(lengths > 0)) + int(((longer - 1) // capacity).sum())
        del lengths, longer
        ptr = np.empty(n_pieces + 1, dtype=np.int64)
        start = np.empty(n_pieces, dtype=np.int64)
        length = np.empty(n_pieces, dtype=np.uint32)
        n_bins = _pack(starts, int(n_tokens), int(capacity), ptr, start, length)
        # (int64 to uint64 is the same bits: a view, not a copy of the largest array)
        wide = narrow(n_tokens) == np.uint64
        return Packing(capacity=capacity, ptr=ptr[:n_bins + 1].astype(narrow(n_pieces)),
                       start=start.view(np.uint64) if wide else start.astype(np.uint32), length=length)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    full = lengths // capacity
    rest = lengths - full * capacity
    # Whole bins of a long document, in stream order.
    whole_start = ranges(np.zeros(len(full), np.int64), full) * capacity + np.repeat(starts, full)
    # The remainders, packed.
    has = rest > 0
    item_start = (starts + full * capacity)[has]
    item_len = rest[has].astype(np.uint32)
    if _best_fit is not None:
        order = np.empty(len(item_len), dtype=np.int64)
        ptr = np.empty(len(item_len) + 1, dtype=np.int64)
        n_bins = _best_fit(np.ascontiguousarray(item_len), int(capacity), order, ptr)
        ptr = ptr[:n_bins + 1]
    else:
        order, ptr = _best_fit_py(item_len, capacity)
    n_whole = len(whole_start)
    all_ptr = np.concatenate((np.arange(n_whole, dtype=np.int64), ptr + n_whole))
    all_start = np.concatenate((whole_start, item_start[order]))
    all_len = np.concatenate((np.full(n_whole, capacity, dtype=np.uint32), item_len[order]))
    return Packing(capacity=capacity, ptr=all_ptr.astype(narrow(len(all_start))),
                   start=all_start.astype(narrow(n_tokens)), length=all_len.astype(np.uint32))


def _best_fit_py(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The C packer's rule in Python (no compiler at install; small corpora): (pieces in bin
    order, bin pointers)."""
    import bisect

    order = np.argsort(-lengths.astype(np.int64), kind="stable")
    free: list[tuple[int, int, int]] = []   # (remaining, -when it got there, bin): the fullest that fits, latest first
    bins: list[list[int]] = []
    for tick, i in enumerate(order.tolist()):
        s = int(lengths[i])
        k = bisect.bisect_left(free, (s, -(1 << 62), 0))
        if k == len(free):
            b, r = len(bins), capacity
            bins.append([])
        else:
            r, _, b = free.pop(k)
        bins[b].append(i)
        r -= s
        if r > 0:
            bisect.insort(free, (r, -tick, b))
    out = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=len(lengths))
    ptr = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in bins], out=ptr[1:])
    return out, ptr
