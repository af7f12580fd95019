"""manifest.json: what a dataset directory holds, and its fingerprint.

The fingerprint hashes everything that decides the packed token stream (tokenizer,
vocabulary, shard order, counts and checksums) and nothing about where it lives, so
every region's replica of a dataset has the same fingerprint and a differing replica
does not.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from feeder.core.errors import DataLoss, NotFound

FORMAT = "feeder-shards/1"
NAME = "manifest.json"


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """A record batch (Arrow) or row group (Parquet): the unit checksummed when first read."""

    n_documents: int
    n_tokens: int       # EOS included
    sha256: str         # of the chunk's tokens (EOS included) as little-endian `dtype`


@dataclass(frozen=True, kw_only=True)
class Shard:
    path: str           # relative to the manifest's directory
    format: str         # "arrow" (EOS stored) or "parquet" (Spark lists, EOS added when read)
    n_documents: int
    n_tokens: int
    bytes: int
    sha256: str         # of the whole file
    chunks: tuple[Chunk, ...]
    tokens_column: str = "tokens"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    tokenizer: dict
    vocab_size: int
    eos_id: int
    dtype: str
    shards: tuple[Shard, ...]
    fingerprint: str = ""

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.shards)

    @property
    def n_documents(self) -> int:
        return sum(s.n_documents for s in self.shards)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("fingerprint")
        return {"format": FORMAT, **d, "n_documents": self.n_documents, "n_tokens": self.n_tokens}

    def with_fingerprint(self) -> "Manifest":
        return Manifest(**{**self.__dict__, "fingerprint": compute_fingerprint(self.to_json())})


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def compute_fingerprint(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


def write(directory: str | os.PathLike, manifest: Manifest) -> Manifest:
    manifest = manifest.with_fingerprint()
    path = Path(directory) / NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**manifest.to_json(), "fingerprint": manifest.fingerprint}, indent=1))
    os.replace(tmp, path)  # readers never see half a manifest
    return manifest


def read(directory: str | os.PathLike) -> Manifest:
    path = Path(directory) / NAME
    if not path.is_file():
        raise NotFound(f"{path} does not exist: expected a dataset written by `feeder prep`")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise DataLoss(f"{path}: format {raw.get('format')!r} is not supported, expected {FORMAT!r}")
        shards = tuple(
            Shard(**{**s, "chunks": tuple(Chunk(**c) for c in s["chunks"])}) for s in raw["shards"])
        m = Manifest(tokenizer=raw["tokenizer"], vocab_size=raw["vocab_size"], eos_id=raw["eos_id"],
                     dtype=raw["dtype"], shards=shards)
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss(f"{path} is not a valid manifest: {e}") from None
    m = m.with_fingerprint()
    if raw.get("fingerprint") != m.fingerprint:
        raise DataLoss(f"{path} was modified after it was written: its fingerprint "
                       f"{raw.get('fingerprint')} does not match its content ({m.fingerprint})")
    return m


def file_sha256(path: str | os.PathLike, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
