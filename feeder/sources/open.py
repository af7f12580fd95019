"""Opening a dataset by where it lies: the one place that knows every kind of source (the
server opens its `--source`s here; a mixture is made of sources opened here)."""
from __future__ import annotations

import logging
from pathlib import Path

from feeder.core.config import ServeConfig
from feeder.core.errors import NotFound
from feeder.sources import Source
from feeder.sources import formats
from feeder.sources import manifest as mf
from feeder.sources.posix import PosixSource, index_parquet

log = logging.getLogger("feeder.source")


def open_source(root: str, *, vocab_size: int = 0, eos_id: int = -1, name: str = "", column: str = "",
                dtype: str = "", index: str = "") -> PosixSource:
    """A manifest dataset; a corpus in another tool's format (feeder.sources.formats: Megatron,
    Hugging Face save_to_disk, MDS, nanoGPT, llm.c), served where it lies; or a Parquet token
    dataset indexed on the fly."""
    if (Path(root) / mf.NAME).is_file():
        return PosixSource(root, name=name)
    src = formats.open_any(root, formats.Options(vocab_size=vocab_size, eos_id=eos_id, column=column, dtype=dtype,
                                                 index=index), name=name)
    if src is not None:
        return src
    if not Path(root).is_dir():
        raise NotFound(f"dataset {root} does not exist" if not Path(root).exists() else
                       f"{root}: no dataset format recognized; looked for {formats.LOOKED_FOR}")
    if not any(Path(root).rglob("*.parquet")):
        raise NotFound(f"{root}: no dataset format recognized; looked for {formats.LOOKED_FOR}")
    log.info("%s has no %s: indexing its Parquet files", root, mf.NAME)
    return PosixSource(root, name=name, manifest=index_parquet(root, vocab_size=vocab_size, eos_id=eos_id))


def open_one(cfg: ServeConfig, where: str, name: str = "") -> Source:
    """One dataset: a Kafka topic, or a directory (named after it unless `name` is given)."""
    if where.startswith("kafka://"):
        from feeder.sources.kafka import KafkaSource, KafkaURL   # only a Kafka source needs confluent_kafka

        src = KafkaSource(KafkaURL.parse(where, vocab_size=cfg.vocab_size, eos_id=cfg.eos_id), cache_dir=cfg.cache_dir)
        if name:
            src.name = name
        return src
    return open_source(where, vocab_size=cfg.vocab_size, eos_id=cfg.eos_id, name=name, column=cfg.column,
                       dtype=cfg.token_dtype, index=cfg.index)


def load_sources(cfg: ServeConfig) -> dict[str, Source]:
    """The feeder's datasets by name, the default first."""
    if not cfg.sources:
        src = open_one(cfg, cfg.source)
        return {src.name: src}
    return {name: open_one(cfg, where, name) for name, where in cfg.sources}


