"""The record codec: one document's token ids as the value of one Kafka record.

`feeder publish` writes with `encode_record`; the source reads with `decode_record`. A record is
a header (magic, id width, tokenizer name, vocab_size, eos_id) then the ids little-endian, or
JSON {"tokens": [...]} as existing producers write it. A document's tokens never include EOS:
the source adds one after each record, as `feeder prep` does. No Kafka client here: this module
is pure so that both sides share it and it can be tested without a broker.
"""
from __future__ import annotations

import json
import struct

import numpy as np

from feeder import manifest as mf

MAGIC = b"FTK1"
HEADER = struct.Struct("<4sBBII")   # magic, dtype itemsize, tokenizer-name length, vocab_size, eos_id
BAD_KINDS = ("undecodable", "wrong_dtype", "out_of_vocab", "empty", "too_large")


def encode_record(ids: np.ndarray, *, vocab_size: int, eos_id: int, tokenizer: str) -> bytes:
    """The record value of one document: the header, then `ids` in the narrowest id width
    that holds `vocab_size` (as `feeder prep` stores them), little-endian.

    The tokenizer name is cut to 255 bytes (its length is one byte of the header)."""
    dtype = np.dtype(mf.dtype_for_vocab(vocab_size)).newbyteorder("<")
    name = tokenizer.encode()[:255]
    head = HEADER.pack(MAGIC, dtype.itemsize, len(name), vocab_size, eos_id)
    return head + name + np.asarray(ids).astype(dtype, copy=False).tobytes()


def read_header(value: bytes | None) -> tuple[int, int] | None:
    """(vocab_size, eos_id) from a feeder record's header; None for JSON or a short record."""
    if value and value[:4] == MAGIC and len(value) >= HEADER.size:
        _, _, _, vocab, eos = HEADER.unpack_from(value)
        return vocab, eos
    return None


class BadRecord(Exception):
    """A record that is not a servable document; `kind` is one of BAD_KINDS."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def decode_record(value: bytes | None, *, dtype: np.dtype, vocab_size: int, max_bytes: int) -> np.ndarray:
    """Token ids of one record, or BadRecord saying what is wrong with it.

    Total on any bytes: a record is written by whoever can produce to the topic, so whatever
    a parser raises on hostile input (json's RecursionError on deep nesting, ValueError on a
    5,000-digit integer, struct.error, ...) is the record's fault and becomes BadRecord
    ("undecodable"), never an exception that ends the stream as INTERNAL/UNKNOWN (which
    clients retry for minutes). The kinds we can name are named first."""
    try:
        return _decode(value, dtype=dtype, vocab_size=vocab_size, max_bytes=max_bytes)
    except BadRecord:
        raise
    except (ValueError, ArithmeticError, TypeError, LookupError, RecursionError, struct.error) as e:
        raise BadRecord("undecodable", f"{type(e).__name__}: {str(e)[:200]}") from None


def _decode(value: bytes | None, *, dtype: np.dtype, vocab_size: int, max_bytes: int) -> np.ndarray:
    if not value:  # a tombstone or a producer bug; an empty *document* still has a header or {"tokens": []}
        raise BadRecord("empty", "the record has no value (null or 0 bytes)")
    if len(value) > max_bytes:
        raise BadRecord("too_large", f"{len(value)} bytes, the limit is max_record_bytes={max_bytes}")
    if value[:4] == MAGIC:
        ids = _decode_binary(value, dtype=dtype, vocab_size=vocab_size)
    elif value[:1] in (b"{", b" "):
        ids = _decode_json(value, vocab_size=vocab_size)
    else:
        raise BadRecord("undecodable", f"neither a feeder record ({MAGIC!r} header) nor JSON "
                                       f"(starts with {bytes(value[:8])!r})")
    if ids.size == 0:
        return ids.astype(dtype)  # an empty document (header or {"tokens": []}): EOS only, as `prep` does
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise BadRecord("out_of_vocab", f"token ids must be in [0, {vocab_size}), found {lo if lo < 0 else hi}")
    return ids


def _decode_binary(value: bytes, *, dtype: np.dtype, vocab_size: int) -> np.ndarray:
    if len(value) < HEADER.size:
        raise BadRecord("undecodable", f"{len(value)} bytes is shorter than the {HEADER.size}-byte header")
    _, itemsize, name_len, _vocab, _eos = HEADER.unpack_from(value)
    if HEADER.size + name_len > len(value):
        # Slicing past the end gives an empty payload, i.e. an empty document: the bytes
        # would be served as something they do not say.
        raise BadRecord("undecodable", f"the header's tokenizer name of {name_len} bytes runs past the end of "
                                       f"the {len(value)}-byte record")
    if itemsize != dtype.itemsize:
        raise BadRecord("wrong_dtype", f"the record holds {itemsize}-byte ids, this topic's vocab "
                                       f"({vocab_size}) uses {dtype.itemsize}-byte ids ({dtype.name})")
    payload = memoryview(value)[HEADER.size + name_len:]
    if len(payload) % itemsize:
        raise BadRecord("undecodable", f"payload of {len(payload)} bytes is not a whole number of "
                                       f"{itemsize}-byte ids")
    return np.frombuffer(payload, dtype=dtype.newbyteorder("<"))


def _decode_json(value: bytes, *, vocab_size: int) -> np.ndarray:
    try:
        obj = json.loads(value)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRecord("undecodable", f"not valid JSON ({e})") from None
    toks = obj.get("tokens") if isinstance(obj, dict) else None
    if not isinstance(toks, list):
        raise BadRecord("undecodable", "a JSON record must be an object with a 'tokens' list")
    if not all(type(t) is int for t in toks):   # bool is an int subclass, and not a token id
        bad = next(t for t in toks if type(t) is not int)
        raise BadRecord("wrong_dtype", f"'tokens' must hold integers, found {str(bad)[:40]!r}")
    if toks:
        # Checked on Python ints, before numpy: an id beyond int64 would raise OverflowError there.
        lo, hi = min(toks), max(toks)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise BadRecord("out_of_vocab", f"token ids must be in [0, {vocab_size}), found {str(bad)[:40]}")
    return np.asarray(toks, dtype=np.int64)
