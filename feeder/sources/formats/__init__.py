"""Tokenized corpora in the formats of other tools, served where they lie (issue 19).

Each format is read as the same thing a `feeder prep` dataset is: a packed token stream cut into
chunks. A format's reader (megatron.py, hf.py, mds.py, flat.py) says what its chunks are (token
ranges of a memory-mapped file, Arrow record batches, MDS shard files) and how one is read; the
chunk table becomes a manifest (feeder.manifest) and `FormatSource` is a `PosixSource` over it,
so the plans, the zero-copy row path, the decoded-chunk cache and the first-read checks are
PosixSource's, not a second copy. What a format adds:

* the vocabulary check on every chunk's first read: an id >= vocab (or < 0) is DATA_LOSS naming
  the file and the byte offset (or row), never served;
* with a sidecar written by `feeder index` (sidecar.py), each chunk's sha256 is checked on its
  first read exactly like our shards', and the fingerprint is the content's; without one the
  fingerprint is made from file sizes and headers and the source is logged as unverified.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from feeder.core.errors import DataLoss
from feeder.sources.formats import sidecar
from feeder.sources.formats.base import (LOOKED_FOR, Options, Reader, ShardInfo, chunking, first_out_of_vocab,
                                         to_manifest)
from feeder.sources.formats.kinds import open_format
from feeder.sources.posix import PosixSource

log = logging.getLogger("feeder.source")


class FormatSource(PosixSource):
    """A PosixSource whose chunks the format's reader loads, checked against the vocabulary
    (and the sidecar's sha256, when there is one) on their first read."""

    def __init__(self, reader: Reader, *, name: str, side: Path | None):
        shas = sidecar.load(side, reader) if side else None
        m = to_manifest(reader, shas)
        if shas is None:
            log.warning("dataset %s (%s at %s) is UNVERIFIED: no `feeder index` sidecar; its fingerprint %s "
                        "is made from file sizes and headers, and chunks are not checksummed",
                        name, reader.format, reader.root, m.fingerprint[:16])
        else:
            log.info("dataset %s (%s): chunks verified on first read against %s", name, reader.format, side)
        self.reader, self.verified = reader, shas is not None
        super().__init__(reader.root, name=name, manifest=m)

    def _load(self, si: int, ci: int) -> tuple[np.ndarray, bool]:
        try:
            return self.reader.load(si, ci)
        except DataLoss as e:   # found while decoding (an id out of range before the cast): as _check's
            self._bad[si] = str(e)
            log.error("dataset %s: %s", self.name, e)
            raise

    def _chunk_doc_starts(self, si: int, ci: int) -> np.ndarray | None:
        return self.reader.doc_starts(si, ci)

    def doc_spans(self, lo: int, hi: int) -> tuple[np.ndarray, int]:
        """The format's own table where it has one (Megatron's index: whole arrays, not chunk by
        chunk), else PosixSource's chunk by chunk."""
        lo, hi = max(0, lo), min(hi, self.n_tokens)
        got = self.reader.doc_spans(lo, hi) if lo < hi else None
        return got if got is not None else super().doc_spans(lo, hi)

    def _check(self, si: int, ci: int, arr: np.ndarray) -> str:
        shard, reader = self.manifest.shards[si], self.reader
        want = shard.chunks[ci]
        if len(arr) != want.n_tokens:
            return f"{shard.path}: chunk {ci} holds {len(arr)} tokens, the index of the files says {want.n_tokens}"
        bad = first_out_of_vocab(arr, reader.vocab_size)
        if bad is not None:
            return (f"{reader.where(si, ci, bad)}: token id {int(arr[bad])} is not below the vocabulary size "
                    f"{reader.vocab_size}")
        if want.sha256 and hashlib.sha256(arr).hexdigest() != want.sha256:
            return f"{shard.path} is corrupt: chunk {ci} failed its sha256 check against the sidecar (`feeder index`)"
        return ""


def open_any(path: str, opts: Options, *, name: str = ""):
    """A source over `path` if it is in one of these formats, else None."""
    side = sidecar.find(path, opts.index)
    if side is not None and not opts.chunk_tokens:   # chunks as the sidecar cut them
        opts = replace(opts, chunk_tokens=sidecar.chunk_tokens(side))
    reader = open_format(path, opts)
    if reader is None:
        return None
    return FormatSource(reader, name=name or Path(path).name, side=side)


__all__ = ["Options", "Reader", "ShardInfo", "open_format", "open_any", "LOOKED_FOR", "FormatSource", "chunking"]
