"""Tokens/s served from the same corpus in each other tool's format (issue 19) against our own
shards, in the same run: interleaved rounds, medians. The corpus is the bench's, written by
each format's own library where it is installed (the `formats` extra), otherwise that format
is left out and said so."""
from __future__ import annotations

import importlib.util
import statistics
import sys
import types
from pathlib import Path

import numpy as np

from .clients import Clients, Feeder
from .config import BenchConfig, say


def _docs(packed: np.ndarray, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(packed == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [packed[a:b] for a, b in zip(starts.tolist(), ends.tolist())]


def _write(root: Path, packed: np.ndarray, eos: int) -> tuple[dict[str, Path], dict[str, str]]:
    """{format: source}, and {format: why it is left out}."""
    out, skipped = {}, {}
    root.mkdir(parents=True, exist_ok=True)
    docs = _docs(packed, eos)
    nano = root / "nanogpt.bin"          # nanoGPT's train.bin: the packed ids, EOT after each document
    if not nano.exists():
        packed.tofile(nano)
    out["nanogpt"] = nano
    llmc = root / "llmc_train_000000.bin"   # llm.c dev/data/data_common.py write_datafile (GPT-2 layout)
    if not llmc.exists():
        header = np.zeros(256, dtype=np.int32)
        header[:3] = (20240520, 1, len(packed))
        with open(llmc, "wb") as f:
            f.write(header.tobytes())
            f.write(packed.astype(np.uint16).tobytes())
    out["llmc"] = llmc
    try:
        prefix = root / "megatron_text_document"
        if not Path(f"{prefix}.idx").exists():
            import torch
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

            b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
            for d in docs:     # with its EOD, as preprocess_data.py --append-eod stores it
                b.add_item(torch.from_numpy(np.append(d, eos).astype(np.int64)))
                b.end_document()
            b.finalize(f"{prefix}.idx")
        out["megatron"] = prefix
    except ImportError as e:
        skipped["megatron"] = f"megatron-core is not installed ({e.name})"
    try:
        hf = root / "hf"
        if not (hf / "state.json").exists():
            import datasets
            import pyarrow as pa

            lengths = np.array([len(d) for d in docs], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(docs).astype(np.int32)))
            datasets.Dataset(pa.table({"input_ids": col})).save_to_disk(str(hf), num_shards=4)
        out["hf"] = hf
    except ImportError as e:
        skipped["hf"] = f"datasets is not installed ({e.name})"
    try:
        mds = root / "mds"
        if not (mds / "index.json").exists():
            MDSWriter = _mds_writer()
            with MDSWriter(out=str(mds), columns={"input_ids": "ndarray:uint16"}, size_limit=1 << 26) as w:
                for d in docs:
                    if len(d):   # MDS's ndarray encoding refuses an empty array
                        w.write({"input_ids": np.ascontiguousarray(d, dtype=np.uint16)})
        out["mds"] = mds
    except (ImportError, AttributeError) as e:
        skipped["mds"] = f"mosaicml-streaming is not installed ({e})"
    return out, skipped


def _mds_writer():
    """streaming's MDSWriter without the package's __init__ (which imports its DataLoader and so
    transformers<5; see pyproject.toml's formats extra)."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            raise ImportError("streaming")
        root = Path(spec.submodule_search_locations[0])
        for name, path in (("streaming", root), ("streaming.base", root / "base")):
            m = types.ModuleType(name)
            m.__path__ = [str(path)]
            sys.modules[name] = m
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


def format_figures(cfg: BenchConfig, data: dict, clients: Clients) -> dict:
    """{"formats": {name: {"tokens_s", "ratio_to_shards"}}, "formats_shards_tokens_s", "formats_skipped"}."""
    from feeder.sources import manifest as mf

    m = mf.read(data["shards"])
    packed = np.memmap(data["packed"], dtype=np.uint16, mode="r")
    sources, skipped = _write(Path(cfg.data) / "formats", packed, m.eos_id)
    flags = ["--vocab-size", str(m.vocab_size), "--eos-id", str(m.eos_id)]
    feeders = {"shards": Feeder(data["shards"], message_bytes=cfg.message_bytes)}
    try:
        for name, src in sources.items():
            feeders[name] = Feeder(str(src), message_bytes=cfg.message_bytes, extra=flags)
        runs: dict[str, list[float]] = {k: [] for k in feeders}
        for i in range(cfg.rounds):
            say(f"formats, round {i + 1} of {cfg.rounds}: {', '.join(feeders)} ({cfg.ranks} ranks, compression off)")
            for name, f in feeders.items():
                got = clients.count([f.address], f"fmt-{name}-{i}", cfg.ranks, seq_len=cfg.seq_len,
                                    mb=cfg.micro_batch, seconds=cfg.seconds)
                runs[name].append(got["tokens_s"])
    finally:
        for f in feeders.values():
            f.stop()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"formats": {k: {"tokens_s": v, "ratio_to_shards": v / med["shards"], "rounds": runs[k]}
                        for k, v in med.items() if k != "shards"},
            "formats_shards_tokens_s": med["shards"], "formats_shards_rounds": runs["shards"],
            "formats_skipped": skipped}
