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
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from feeder import manifest as mf
from feeder.errors import DataLoss, InvalidArgument
from feeder.sources.posix import PosixSource   # (posix.py imports this package only inside open_source)

log = logging.getLogger("feeder.source")

# Token ranges of a memory-mapped file are checked (sha256, vocabulary) this many at a time
# on first read: 32 MiB of uint16, some tens of milliseconds.
DEFAULT_CHUNK_TOKENS = 16 << 20


@dataclass(frozen=True, kw_only=True)
class Options:
    """What the command line says about a source the format does not describe itself."""

    vocab_size: int = 0          # 0: from the format, where it records it
    eos_id: int = -1
    column: str = ""             # token column (HF, MDS); "" = input_ids
    dtype: str = ""              # token width of a flat file or an MDS bytes column
    index: str = ""              # the sidecar (file, or the directory `feeder index --out` wrote it to)
    chunk_tokens: int = 0        # 0: the sidecar's, else DEFAULT_CHUNK_TOKENS


@dataclass
class ShardInfo:
    """One data file of a format, as the chunk table sees it."""

    path: str                    # relative to the reader's root
    bytes: int
    header: str                  # sha256 of what identifies the file cheaply (headers, index, sizes)
    chunk_tokens: list[int]      # served tokens per chunk (EOS added included)
    n_documents: int = 0


@dataclass
class Reader:
    """A format's files as chunks. Subclasses fill the fields and implement `load`/`where`."""

    format: str
    root: Path
    vocab_size: int
    eos_id: int
    dtype: np.dtype              # of the served stream
    shards: list[ShardInfo] = field(default_factory=list)
    adds_eos: bool = False       # an EOS follows each row (HF, MDS); else the stream is the file's tokens

    def load(self, si: int, ci: int) -> tuple[np.ndarray, bool]:
        """Chunk ci of shard si as served tokens, and whether it is a view of a map."""
        raise NotImplementedError

    def where(self, si: int, ci: int, i: int) -> str:
        """Where token i of a chunk lies in its file, for an error message."""
        raise NotImplementedError

    def doc_starts(self, si: int, ci: int) -> np.ndarray | None:
        """Where the documents the format records start inside chunk ci of shard si (offsets in
        the served chunk), or None: the format records none, a document ends at each EOS."""
        return None

    def identity(self) -> dict:
        """What decides the stream besides the shards' contents (goes into the fingerprint)."""
        return {"kind": "format", "format": self.format, "adds_eos": self.adds_eos}


def need_vocab(what: str, opts: Options, *, vocab_size: int = 0, eos_id: int = -1) -> tuple[int, int]:
    """The vocabulary and EOS: the flags' where given, else the format's; both required."""
    v = opts.vocab_size or vocab_size
    e = opts.eos_id if opts.eos_id >= 0 else eos_id
    if v <= 0 or not 0 <= e < v:
        raise InvalidArgument(f"{what} does not record its vocabulary: pass --vocab-size V and --eos-id E "
                              f"(0 <= E < V), got vocab_size={opts.vocab_size}, eos_id={opts.eos_id}")
    return v, e


def head_digest(*parts: bytes | str | int) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def file_ends(path: Path, n: int = 4096) -> bytes:
    """The first and last n bytes of a file: with its size, what identifies it without reading it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(n)
        f.seek(max(0, size - n))
        return first + f.read(n)


def split(n_tokens: int, chunk_tokens: int) -> list[int]:
    full, rest = divmod(n_tokens, chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


def to_manifest(reader: Reader, shas: list[list[str]] | None) -> mf.Manifest:
    """The reader's chunk table as a manifest: chunk sha256s from a sidecar, or "" (unverified);
    its fingerprint is the content fingerprint with shas, else one of sizes and headers."""
    shards = []
    for si, s in enumerate(reader.shards):
        chunks = tuple(mf.Chunk(n_documents=0, n_tokens=n, sha256=shas[si][ci] if shas else "")
                       for ci, n in enumerate(s.chunk_tokens))
        shards.append(mf.Shard(path=s.path, format=reader.format, n_documents=s.n_documents,
                               n_tokens=sum(s.chunk_tokens), bytes=s.bytes, sha256=s.header, chunks=chunks))
    m = mf.Manifest(tokenizer=reader.identity(), vocab_size=reader.vocab_size, eos_id=reader.eos_id,
                    dtype=np.dtype(reader.dtype).name, shards=tuple(shards))
    return m.with_fingerprint()


def open_format(path: str, opts: Options) -> "Reader | None":
    """The reader of the format `path` is in, recognized by the format's own files; None when
    it is in none of them (the caller tries Parquet, then gives up listing what it looked for)."""
    from feeder.sources.formats import flat, hf, mds, megatron

    p = Path(path)
    if p.is_dir():
        if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            return hf.open_hf(p, opts)
        if (p / "index.json").is_file():
            return mds.open_mds(p, opts)
        if any(p.glob("*.idx")):
            return megatron.open_megatron(p, opts)
        bins = sorted(x for x in p.glob("*.bin") if x.is_file())
        if bins and all(flat.is_llmc(x) for x in bins):
            return flat.open_llmc(p, bins, opts)
        return None
    if Path(path + ".idx").is_file() or (p.suffix in (".bin", ".idx") and p.with_suffix(".idx").is_file()):
        return megatron.open_megatron(p, opts)
    if p.is_file():
        if flat.is_llmc(p):
            return flat.open_llmc(p.parent, [p], opts)
        if p.suffix == ".bin":
            return flat.open_nanogpt(p, opts)
    return None


LOOKED_FOR = ("manifest.json (feeder prep), NAME.idx + NAME.bin (Megatron), state.json or dataset_dict.json "
              "(Hugging Face save_to_disk), index.json (MDS), *.bin with the llm.c header (magic 20240520), "
              "*.parquet (Spark tokens); a nanoGPT .bin is served by its file's path")


class FormatSource(PosixSource):
    """A PosixSource whose chunks the format's reader loads, checked against the vocabulary
    (and the sidecar's sha256, when there is one) on their first read."""

    def __init__(self, reader: Reader, *, name: str, side: Path | None):
        from feeder.sources.formats import sidecar

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


def first_out_of_vocab(arr: np.ndarray, vocab_size: int) -> int | None:
    if not len(arr) or int(arr.max()) < vocab_size:
        return None
    return int(np.flatnonzero(arr >= vocab_size)[0])


def open_any(path: str, opts: Options, *, name: str = ""):
    """A source over `path` if it is in one of these formats, else None."""
    from feeder.sources.formats import sidecar

    side = sidecar.find(path, opts.index)
    if side is not None and not opts.chunk_tokens:   # chunks as the sidecar cut them
        opts = replace(opts, chunk_tokens=sidecar.chunk_tokens(side))
    reader = open_format(path, opts)
    if reader is None:
        return None
    return FormatSource(reader, name=name or Path(path).name, side=side)


def chunking(opts: Options) -> int:
    return opts.chunk_tokens or DEFAULT_CHUNK_TOKENS


__all__ = ["Options", "Reader", "ShardInfo", "open_format", "open_any", "LOOKED_FOR", "FormatSource"]
