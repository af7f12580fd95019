"""Tokenizers for `feeder prep` / `publish`: the built-in byte tokenizer and Hugging Face
tokenizer.json files given by path (never downloaded)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from feeder.core.errors import InputError

BYTE_EOS = 256
BYTE_VOCAB = 257
# Tried in order when a tokenizer.json is given without --eos-token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|eos|>")


class ByteTokenizer:
    """Token id = each byte of the UTF-8 text (0-255); EOS = 256; vocab 257."""

    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS

    def identity(self) -> dict:
        return {"kind": "byte", "eos_id": BYTE_EOS, "vocab_size": BYTE_VOCAB}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    def __init__(self, path: str, eos_token: str = ""):
        from tokenizers import Tokenizer

        p = Path(path)
        if not p.is_file():
            raise InputError(f"tokenizer {path!r} is neither 'byte' nor an existing tokenizer.json file")
        try:
            self._tok = Tokenizer.from_file(str(p))
        except Exception as e:  # the tokenizers package raises plain Exception
            raise InputError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({e})") from None
        self.path = str(p.resolve())
        self.sha256 = hashlib.sha256(p.read_bytes()).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        for name in candidates:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                self.eos_token, self.eos_id = name, tid
                break
        else:
            raise InputError(f"tokenizer {path}: no end-of-document token found among {list(candidates)}; "
                             "name one with --eos-token")

    def identity(self) -> dict:
        return {"kind": "huggingface", "sha256": self.sha256, "eos_token": self.eos_token,
                "eos_id": self.eos_id, "vocab_size": self.vocab_size}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32)
                for e in self._tok.encode_batch(texts, add_special_tokens=False)]


def load(spec: str, eos_token: str = ""):
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".json") or Path(spec).exists():
        return HFTokenizer(spec, eos_token)
    raise InputError(f"unknown tokenizer {spec!r}: expected 'byte' or a path to a tokenizer.json file")
