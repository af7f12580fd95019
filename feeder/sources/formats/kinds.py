"""The formats, recognized by their own files: which reader a path is in."""
from __future__ import annotations

from pathlib import Path

from feeder.sources.formats import flat, hf, mds, megatron
from feeder.sources.formats.base import Options, Reader


def open_format(path: str, opts: Options) -> "Reader | None":
    """The reader of the format `path` is in, recognized by the format's own files; None when
    it is in none of them (the caller tries Parquet, then gives up listing what it looked for)."""
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
