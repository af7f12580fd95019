"""Corpora written by the formats' own tools, for tests/test_formats.py and the benchmark:
megatron-core's IndexedDatasetBuilder, datasets' save_to_disk, streaming's MDSWriter, numpy
tofile (nanoGPT) and llm.c's write_datafile. Each takes documents as lists of token ids."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np


def megatron(prefix: Path, docs: list[list[int]], eos: int, *, dtype=np.uint16, sentences: bool = False) -> Path:
    """As preprocess_data.py --append-eod: each document's ids then EOD, one item per document
    (sentences=True: as with --split-sentences, up to three items a document, so the index's
    document table is not one entry per item)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        ids = d + [eos]
        cuts = sorted({len(ids) // 3, 2 * len(ids) // 3} - {0}) if sentences else []
        for lo, hi in zip([0, *cuts], [*cuts, len(ids)]):
            b.add_item(torch.tensor(ids[lo:hi], dtype=torch.int64))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return prefix


def hf(out: Path, docs: list[list[int]], *, column: str = "input_ids", num_shards: int = 3) -> Path:
    import datasets

    ds = datasets.Dataset.from_dict({column: docs, "n": [len(d) for d in docs]},
                                    features=datasets.Features({column: datasets.Sequence(datasets.Value("int32")),
                                                                "n": datasets.Value("int64")}))
    ds.save_to_disk(str(out), num_shards=min(num_shards, len(docs)))
    return out


def mds_writer():
    """streaming's MDSWriter, imported without the `streaming` package's __init__: that imports
    its DataLoader, which needs transformers<5, whose pins (huggingface-hub<1, tokenizers<=0.23.0)
    conflict with ours; the writer itself needs none of it."""
    if "streaming" not in sys.modules:
        root = Path(importlib.util.find_spec("streaming").submodule_search_locations[0])
        for name, path in (("streaming", root), ("streaming.base", root / "base")):
            m = types.ModuleType(name)
            m.__path__ = [str(path)]
            sys.modules[name] = m
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


def mds(out: Path, docs: list[list[int]], *, encoding: str = "ndarray:uint16", column: str = "input_ids",
        size_limit: int = 1 << 14) -> Path:
    """One sample per document; a bytes column holds int64 ids (llm-foundry's np.asarray(...).tobytes())."""
    MDSWriter = mds_writer()
    with MDSWriter(out=str(out), columns={column: encoding, "id": "int"}, size_limit=size_limit) as w:
        for i, d in enumerate(docs):
            value = np.asarray(d, dtype=np.int64).tobytes() if encoding == "bytes" else \
                np.asarray(d, dtype=encoding.split(":")[1])
            w.write({column: value, "id": i})
    return out


def nanogpt(path: Path, docs: list[list[int]], eos: int, dtype=np.uint16) -> Path:
    """As nanoGPT's data/*/prepare.py: the ids of each document then EOT, np.array(...).tofile."""
    ids = [t for d in docs for t in d + [eos]]
    np.array(ids, dtype=dtype).tofile(path)
    return path


def llmc(path: Path, toks: list[int], model_desc: str = "gpt-2") -> Path:
    """llm.c dev/data/data_common.py write_datafile, line for line (HEADERS_INFO and the header)."""
    info = {"gpt-2": {"magic": 20240520, "version": 1, "token_dtype": np.uint16},
            "llama-3": {"magic": 20240801, "version": 7, "token_dtype": np.uint32}}[model_desc]
    header = np.zeros(256, dtype=np.int32)  # header is always 256 int32 values
    header[0] = info["magic"]
    header[1] = info["version"]
    header[2] = len(toks)  # number of tokens after the 256*4 bytes of header
    toks_np = np.array(toks, dtype=info["token_dtype"])
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(toks_np.tobytes())
    return path
