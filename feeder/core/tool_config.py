"""The configurations of `feeder prep` and `feeder publish`: frozen, keyword-only, checked in
__post_init__ as every configuration is (feeder.core.config, whose checks these use)."""
from __future__ import annotations

from dataclasses import dataclass

from feeder.core.config import _non_negative, _positive, shown
from feeder.core.errors import InvalidArgument


@dataclass(frozen=True, kw_only=True)
class PrepConfig:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str = "byte"          # "byte" or a path to a Hugging Face tokenizer.json
    eos_token: str = ""              # HF tokenizers: which token ends a document
    shard_tokens: int = 64 << 20     # a shard file is closed once it holds this many tokens
    chunk_tokens: int = 1 << 20      # a record batch (the unit checksummed when read)
    workers: int = 0                 # 0: one per core
    batch_docs: int = 256            # documents per unit of parallel work
    progress: bool = True

    def __post_init__(self):
        if not self.inputs:
            raise InvalidArgument("feeder prep needs at least one input file, got none")
        if not self.out:
            raise InvalidArgument("--out must name a directory, got ''")
        _positive("shard_tokens", self.shard_tokens)
        _positive("chunk_tokens", self.chunk_tokens)
        _non_negative("workers", self.workers)
        _positive("batch_docs", self.batch_docs)


@dataclass(frozen=True, kw_only=True)
class PublishConfig:
    inputs: tuple[str, ...]
    to: str                          # kafka://HOST:PORT/TOPIC
    partitions: int = 0              # 0: the topic's count, or 3 for a new topic
    tokenizer: str = "byte"
    eos_token: str = ""
    key: str = ""                    # "" : document i -> partition i mod P; "index": key = i, broker hashes
    workers: int = 0
    batch_docs: int = 256
    progress: bool = True

    def __post_init__(self):
        if not self.inputs:
            raise InvalidArgument("feeder publish needs at least one input file, got none")
        if not self.to.startswith("kafka://"):
            raise InvalidArgument(f"--to must be kafka://HOST:PORT/TOPIC, got {shown(self.to)}")
        _non_negative("partitions", self.partitions)
        if self.key not in ("", "index"):
            raise InvalidArgument(f"--key must be 'index' (or left out for round-robin), got {shown(self.key)}")
        _non_negative("workers", self.workers)
        _positive("batch_docs", self.batch_docs)
