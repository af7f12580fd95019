"""The bench's dataset: a real corpus, a BPE tokenizer trained on it, the corpus prepared
into shards, and the same tokens packed into one flat file for the local DataLoader."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import BenchConfig, say


def dataset(cfg: BenchConfig) -> dict:
    """A BPE tokenizer (vocab < 65536) trained offline on a real corpus, and the corpus
    prepared with it; reused by later runs."""
    from feeder.sources import manifest as mf
    from feeder.core.tool_config import PrepConfig
    from feeder.ops.corpus import build_corpus
    from feeder.ops.prep import prep

    root = Path(cfg.data)
    root.mkdir(parents=True, exist_ok=True)
    corpus, tok, shards = root / "corpus.jsonl", root / "tokenizer.json", root / "bpe"
    if not corpus.exists():
        say("building the corpus (Python standard library sources and docs)")
        build_corpus(corpus, cfg.corpus_bytes)
    if not tok.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        say(f"training a byte-level BPE tokenizer, vocab {cfg.vocab}, on {corpus}")
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

        def texts():
            with open(corpus, encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)["text"]

        t.train_from_iterator(texts(), trainer)
        t.save(str(tok))
    if not (shards / mf.NAME).exists():
        say("tokenizing the corpus into shards")
        prep(PrepConfig(inputs=(str(corpus),), out=str(shards), tokenizer=str(tok), progress=False), force=True)
    m = mf.read(shards)
    packed = root / "packed.u16"
    if not packed.exists() or packed.stat().st_size != m.n_tokens * 2:
        from feeder.sources.posix import PosixSource

        src = PosixSource(shards)
        out = np.memmap(packed, dtype=np.uint16, mode="w+", shape=(m.n_tokens,))
        src.read(0, out)
        out.flush()
    return {"shards": str(shards), "packed": str(packed), "n_tokens": m.n_tokens, "vocab_size": m.vocab_size,
            "tokenizer": str(tok), "corpus_bytes": corpus.stat().st_size}

