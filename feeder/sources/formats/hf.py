"""Hugging Face `datasets` saved with `save_to_disk`: a directory with state.json (its Arrow
files, in order) and dataset_info.json, each file an Arrow IPC stream of record batches; or a
DatasetDict directory (dataset_dict.json) of such directories, one per split.

A row is a document. Rows are tokenizer outputs, which do not end with EOS (`datasets.map` of
a tokenizer gives ids without it), so an EOS is added after each row, as for Spark Parquet:
the stream is `feeder prep`'s of the same documents. A record batch is a chunk: its rows are
read from the memory map and decoded with their EOSes into the bounded chunk cache."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from feeder.sources import manifest as mf
from feeder.core.errors import DataLoss, InvalidArgument
from feeder.sources.formats.base import Options, Reader, ShardInfo, file_ends, head_digest, need_vocab
from feeder.sources.posix import rows_doc_starts, with_eos

DEFAULT_COLUMN = "input_ids"


def split_dir(root: Path) -> Path:
    """A DatasetDict's one split, or the directory itself."""
    if not (root / "dataset_dict.json").is_file():
        return root
    try:
        splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss(f"{root / 'dataset_dict.json'} is not a datasets DatasetDict: {e}") from None
    if len(splits) != 1:
        raise InvalidArgument(f"{root} is a DatasetDict of splits {', '.join(splits)}: serve one of them, "
                              f"e.g. --source {root / splits[0]}")
    return root / splits[0]


class HFReader(Reader):
    def __init__(self, root: Path, opts: Options):
        root = split_dir(root)
        try:
            state = json.loads((root / "state.json").read_text())
            names = [f["filename"] for f in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataLoss(f"{root / 'state.json'} is not a datasets save_to_disk state: {e}") from None
        vocab, eos = need_vocab(f"{root} (a Hugging Face dataset)", opts)
        super().__init__(format="hf", root=root, vocab_size=vocab, eos_id=eos,
                         dtype=np.dtype(mf.dtype_for_vocab(vocab)), adds_eos=True)
        self.column = opts.column or DEFAULT_COLUMN
        self.paths = [root / n for n in names]
        self.batches: list[list[pa.Array]] = []     # per file, the column of each record batch (mapped)
        self.rows: list[list[int]] = []             # per file, the first row of each batch
        for path in self.paths:
            if not path.is_file():
                raise DataLoss(f"{path} is missing: {root / 'state.json'} lists it")
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(path), "r"))
                schema = reader.schema
                if self.column not in schema.names:
                    raise InvalidArgument(f"{path}: no column {self.column!r} (columns: {', '.join(schema.names)}); "
                                          "name the token column with --column")
                t = schema.field(self.column).type
                if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_integer(t.value_type):
                    raise InvalidArgument(f"{path}: column {self.column!r} is {t}, expected a list of integer ids")
                cols = [b.column(self.column) for b in reader]
            except pa.ArrowInvalid as e:
                raise DataLoss(f"{path} is not a readable Arrow stream: {e}") from None
            firsts, chunk_tokens, n_rows = [], [], 0
            for c in cols:
                off = c.offsets
                firsts.append(n_rows)
                n_rows += len(c)
                chunk_tokens.append(int(off[len(c)].as_py()) - int(off[0].as_py()) + len(c) if len(c) else 0)
            self.batches.append(cols)
            self.rows.append(firsts)
            self.shards.append(ShardInfo(path=path.relative_to(root).as_posix(), bytes=path.stat().st_size,
                                         header=head_digest("hf", self.column, path.stat().st_size, file_ends(path)),
                                         chunk_tokens=chunk_tokens, n_documents=n_rows))

    def identity(self) -> dict:
        return {**super().identity(), "column": self.column}

    def load(self, si: int, ci: int) -> tuple[np.ndarray, bool]:
        col = self.batches[si][ci]
        vals = col.flatten().to_numpy(zero_copy_only=False)
        if vals.size and vals.min() < 0:
            i = int(np.flatnonzero(vals < 0)[0])
            row = int(np.searchsorted(np.asarray(col.offsets)[1:] - col.offsets[0].as_py(), i, side="right"))
            raise DataLoss(f"{self.paths[si]}: row {self.rows[si][ci] + row} of the file holds token id "
                           f"{int(vals[i])}, below 0")
        if vals.size and vals.max() >= self.vocab_size:   # before the cast to the served width
            i = int(np.flatnonzero(vals >= self.vocab_size)[0])
            row = int(np.searchsorted(np.asarray(col.offsets)[1:] - col.offsets[0].as_py(), i, side="right"))
            raise DataLoss(f"{self.paths[si]}: row {self.rows[si][ci] + row} of the file: token id {int(vals[i])} "
                           f"is not below the vocabulary size {self.vocab_size}")
        return with_eos(col, self.eos_id, self.dtype), False

    def where(self, si: int, ci: int, i: int) -> str:
        return f"{self.paths[si]}: record batch {ci}, token {i}"

    def doc_starts(self, si: int, ci: int) -> np.ndarray:
        return rows_doc_starts(self.batches[si][ci], adds_eos=True)   # a row is a document, EOS added


def open_hf(root: Path, opts: Options) -> Reader:
    return HFReader(root, opts)
