"""Flat token files: nanoGPT's `.bin` (bare little-endian ids, np.tofile) and llm.c's `.bin`
(a 256-int32 header, then the ids). Both are one token stream in which the tool that wrote it
already put the EOT token between documents (nanoGPT's prepare.py appends it after each
document, llm.c's fineweb.py puts it before each), so the file is served as it is: no EOS is
added, and a "document" is what lies between two EOTs (the files record no other boundary)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from feeder.core.errors import DataLoss, InvalidArgument
from feeder.sources.formats.base import Options, Reader, ShardInfo, chunking, file_ends, head_digest, need_vocab, split

LLMC_HEADER_BYTES = 256 * 4
# llm.c dev/data/data_common.py HEADERS_INFO: magic -> (version, token dtype, model).
LLMC = {20240520: (1, np.dtype("<u2"), "gpt-2"), 20240801: (7, np.dtype("<u4"), "llama-3")}
# GPT-2's vocabulary and <|endoftext|>: what a 20240520 file holds (llm.c writes it for GPT-2 only).
GPT2_VOCAB, GPT2_EOT = 50257, 50256


def is_llmc(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and int(np.frombuffer(head, "<i4")[0]) in LLMC


class TokenFiles(Reader):
    """Files whose tokens are served straight from the memory map, chunk by token range."""

    def __init__(self, fmt: str, root: Path, files: list[tuple[Path, int, int]], *, dtype: np.dtype,
                 vocab_size: int, eos_id: int, chunk_tokens: int, headers: list[bytes]):
        super().__init__(format=fmt, root=root, vocab_size=vocab_size, eos_id=eos_id, dtype=np.dtype(dtype))
        self.files = files               # (path, byte offset of the first token, tokens)
        self.chunk_tokens = chunk_tokens
        self._maps: dict[int, np.ndarray] = {}
        for (path, offset, n), head in zip(files, headers):
            self.shards.append(ShardInfo(path=path.relative_to(root).as_posix(), bytes=path.stat().st_size,
                                         header=head_digest(fmt, path.stat().st_size, head),
                                         chunk_tokens=split(n, chunk_tokens)))

    def _map(self, si: int) -> np.ndarray:
        m = self._maps.get(si)
        if m is None:
            path, offset, n = self.files[si]
            m = np.memmap(path, dtype=self.dtype, mode="r", offset=offset, shape=(n,)) if n else \
                np.empty(0, self.dtype)
            self._maps[si] = m
        return m

    def load(self, si: int, ci: int) -> tuple[np.ndarray, bool]:
        start = ci * self.chunk_tokens
        arr = self._map(si)[start:start + self.shards[si].chunk_tokens[ci]]
        return np.asarray(arr).view(self.dtype), True   # a view of the map, as our Arrow shards

    def where(self, si: int, ci: int, i: int) -> str:
        path, offset, _ = self.files[si]
        return f"{path} at byte offset {offset + (ci * self.chunk_tokens + i) * self.dtype.itemsize}"


def open_nanogpt(path: Path, opts: Options) -> Reader:
    name = opts.dtype or "uint16"   # nanoGPT's prepare.py writes np.uint16
    if name not in ("uint16", "uint32"):
        raise InvalidArgument(f"--dtype for a nanoGPT .bin must be uint16 or uint32, got {name!r}")
    dtype = np.dtype(name).newbyteorder("<")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataLoss(f"{path} is {size} bytes, not a whole number of {name} tokens: truncated, or not {name} "
                       "(--dtype)")
    vocab, eos = need_vocab(f"{path} (a nanoGPT flat .bin)", opts)
    if vocab > 1 << (8 * dtype.itemsize):
        raise InvalidArgument(f"--vocab-size {vocab} does not fit {name} tokens (--dtype)")
    return TokenFiles("nanogpt", path.parent, [(path, 0, size // dtype.itemsize)], dtype=dtype, vocab_size=vocab,
                      eos_id=eos, chunk_tokens=chunking(opts), headers=[file_ends(path)])


def open_llmc(root: Path, paths: list[Path], opts: Options) -> Reader:
    files, heads, kinds = [], [], set()
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read(LLMC_HEADER_BYTES)
        if len(raw) < LLMC_HEADER_BYTES:
            raise DataLoss(f"{path} is {len(raw)} bytes, shorter than llm.c's 1024-byte header")
        header = np.frombuffer(raw, "<i4")
        magic, version, n = int(header[0]), int(header[1]), int(header[2])
        want_version, dtype, model = LLMC[magic]
        if version != want_version:
            raise DataLoss(f"{path}: llm.c header version {version}, expected {want_version} for magic {magic} "
                           f"({model})")
        size = path.stat().st_size
        if size != LLMC_HEADER_BYTES + n * dtype.itemsize:
            raise DataLoss(f"{path} is {size} bytes, its llm.c header says {n} tokens "
                           f"({LLMC_HEADER_BYTES + n * dtype.itemsize} bytes): truncated or altered")
        files.append((path, LLMC_HEADER_BYTES, n))
        heads.append(raw + file_ends(path))
        kinds.add(magic)
    if len(kinds) > 1:
        raise InvalidArgument(f"{root}: llm.c files of different models (magics {sorted(kinds)}) in one dataset")
    magic = kinds.pop()
    # A 20240520 file is GPT-2 tokens by llm.c's definition: its vocabulary and EOT unless told otherwise.
    vocab, eos = need_vocab(f"{root} (llm.c)", opts, **({"vocab_size": GPT2_VOCAB, "eos_id": GPT2_EOT}
                                                        if magic == 20240520 else {}))
    return TokenFiles("llmc", root, files, dtype=LLMC[magic][1], vocab_size=vocab, eos_id=eos,
                      chunk_tokens=chunking(opts), headers=heads)
