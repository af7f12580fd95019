"""What every format's reader shares: its options, the Reader it implements, the chunk table
it becomes (a manifest), and the checks a chunk gets on its first read. Imports no format."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from feeder.sources import manifest as mf
from feeder.core.errors import InvalidArgument

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

    def doc_spans(self, lo: int, hi: int) -> tuple[np.ndarray, int] | None:
        """Where the documents that start in served tokens [lo, hi) start (int64, sorted) and where
        the last of them ends, read straight from the format's own table in whole arrays; None
        where the format has no table to read so (then its chunks are asked one by one)."""
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


LOOKED_FOR = ("manifest.json (feeder prep), NAME.idx + NAME.bin (Megatron), state.json or dataset_dict.json "
              "(Hugging Face save_to_disk), index.json (MDS), *.bin with the llm.c header (magic 20240520), "
              "*.parquet (Spark tokens); a nanoGPT .bin is served by its file's path")


def first_out_of_vocab(arr: np.ndarray, vocab_size: int) -> int | None:
    if not len(arr) or int(arr.max()) < vocab_size:
        return None
    return int(np.flatnonzero(arr >= vocab_size)[0])


def chunking(opts: Options) -> int:
    return opts.chunk_tokens or DEFAULT_CHUNK_TOKENS
