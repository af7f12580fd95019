"""`feeder index SOURCE`: the sidecar of a source in another tool's format: each chunk's sha256
and the content fingerprint, so a feeder checks every chunk on first read as it does our
shards, and every replica of the same bytes has the same fingerprint.

Chunks are hashed in parallel (hashlib and numpy let go of the GIL on large buffers); each
finished chunk is appended to SIDECAR.partial, so an interrupted run goes on where it stopped
(when the files' sizes and headers are still those it started on). The sidecar is written
whole, by rename, at the end."""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from feeder.core.errors import DataLoss, InvalidArgument, NotFound
from feeder.sources.formats.base import LOOKED_FOR, Options, Reader, chunking, first_out_of_vocab, to_manifest
from feeder.sources.formats.kinds import open_format

FORMAT = "feeder-index/1"
NAME = "feeder-index.json"


def default_path(source: str, out: str = "") -> Path:
    """Next to the data (DIR/feeder-index.json, or PATH.feeder-index.json for a file or a
    prefix), or in `out` under the same file name."""
    p = Path(source)
    name = NAME if p.is_dir() else f"{p.name}.{NAME}"
    return Path(out) / name if out else (p / NAME if p.is_dir() else p.parent / name)


def find(source: str, given: str = "") -> Path | None:
    """The sidecar a feeder reads: --index (a file, or the directory it was written to), else the
    one next to the data; None when there is none (the source is served unverified)."""
    if given:
        p = Path(given)
        p = default_path(source, given) if p.is_dir() else p
        if not p.is_file():
            raise NotFound(f"--index {given}: no sidecar {p} (write one with `feeder index {source} --out DIR`)")
        return p
    p = default_path(source)
    return p if p.is_file() else None


def _read(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
        return raw
    except (OSError, ValueError, AttributeError) as e:
        raise DataLoss(f"{path} is not a feeder index sidecar: {e}") from None


def chunk_tokens(path: Path) -> int:
    return int(_read(path)["chunk_tokens"])


def _table(reader: Reader) -> list[dict]:
    return [{"path": s.path, "bytes": s.bytes, "header": s.header, "chunk_tokens": s.chunk_tokens}
            for s in reader.shards]


def load(path: Path, reader: Reader) -> list[list[str]]:
    """The chunk sha256s of a sidecar made for exactly these files and settings."""
    raw = _read(path)
    want = {"source_format": reader.format, "vocab_size": reader.vocab_size, "eos_id": reader.eos_id,
            "dtype": reader.dtype.name, "identity": reader.identity()}
    for k, v in want.items():
        if raw.get(k) != v:
            raise InvalidArgument(f"{path} was made with {k}={raw.get(k)!r}, this feeder reads {k}={v!r}: "
                                  "run `feeder index` again with the same flags as `feeder serve`")
    have = [{k: s[k] for k in ("path", "bytes", "header", "chunk_tokens")} for s in raw["shards"]]
    for a, b in zip(have + [None] * len(reader.shards), _table(reader)):
        if a != b:
            raise DataLoss(f"{path} was made for other files: {b['path']} is not as it was indexed "
                           f"(size or headers differ, or files were added or removed)")
    if len(have) != len(reader.shards):
        raise DataLoss(f"{path} lists {len(have)} files, the source has {len(reader.shards)}")
    shas = [s["sha256"] for s in raw["shards"]]
    if to_manifest(reader, shas).fingerprint != raw.get("fingerprint"):
        raise DataLoss(f"{path} was modified after it was written: its fingerprint does not match its content")
    return shas


def index(source: str, opts: Options, *, out: str = "", workers: int = 0, progress: bool = True) -> dict:
    """Hash every chunk of `source` (resuming a run interrupted on the same files); write the sidecar."""
    from feeder.core.progress import Progress

    opts = replace(opts, chunk_tokens=chunking(opts), index="")
    reader = open_format(source, opts)
    if reader is None:
        raise NotFound(f"{source}: no dataset format recognized to index; looked for {LOOKED_FOR}")
    path = default_path(source, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    key = hashlib.sha256(json.dumps(_table(reader), sort_keys=True).encode()).hexdigest()
    done: dict[tuple[int, int], str] = {}
    if partial.is_file():
        lines = partial.read_text().splitlines()
        if lines and lines[0] == key:       # the same files as when it stopped: go on
            for line in lines[1:]:
                try:
                    si, ci, sha = json.loads(line)
                    done[(si, ci)] = sha
                except ValueError:
                    break                    # a line cut by the interruption
    todo = [(si, ci) for si, s in enumerate(reader.shards) for ci in range(len(s.chunk_tokens))
            if (si, ci) not in done]
    total = sum(reader.shards[si].chunk_tokens[ci] for si, ci in todo) * reader.dtype.itemsize
    bar = Progress(f"index {source}", total, enabled=progress)

    def one(k):
        si, ci = k
        arr, _ = reader.load(si, ci)
        bad = first_out_of_vocab(arr, reader.vocab_size)
        if bad is not None:
            raise DataLoss(f"{reader.where(si, ci, bad)}: token id {int(arr[bad])} is not below the vocabulary "
                           f"size {reader.vocab_size}")
        return k, hashlib.sha256(arr).hexdigest(), len(arr)

    with open(partial, "w") as log:   # rewritten whole: a line cut by the interruption goes
        log.write(key + "\n")
        for (si, ci), sha in done.items():
            log.write(json.dumps([si, ci, sha]) + "\n")
        with ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
            for (si, ci), sha, n in pool.map(one, todo):
                done[(si, ci)] = sha
                log.write(json.dumps([si, ci, sha]) + "\n")
                log.flush()
                bar.advance(tokens=n, nbytes=n * reader.dtype.itemsize)
    bar.close()
    shas = [[done[(si, ci)] for ci in range(len(s.chunk_tokens))] for si, s in enumerate(reader.shards)]
    m = to_manifest(reader, shas)
    body = {"format": FORMAT, "source_format": reader.format, "vocab_size": reader.vocab_size,
            "eos_id": reader.eos_id, "dtype": reader.dtype.name, "identity": reader.identity(),
            "chunk_tokens": opts.chunk_tokens, "n_tokens": m.n_tokens, "n_documents": m.n_documents,
            "shards": [{**t, "sha256": shas[si]} for si, t in enumerate(_table(reader))],
            "fingerprint": m.fingerprint}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path)
    partial.unlink()
    return {"path": str(path), "fingerprint": m.fingerprint, "n_tokens": m.n_tokens,
            "chunks": sum(len(s) for s in shas), "hashed": len(todo), "bytes": sum(s.bytes for s in reader.shards)}
