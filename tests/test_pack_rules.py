"""The rules a packing follows (issue 35), apart from how it is built: each format's document
spans, the C packer against its numpy twin, and the padding blocks cost against one pass."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from feeder.core import layout
from feeder.sources import Documents
from feeder.sources.formats import Options, open_any
from feeder.sources.posix import PosixSource
from tests import format_writers as W
from tests.helpers import make_docs, prep_docs
from tests.test_pack_blocks import EOS, source


def test_doc_spans_are_the_documents_each_format_records_whatever_the_range(tmp_path):
    """Megatron (three files, one split into sentences: its document table is not one entry per
    item), nanoGPT (by EOS) and our shards: doc_spans(lo, hi) is the starts of the documents
    starting in [lo, hi), as the chunks' document starts say (Megatron's: as written), and the
    next start."""
    docs = make_docs(150, seed=35)
    ids = [list(d.encode()) for d in docs]
    (tmp_path / "mega").mkdir()
    for k, part in enumerate((ids[:40], ids[40:110], ids[110:])):   # (the second as split into sentences)
        W.megatron(tmp_path / "mega" / f"c_{k:02d}_text_document", part, EOS, sentences=k == 1)
    sources = [source(tmp_path / "mega"),
               open_any(str(W.nanogpt(tmp_path / "train.bin", ids, EOS)), Options(vocab_size=257, eos_id=EOS)),
               PosixSource(prep_docs(_mkdir(tmp_path / "prep"), docs, shard_tokens=1500, chunk_tokens=300))]
    rng = np.random.default_rng(35)
    for src in sources:
        assert isinstance(src, Documents)
        every = np.concatenate([src.doc_starts(k) for k in range(len(src.chunk_starts) - 1)])
        assert len(every) >= 140
        if src is sources[0]:   # (the documents as written: each one's ids and its EOD)
            assert every.tolist() == np.cumsum([0] + [len(d) + 1 for d in ids])[:-1].tolist()
        for lo, hi in [(0, src.n_tokens), (0, 1), (src.n_tokens - 1, src.n_tokens),
                       *(sorted(rng.integers(0, src.n_tokens, 2).tolist()) for _ in range(25))]:
            starts, end = src.doc_spans(lo, hi)
            want = every[(every >= lo) & (every < hi)]
            after = every[every >= hi]
            assert starts.tolist() == want.tolist(), (type(src).__name__, lo, hi)
            assert end == (int(after[0]) if len(after) else src.n_tokens), (type(src).__name__, lo, hi)


def test_the_c_packer_from_document_starts_is_layouts_numpy_rule():
    """layout.best_fit in one C call (documents longer than a bin, empty ones, a tail after the
    last start), with 32-bit indexes and with 64 (wide: what a block of over 2^31 documents
    takes), gives the bytes of its numpy twin."""
    rng = np.random.default_rng(35)
    c = layout._pack
    for i in range(200):
        n, cap = int(rng.integers(0, 300)), int(rng.integers(2, 70))
        lengths = rng.integers(0, 4 * cap, size=n)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)[:n] + 5
        total = int(lengths.sum()) + 5 + int(rng.integers(0, 3))
        got = layout.best_fit(starts, total, cap)
        try:
            layout._pack = lambda *a: c(*a, True)
            wide = layout.best_fit(starts, total, cap)
            layout._pack = None
            want = layout.best_fit(starts, total, cap)
        finally:
            layout._pack = c
        for k in ("ptr", "start", "length"):
            for it in (got, wide):
                assert getattr(it, k).dtype == getattr(want, k).dtype and (getattr(it, k) == getattr(want, k)).all(), i


def test_blocks_pad_within_a_tenth_of_a_point_of_one_whole_corpus_pass():
    """Web-like lengths (lognormal, median 600), seq_len 4096: 2·10^5 documents in blocks of
    ~2·10^4 pad within 0.1 percentage point of one pass over all of them (docs/scale.md: 10^7
    documents in blocks of 2^30 tokens, 0.0002 point)."""
    rng = np.random.default_rng(35)
    lengths = np.maximum(1, rng.lognormal(np.log(600), 1.0, 200_000)).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    total, B, cap = int(lengths.sum()), 1 << 24, 4097

    def padding(bins):
        return 1 - total / (bins * cap)

    whole = layout.best_fit(starts, total, cap).n_bins
    blocks = 0
    for lo in range(0, total, B):
        inside = starts[(starts >= lo) & (starts < lo + B)]
        after = starts[starts >= lo + B]
        blocks += layout.best_fit(inside, int(after[0]) if len(after) else total, cap).n_bins
    assert total // B >= 10 and abs(padding(blocks) - padding(whole)) < 0.001


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def test_review38_a_numpy_end_past_2_to_the_53_counts_the_last_documents_tokens_exactly():
    """The last document's length is end less its start: with an np.uint64 end that was a float64,
    off past 2^53 tokens, and the packer's count of pieces then disagreed with its own."""
    starts = np.array([2**62 + 413, 2**62 + 2041])
    assert layout.doc_lengths(starts, np.uint64(2**62 + 2064)).tolist() == [1628, 23]
    got = layout.best_fit(starts, np.uint64(2**62 + 2064), 1000)
    assert got.ptr.tolist() == [0, 1, 3] and (got.start - 2**62).tolist() == [413, 1413, 2041] \
        and got.length.tolist() == [1000, 628, 23]
