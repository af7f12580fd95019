"""Megatron-LM / Megatron-DeepSpeed indexed datasets: NAME.bin (the tokens of every document,
back to back) and NAME.idx ("MMIDIDX" version 1: dtype, sequence lengths and byte pointers,
document indices), as megatron.core.datasets.indexed_dataset writes them.

The .bin is served from its memory map as it lies, no EOS added: Megatron's own GPTDataset
concatenates documents exactly so, and an EOD is in the data when preprocess_data.py was run
with --append-eod (it is stored at each document's end). So the samples are Megatron's."""
from __future__ import annotations

import bisect
import os
import struct
from pathlib import Path

import numpy as np

from feeder.core.errors import DataLoss, InvalidArgument, NotFound
from feeder.sources.formats.base import Options, Reader, chunking, head_digest, need_vocab
from feeder.sources.formats.flat import TokenFiles

MAGIC = b"MMIDIDX\x00\x00"
HEADER = len(MAGIC) + 8 + 1 + 8 + 8          # magic, version <Q, dtype code <B, sequences <Q, documents <Q
# indexed_dataset.DType codes of the token widths Megatron writes (uint16 below a 65500 vocabulary,
# int32 above); int32 ids are served as uint32 (a negative one is then caught by the vocabulary check).
DTYPES = {8: np.dtype("<u2"), 4: np.dtype("<u4")}
CODE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


def read_index(idx: Path, bin_: Path) -> tuple[np.dtype, int, int, bytes]:
    """(token dtype, tokens in the .bin, documents, header bytes) after checking the .idx
    against itself and the .bin's size."""
    if not bin_.is_file():
        raise NotFound(f"{idx} has no {bin_.name} beside it")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEADER)
        if len(head) < HEADER or head[:len(MAGIC)] != MAGIC:
            raise DataLoss(f"{idx} is not a Megatron index: it starts {head[:len(MAGIC)]!r}, expected {MAGIC!r}")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != 1:
            raise DataLoss(f"{idx}: MMIDIDX version {version}, only version 1 is known")
        if code not in DTYPES:
            raise DataLoss(f"{idx}: token dtype {CODE_NAMES.get(code, f'code {code}')} is not served "
                           "(Megatron writes uint16 or int32)")
        want = HEADER + 12 * n_seq + 8 * n_doc
        if size not in (want, want + n_seq):     # + one mode byte per sequence: multimodal
            raise DataLoss(f"{idx} is {size} bytes, its header's {n_seq} sequences and {n_doc} document indices "
                           f"need {want}: truncated or altered")
        dtype = DTYPES[code]
        if n_seq == 0:
            last_ptr = last_len = 0
        else:
            f.seek(HEADER + 4 * (n_seq - 1))
            (last_len,) = struct.unpack("<i", f.read(4))
            f.seek(HEADER + 4 * n_seq + 8 * (n_seq - 1))
            (last_ptr,) = struct.unpack("<q", f.read(8))
        f.seek(HEADER + 12 * n_seq)
        first_doc = struct.unpack("<q", f.read(8))[0] if n_doc else 0
        f.seek(HEADER + 12 * n_seq + 8 * (n_doc - 1))
        last_doc = struct.unpack("<q", f.read(8))[0] if n_doc else 0
        if n_doc < 1 or first_doc != 0 or last_doc != n_seq:
            raise DataLoss(f"{idx}: document indices run from {first_doc} to {last_doc}, expected 0 to {n_seq}")
        f.seek(0)
        summary = f.read(min(size, 1 << 20))    # with the size: what identifies the index cheaply
    need = last_ptr + last_len * dtype.itemsize
    have = bin_.stat().st_size
    if have != need:
        raise DataLoss(f"{bin_} is {have} bytes, its index {idx.name} describes {need}: "
                       + ("the .bin is truncated" if have < need else "the .idx belongs to other data"))
    return dtype, need // dtype.itemsize, n_doc - 1, summary


class MegatronFiles(TokenFiles):
    """The .bin files of Megatron prefixes, whose documents are those their .idx records."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._docs: dict[int, tuple["IdxArray", "IdxArray"]] = {}
        self._ends = np.cumsum([sum(s.chunk_tokens) for s in self.shards], dtype=np.int64)   # each file's end

    def _index(self, si: int) -> tuple["IdxArray", "IdxArray"]:
        """File si's sequence byte pointers and each document's first sequence, in its .idx
        (searched where asked, never read whole: 10^9 documents are 16 GB)."""
        got = self._docs.get(si)
        if got is None:
            idx = Path(f"{self.files[si][0].with_suffix('')}.idx")
            with open(idx, "rb") as f:
                n_seq, n_doc = struct.unpack("<QQ", f.read(HEADER)[HEADER - 16:])
            got = self._docs[si] = (IdxArray(idx, HEADER + 4 * n_seq, n_seq),
                                    IdxArray(idx, HEADER + 12 * n_seq, max(n_doc - 1, 0)))
        return got

    def doc_starts(self, si: int, ci: int) -> np.ndarray:
        pointers, first_seq = self._index(si)
        size = self.dtype.itemsize
        lo = ci * self.chunk_tokens
        hi = lo + self.shards[si].chunk_tokens[ci]
        seqs = pointers.search((lo * size, hi * size))                       # sequences starting in the chunk
        docs = first_seq.search(seqs)                                        # documents starting with one of them
        return self._starts(si, docs[0], docs[1]) - lo

    def _starts(self, si: int, d0: int, d1: int) -> np.ndarray:
        """Where documents [d0, d1) of file si start (tokens of the file), read from the .idx
        with two reads, not through its memory map: pages read through a map stay in the
        process's resident memory, and a packing reads the whole index (20 GB at 10^9)."""
        pointers, first_seq = self._index(si)
        if d1 <= d0:
            return np.zeros(0, np.int64)
        first = first_seq.read(d0, d1)
        ptrs = pointers.read(int(first[0]), int(first[-1]) + 1)
        first -= first[0]   # (in place, as below: a packing's block is 10^6 documents on every core, and
        out = ptrs[first]   # each temporary of that size was fresh memory to fault in)
        out //= self.dtype.itemsize
        return out

    def doc_spans(self, lo: int, hi: int) -> tuple[np.ndarray, int]:
        """From the .idx alone, one search per file the range touches (not per chunk): the
        documents starting in [lo, hi) and the start of the one after them (a file's documents
        end with it; the next file's first starts at its first token)."""
        ends = self._ends
        size = self.dtype.itemsize
        parts, end = [], int(ends[-1])
        si = int(np.searchsorted(ends, lo, side="right"))
        while si < len(ends):
            base = int(ends[si - 1]) if si else 0
            pointers, first_seq = self._index(si)
            a, b = max(lo, base) - base, min(hi, int(ends[si])) - base
            seqs = pointers.search((a * size, b * size))
            docs = first_seq.search(seqs)
            starts = self._starts(si, docs[0], docs[1])
            starts += base
            parts.append(starts)
            if docs[1] < len(first_seq):            # the next document starts in this file
                end = int(pointers[int(first_seq[docs[1]])]) // size + base
                break
            end = int(ends[si])
            if int(ends[si]) >= hi:
                break
            si += 1
        return (np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, np.int64)), end


class IdxArray:
    """An int64 array of an .idx, read where asked with pread: entries for a bisection, ranges
    for a block. Not a memory map: numpy searches the index's arrays (at offsets that are not
    multiples of 8) only after copying them whole, 800 MB per search at 10^8 documents (what
    made a packing take hours), and every page a search or a read touches through a map stays
    in the process's resident memory (3 GB of a 20 GB index over a packing of 10^9 documents).
    The file is opened per call, not held: a dataset may be thousands of prefixes."""

    def __init__(self, path: Path, offset: int, n: int):
        self.path, self.offset, self.n = path, offset, n

    def __len__(self) -> int:
        return self.n

    def search(self, values) -> list[int]:
        """np.searchsorted(self, values) (left), by bisection of the file's entries."""
        with open(self.path, "rb", buffering=0) as f:
            at = _Entries(self, f.fileno())
            return [bisect.bisect_left(at, v) for v in values]

    def __getitem__(self, i: int) -> int:
        with open(self.path, "rb", buffering=0) as f:
            return _Entries(self, f.fileno())[i]

    def read(self, a: int, b: int) -> np.ndarray:
        """Entries [a, b), in memory of their own."""
        out = np.empty(max(b - a, 0), dtype="<i8")
        if len(out):
            with open(self.path, "rb", buffering=0) as f:
                if b > self.n or os.preadv(f.fileno(), [out], self.offset + 8 * a) != out.nbytes:
                    raise DataLoss(f"{self.path} ends before its entry {b - 1}: truncated while served")
        return out.astype(np.int64, copy=False)


class _Entries:
    """An IdxArray's entries through one open file, as bisect reads them."""

    def __init__(self, table: IdxArray, fd: int):
        self.table, self.fd = table, fd

    def __len__(self) -> int:
        return self.table.n

    def __getitem__(self, i: int) -> int:
        t = self.table
        got = os.pread(self.fd, 8, t.offset + 8 * i) if 0 <= i < t.n else b""
        if len(got) != 8:
            raise DataLoss(f"{t.path} has no entry {i} where its header puts it: truncated while served")
        return int.from_bytes(got, "little", signed=True)


def open_megatron(path: Path, opts: Options) -> Reader:
    """A prefix (PATH.bin + PATH.idx; PATH may name either file), or a directory of prefixes
    served as one dataset in sorted order."""
    if path.is_dir():
        prefixes = sorted(p.with_suffix("") for p in path.glob("*.idx"))
        root = path
    else:
        prefixes = [path.with_suffix("") if path.suffix in (".bin", ".idx") else path]
        root = prefixes[0].parent
    files, heads, docs, dtypes = [], [], [], set()
    for prefix in prefixes:
        idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        dtype, n, n_doc, summary = read_index(idx, bin_)
        files.append((bin_, 0, n))
        heads.append(summary)
        docs.append(n_doc)
        dtypes.add(dtype)
    if len(dtypes) > 1:
        raise InvalidArgument(f"{root}: Megatron prefixes of different token dtypes in one dataset")
    dtype = dtypes.pop()
    vocab, eos = need_vocab(f"{path} (a Megatron indexed dataset)", opts)
    if vocab > 1 << (8 * dtype.itemsize):
        raise InvalidArgument(f"--vocab-size {vocab} does not fit the index's {dtype.name} tokens")
    reader = MegatronFiles("megatron", root, files, dtype=dtype, vocab_size=vocab, eos_id=eos,
                           chunk_tokens=chunking(opts), headers=heads)
    for s, n_doc, (bin_, _, _) in zip(reader.shards, docs, files):
        s.n_documents = n_doc
        s.header = head_digest(s.header, Path(f"{bin_.with_suffix('')}.idx").stat().st_size)
    return reader
