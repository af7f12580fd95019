"""MosaicML Streaming (MDS) directories: index.json lists the shards; a shard file is
[samples: u32][offsets: u32 x (samples + 1)][its config JSON][samples], a sample is
[u32 size of each variable-size column][each column's bytes] (streaming's MDSWriter,
streaming/base/format/mds/writer.py encode_sample and encode_joint_shard).

The token column is `ndarray:DTYPE` (uint16, uint32, int32, int64; with or without a fixed
shape) or `bytes` of little-endian ids of --dtype. A sample is a document and, as for HF
rows, an EOS is added after each. A shard file is a chunk: memory-mapped, decoded with its
EOSes into the bounded chunk cache on first read. Compressed shards are not served in place."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from feeder.sources import manifest as mf
from feeder.core.errors import DataLoss, InvalidArgument
from feeder.sources.formats.base import Options, Reader, ShardInfo, file_ends, head_digest, need_vocab

DEFAULT_COLUMN = "input_ids"
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
# NDArray's shape-dtype codes (streaming/base/format/mds/encodings.py NDArray._int2shape_dtype): bytes per dim.
SHAPE_BYTES = {0: 1, 1: 2, 2: 4, 3: 8}


class MDSReader(Reader):
    def __init__(self, root: Path, opts: Options):
        try:
            index = json.loads((root / "index.json").read_text())
            shards = index["shards"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataLoss(f"{root / 'index.json'} is not an MDS index: {e}") from None
        vocab, eos = need_vocab(f"{root} (an MDS dataset)", opts)
        super().__init__(format="mds", root=root, vocab_size=vocab, eos_id=eos,
                         dtype=np.dtype(mf.dtype_for_vocab(vocab)), adds_eos=True)
        self.column = opts.column or DEFAULT_COLUMN
        self.paths, self.layouts, self._maps = [], [], {}
        for k, s in enumerate(shards):
            if s.get("format") != "mds":
                raise InvalidArgument(f"{root / 'index.json'}: shard {k} is {s.get('format')!r}, only mds is served")
            names = s["column_names"]
            if self.column not in names:
                raise InvalidArgument(f"{root}: no column {self.column!r} (columns: {', '.join(names)}); "
                                      "name the token column with --column")
            if s.get("compression"):
                raise InvalidArgument(f"{root}: shard {k} is compressed ({s['compression']}): compressed MDS shards "
                                      "are not served in place")
            j = names.index(self.column)
            enc = s["column_encodings"][j]
            parts = enc.split(":")
            if parts[0] == "ndarray" and len(parts) >= 2 and parts[1] in TOKEN_DTYPES:
                tdtype = np.dtype(parts[1]).newbyteorder("<")
                header = len(parts) == 2          # no fixed shape: a per-sample [ndim|shape dtype][shape] header
                if len(parts) == 3 and "," in parts[2]:
                    raise InvalidArgument(f"{root}: column {self.column!r} is {enc}, expected one dimension of ids")
            elif enc == "bytes":
                if opts.dtype not in TOKEN_DTYPES:
                    raise InvalidArgument(f"{root}: column {self.column!r} is bytes: pass --dtype "
                                          f"{'|'.join(TOKEN_DTYPES)}, the width of its little-endian ids")
                tdtype, header = np.dtype(opts.dtype).newbyteorder("<"), False
            else:
                raise InvalidArgument(f"{root}: column {self.column!r} is {enc!r}, expected ndarray:"
                                      f"{'|'.join(TOKEN_DTYPES)} or bytes")
            path = root / s["raw_data"]["basename"]
            if not path.is_file():
                raise DataLoss(f"{path} is missing: {root / 'index.json'} lists it")
            if path.stat().st_size != s["raw_data"]["bytes"]:
                raise DataLoss(f"{path} is {path.stat().st_size} bytes, {root / 'index.json'} says "
                               f"{s['raw_data']['bytes']}: truncated or altered")
            sizes = s["column_sizes"]
            layout = dict(n=s["samples"], col=j, sizes=sizes, var=[i for i, z in enumerate(sizes) if z is None],
                          dtype=tdtype, header=header)
            self.paths.append(path)
            self.layouts.append(layout)
            starts, nbytes = self._spans(len(self.paths) - 1)
            n_tokens = int(nbytes.sum()) // tdtype.itemsize + layout["n"]
            self.shards.append(ShardInfo(path=path.relative_to(root).as_posix(), bytes=path.stat().st_size,
                                         header=head_digest("mds", self.column, enc, json.dumps(s, sort_keys=True),
                                                            file_ends(path)),
                                         chunk_tokens=[n_tokens], n_documents=layout["n"]))

    def identity(self) -> dict:
        return {**super().identity(), "column": self.column}

    def _map(self, si: int) -> np.ndarray:
        m = self._maps.get(si)
        if m is None:
            m = self._maps[si] = np.memmap(self.paths[si], dtype=np.uint8, mode="r")
        return m

    def _spans(self, si: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each sample's ids lie in the shard file: (byte starts, byte lengths)."""
        L, data, path = self.layouts[si], self._map(si), self.paths[si]
        n = L["n"]
        if len(data) < 4 * (n + 2) or int(data[:4].view("<u4")[0]) != n:
            raise DataLoss(f"{path}: not an MDS shard of {n} samples (its header says otherwise)")
        offsets = data[4:4 * (n + 2)].view("<u4").astype(np.int64)
        if np.any(np.diff(offsets) < 0) or offsets[-1] != len(data):
            raise DataLoss(f"{path}: its sample offsets are not increasing up to the file's size {len(data)}")
        starts = offsets[:-1]
        if n == 0:
            return starts, starts
        var = L["var"]

        def u32(at: np.ndarray) -> np.ndarray:
            idx = at[:, None] + np.arange(4)
            if idx.size and idx.max() >= len(data):
                raise DataLoss(f"{path}: a sample's header lies past the end of the file")
            return data[idx].copy().view("<u4").reshape(-1).astype(np.int64)

        col_sizes = [u32(starts + 4 * var.index(i)) if z is None else np.full(n, z, np.int64)
                     for i, z in enumerate(L["sizes"])]
        pos = starts + 4 * len(var) + sum(col_sizes[:L["col"]], np.zeros(n, np.int64))
        size = col_sizes[L["col"]]
        if np.any(pos + size > offsets[1:]):
            raise DataLoss(f"{path}: a sample's columns are larger than the sample")
        if L["header"]:
            head = data[np.minimum(pos, len(data) - 1)].astype(np.int64)
            if np.any(head >> 2 != 1):
                raise DataLoss(f"{path}: column {self.column!r} holds an array of other than one dimension")
            skip = 1 + np.vectorize(SHAPE_BYTES.get)(head & 3)
            pos, size = pos + skip, size - skip
        if np.any(size % L["dtype"].itemsize) or np.any(size < 0):
            raise DataLoss(f"{path}: column {self.column!r} holds a value that is not a whole number of "
                           f"{L['dtype'].name} ids")
        return pos, size

    def load(self, si: int, ci: int) -> tuple[np.ndarray, bool]:
        starts, nbytes = self._spans(si)
        data, L = self._map(si), self.layouts[si]
        raw = np.concatenate([data[a:a + b] for a, b in zip(starts.tolist(), nbytes.tolist())]) if len(starts) \
            else np.empty(0, np.uint8)
        vals = raw.view(L["dtype"])
        lengths = nbytes // L["dtype"].itemsize
        bad = np.flatnonzero((vals < 0) | (vals >= self.vocab_size)) if vals.size else []
        if len(bad):   # before the cast to the served width
            i = int(bad[0])
            row = int(np.searchsorted(np.cumsum(lengths), i, side="right"))
            at = int(starts[row]) + (i - int(np.cumsum(lengths)[row - 1] if row else 0)) * L["dtype"].itemsize
            raise DataLoss(f"{self.paths[si]} at byte offset {at} (sample {row}): token id {int(vals[i])} is not in "
                           f"[0, {self.vocab_size}), the vocabulary")
        out = np.full(len(vals) + len(lengths), self.eos_id, dtype=self.dtype)
        dest = np.arange(len(vals), dtype=np.int64) + np.repeat(np.arange(len(lengths)), lengths)
        out[dest] = vals
        return out, False

    def where(self, si: int, ci: int, i: int) -> str:
        return f"{self.paths[si]}: token {i} of its samples"

    def doc_starts(self, si: int, ci: int) -> np.ndarray:
        """A sample is a document, an EOS added after it."""
        _, nbytes = self._spans(si)
        ends = np.cumsum(nbytes // self.layouts[si]["dtype"].itemsize + 1)
        return np.concatenate(([0], ends[:-1])) if len(ends) else ends


def open_mds(root: Path, opts: Options) -> Reader:
    return MDSReader(root, opts)
