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

from feeder.sources import manifest as mf

try:
    from feeder._native import ids as _ids   # a record's range check (and EOS) in one pass, holding the GIL
except ImportError:   # built without the C extension: numpy's, the same results
    _ids = None

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


def decode_record(value: bytes | None, *, dtype: np.dtype, vocab_size: int, max_bytes: int,
                  eos_id: int | None = None) -> np.ndarray:
    """Token ids of one record (with `eos_id` after them, if given), or BadRecord saying what is
    wrong with it.

    Total on any bytes: a record is written by whoever can produce to the topic, so whatever
    a parser raises on hostile input (json's RecursionError on deep nesting, ValueError on a
    5,000-digit integer, struct.error, ...) is the record's fault and becomes BadRecord
    ("undecodable"), never an exception that ends the stream as INTERNAL/UNKNOWN (which
    clients retry for minutes). The kinds we can name are named first."""
    try:
        return _decode(value, dtype=dtype, vocab_size=vocab_size, max_bytes=max_bytes, eos_id=eos_id)
    except BadRecord:
        raise
    except (ValueError, ArithmeticError, TypeError, LookupError, RecursionError, struct.error) as e:
        raise BadRecord("undecodable", f"{type(e).__name__}: {str(e)[:200]}") from None


def _decode(value: bytes | None, *, dtype: np.dtype, vocab_size: int, max_bytes: int,
            eos_id: int | None) -> np.ndarray:
    if not value:  # a tombstone or a producer bug; an empty *document* still has a header or {"tokens": []}
        raise BadRecord("empty", "the record has no value (null or 0 bytes)")
    if len(value) > max_bytes:
        raise BadRecord("too_large", f"{len(value)} bytes, the limit is max_record_bytes={max_bytes}")
    if value[:4] == MAGIC:
        payload = _binary_payload(value, dtype=dtype, vocab_size=vocab_size)
        if _ids is not None:
            # One pass, holding the GIL (why: _native.c's ids)
            lo, hi, with_eos = _ids(payload, dtype.itemsize, -1 if eos_id is None else eos_id)
            if len(payload) and hi >= vocab_size:
                raise BadRecord("out_of_vocab", f"token ids must be in [0, {vocab_size}), found {hi}")
            if with_eos is not None:
                return np.frombuffer(with_eos, dtype=dtype)
            return np.frombuffer(payload, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
        ids = np.frombuffer(payload, dtype=dtype.newbyteorder("<"))
    elif value[:1] in (b"{", b" "):
        ids = _decode_json(value, vocab_size=vocab_size)
    else:
        raise BadRecord("undecodable", f"neither a feeder record ({MAGIC!r} header) nor JSON "
                                       f"(starts with {bytes(value[:8])!r})")
    if ids.size:   # an empty document (header or {"tokens": []}) is EOS only, as `prep` does
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise BadRecord("out_of_vocab", f"token ids must be in [0, {vocab_size}), found {lo if lo < 0 else hi}")
    if eos_id is None:
        return ids if ids.size else ids.astype(dtype)
    tokens = np.empty(len(ids) + 1, dtype=dtype)
    tokens[:-1] = ids
    tokens[-1] = eos_id
    return tokens


def _binary_payload(value: bytes, *, dtype: np.dtype, vocab_size: int) -> memoryview:
    """The ids' bytes of a feeder record, once its header says they are `dtype`'s."""
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
    return payload


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
