"""Cursor: where one rank's stream stands, as an opaque, versioned, authenticated token.

Pure: no I/O. Layout (big-endian):
    b"FC" | version u8 | kind u8 | body | HMAC-SHA256(secret, everything before)[:16]
The MAC makes a tampered, truncated or foreign (other deployment's secret) cursor fail
verification; the fields then let the feeder say precisely which one does not match.

The kind says what the source position (`Cursor.src`) is, beyond what the sampler derives
from (epoch, base, pos, step): nothing for a dataset on disk, the frozen offset ranges of a
Kafka job's epoch, where a Kafka follow stream's interleave stands, a mixture's blending and draw
counters, or where each topic of a follow-mode mixture stands. Each is a typed value.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Callable

from feeder.core.errors import FailedPrecondition
from feeder.core import order

try:
    from feeder._native import cursors as _native_cursors   # the same bytes, ~4x faster
    from feeder._native import mac as _native_mac
except ImportError:  # no C compiler at install
    _native_cursors = _native_mac = None

MAGIC = b"FC"
# 2 added `src` (as text); 3 made it typed, by kind. Versions 1 and 2 are still accepted.
VERSION = 3
# Kinds of source position, by cursor byte: 1 none (a dataset's stream), 4 a mixture's and 6 a
# scheduled mixture's (here); 2, 3 and 5 are Kafka's (feeder/sources/kafka_positions.py).
# Registered by their owners.
KIND_SAMPLED, KIND_MIXTURE, KIND_SCHEDULED = 1, 4, 6
MAC_LEN = 16
# Used when a deployment sets no secret: fine on one machine, never across a real fleet.
DEV_SECRET = b"feeder-development-secret-not-for-production"

# seed flags permutation seq_len world rank epoch base pos step (the permutation byte, once 0
# in every cursor, is its kind's byte in feeder.core.order's registry: 0, "", in older cursors)
_FIXED = struct.Struct(">QBBIIIIQQQ")
_HEAD = struct.Struct(">QBBIII")        # the part of _FIXED a stream keeps: seed .. rank
_TAIL = struct.Struct(">IQQQ")          # and the part each batch moves: epoch base pos step


@dataclass(frozen=True)
class Mixture:
    """A mixture of sources: what decides which source fills each position and which of its
    samples (feeder.mixture has the rules). Per source, in the mixture's order: its name, its
    data's fingerprint (a bounded Kafka topic's: the offset ranges of the job's epoch of it, which
    rebuild that epoch on any feeder), its normalized weight, and its draws made before epoch `ref_epoch`
    (the draw counters, which run on across epochs and mixture changes). In `ref_epoch` the
    blending starts at `mix_base` of the epoch's global order (> 0 after a mid-epoch remix).
    The first `active` sources are the mixture (0: all); those after it were dropped by a remix
    and keep their counters, so a source mixed in again goes on where it stood (weight 0)."""
    names: tuple[str, ...]
    fingerprints: tuple[str, ...]
    weights: tuple[float, ...]
    offsets: tuple[int, ...]
    epoch_samples: int
    ref_epoch: int = 0
    mix_base: int = 0
    active: int = 0

    _ONE = struct.Struct(">dQ")
    _TAIL = struct.Struct(">QIQH")

    @property
    def k(self) -> int:
        """How many sources are mixed (the first k)."""
        return self.active or len(self.names)

    def __post_init__(self):
        k = len(self.names)
        if not 0 < k <= 32767 or not len(self.fingerprints) == len(self.weights) == len(self.offsets) == k \
                or not 0 <= self.active <= k:
            raise ValueError("a mixture position needs a name, fingerprint, weight and offset per source")

    def pack(self) -> bytes:
        out = [struct.pack(">H", len(self.names))]
        for name, fp, w, off in zip(self.names, self.fingerprints, self.weights, self.offsets):
            nb, fb = name.encode(), fp.encode()
            out += [struct.pack(">H", len(nb)), nb, struct.pack(">H", len(fb)), fb, self._ONE.pack(w, off)]
        out.append(self._TAIL.pack(self.epoch_samples, self.ref_epoch, self.mix_base, self.active))
        return b"".join(out)

    @classmethod
    def unpack(cls, b: bytes) -> "Mixture":
        (k,), at = struct.unpack_from(">H", b), 2
        names, fps, ws, offs = [], [], [], []
        for _ in range(k):
            (ln,) = struct.unpack_from(">H", b, at)
            names.append(b[at + 2:at + 2 + ln].decode())
            at += 2 + ln
            (lf,) = struct.unpack_from(">H", b, at)
            fps.append(b[at + 2:at + 2 + lf].decode())
            at += 2 + lf
            w, off = cls._ONE.unpack_from(b, at)
            ws.append(w)
            offs.append(off)
            at += cls._ONE.size
        n, ref, base, active = cls._TAIL.unpack_from(b, at)
        if at + cls._TAIL.size != len(b):
            raise struct.error(f"a mixture position of {k} sources has {len(b)} bytes")
        return cls(names=tuple(names), fingerprints=tuple(fps), weights=tuple(ws), offsets=tuple(offs),
                   epoch_samples=n, ref_epoch=ref, mix_base=base, active=active)


# A stream's source position (what the sampler cannot derive): None for a dataset's plain
# stream, else an object of a kind registered here by the source that owns it (a mixture's
# below; Kafka's in feeder/sources/kafka_positions.py). The kind's byte is in every cursor.
Position = object


@dataclass(frozen=True)
class PositionKind:
    byte: int                              # the cursor's kind byte: fixed forever once released
    type: type
    pack: Callable[[object], bytes]
    unpack: Callable[[bytes], object]
    # Cursors before version 3 held a position as text; a kind that existed then reads it back
    # (None: not this kind's text).
    legacy: Callable[[str], object | None] | None = None


_POSITIONS: dict[int, PositionKind] = {}
_POSITION_OF: dict[type, PositionKind] = {}


def register_position(kind: PositionKind) -> PositionKind:
    """Add a kind of source position (by its owner, at import): its byte and type must be new."""
    if kind.byte in _POSITIONS or kind.type in _POSITION_OF or kind.byte == KIND_SAMPLED:
        raise ValueError(f"position kind {kind.byte} ({kind.type.__name__}) is registered already")
    _POSITIONS[kind.byte] = _POSITION_OF[kind.type] = kind
    return kind


def _kind_byte(src: Position) -> int:
    if src is None:
        return KIND_SAMPLED
    return _POSITION_OF[type(src)].byte


def _position_bytes(src: Position) -> bytes:
    return b"" if src is None else _POSITION_OF[type(src)].pack(src)


def _position(version: int, kind: int, raw: bytes) -> Position:
    if version < 3:   # text, by what it looks like: "" (a dataset), else a kind's own text
        text = raw.decode()
        if not text:
            return None
        for k in _POSITIONS.values():
            got = k.legacy(text) if k.legacy is not None else None
            if got is not None:
                return got
        raise FailedPrecondition("cursor holds a source position this feeder cannot read; another feeder may",
                                 elsewhere=True)
    if kind == KIND_SAMPLED and not raw:
        return None
    known = _POSITIONS.get(kind)
    if known is None:
        raise FailedPrecondition(f"cursor kind {kind} cannot resume this stream")
    return known.unpack(raw)


register_position(PositionKind(KIND_MIXTURE, Mixture, Mixture.pack, Mixture.unpack))


@dataclass(frozen=True)
class Scheduled:
    """A scheduled mixture (feeder.core.schedule): its sources (name and data fingerprint, as a
    Mixture's), its epoch's positions, and the schedule in force when the cursor was written, whole
    (its canonical JSON: version, the digest of the schedule the job started with, every segment).
    Nothing else: a scheduled mixture's draws are a pure function of the schedule and progress,
    so any feeder resumes the cursor, and one that missed a live change learns it from it."""
    names: tuple[str, ...]
    fingerprints: tuple[str, ...]
    epoch_samples: int
    schedule: str

    def pack(self) -> bytes:
        out = [struct.pack(">H", len(self.names))]
        for name, fp in zip(self.names, self.fingerprints):
            nb, fb = name.encode(), fp.encode()
            out += [struct.pack(">H", len(nb)), nb, struct.pack(">H", len(fb)), fb]
        sb = self.schedule.encode()
        out += [struct.pack(">QI", self.epoch_samples, len(sb)), sb]
        return b"".join(out)

    @classmethod
    def unpack(cls, b: bytes) -> "Scheduled":
        (k,), at = struct.unpack_from(">H", b), 2
        names, fps = [], []
        for _ in range(k):
            for into in (names, fps):
                (ln,) = struct.unpack_from(">H", b, at)
                into.append(b[at + 2:at + 2 + ln].decode())
                at += 2 + ln
        n, ls = struct.unpack_from(">QI", b, at)
        at += 12
        if at + ls != len(b):
            raise struct.error(f"a scheduled mixture position of {k} sources has {len(b)} bytes")
        return cls(names=tuple(names), fingerprints=tuple(fps), epoch_samples=n, schedule=b[at:].decode())


register_position(PositionKind(KIND_SCHEDULED, Scheduled, Scheduled.pack, Scheduled.unpack))


@dataclass(frozen=True, kw_only=True)
class Cursor:
    job: str
    fingerprint: str
    seed: int
    shuffle: bool
    drop_last: bool
    seq_len: int
    world_size: int
    rank: int
    epoch: int
    base: int      # start of the current segment in the epoch's global order (elastic)
    pos: int       # samples of this rank's segment list already delivered
    step: int      # batches already delivered in this epoch
    src: Position = None   # the source position the sampler cannot derive (see the module doc)
    permutation: str = ""  # the kind of the epoch's order (feeder.core.order.kinds()), as feeder.order.agreed names it

    def head(self) -> bytes:
        """Everything before (epoch, base, pos, step): the same for every batch of a stream segment."""
        job = self.job.encode()
        fp = self.fingerprint.encode()
        src = _position_bytes(self.src)
        flags = (1 if self.shuffle else 0) | (2 if self.drop_last else 0)
        return b"".join([
            MAGIC, bytes([VERSION, _kind_byte(self.src)]),
            struct.pack(">H", len(job)), job, struct.pack(">H", len(fp)), fp, struct.pack(">I", len(src)), src,
            _HEAD.pack(self.seed, flags, order.kind_of(self.permutation).byte, self.seq_len, self.world_size, self.rank),
        ])

    def encode(self, secret: bytes) -> bytes:
        body = self.head() + _TAIL.pack(self.epoch, self.base, self.pos, self.step)
        return body + _mac(secret, body)

    @classmethod
    def decode(cls, data: bytes, secret: bytes) -> "Cursor":
        if len(data) < 4 + MAC_LEN or data[:2] != MAGIC:
            raise FailedPrecondition(
                f"cursor is not a feeder cursor ({len(data)} bytes, expected one returned with a batch)")
        if data[2] not in (1, 2, VERSION):
            raise FailedPrecondition(f"cursor version {data[2]} is not supported, expected 1 to {VERSION}")
        body, mac = data[:-MAC_LEN], data[-MAC_LEN:]
        if not hmac.compare_digest(mac, _mac(secret, body)):
            raise FailedPrecondition(
                "cursor failed verification: it was altered, truncated, or issued by a feeder "
                "with another cursor secret")
        if (body[3] != KIND_SAMPLED and body[3] not in _POSITIONS) or (data[2] < 3 and body[3] != 1):
            raise FailedPrecondition(f"cursor kind {body[3]} cannot resume this stream")
        try:
            at = 4
            (jl,) = struct.unpack_from(">H", body, at)
            job = body[at + 2:at + 2 + jl].decode()
            at += 2 + jl
            (fl,) = struct.unpack_from(">H", body, at)
            fp = body[at + 2:at + 2 + fl].decode()
            at += 2 + fl
            src = None
            if data[2] >= 2:
                (sl,) = struct.unpack_from(">I", body, at)
                if at + 4 + sl > len(body):
                    raise struct.error("the source position runs past the cursor's end")
                src = _position(data[2], body[3], body[at + 4:at + 4 + sl])
                at += 4 + sl
            seed, flags, kind, seq_len, world, rank, epoch, base, pos, step = _FIXED.unpack_from(body, at)
        except (struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise FailedPrecondition(f"cursor is malformed: {e}") from None
        named = order.by_byte(kind)
        if named is None:   # a newer feeder's permutation: another feeder may know it
            raise FailedPrecondition(f"cursor names permutation kind {kind}, which this feeder does not know (it knows "
                                     f"{', '.join(str(order.kind_of(k).byte) for k in order.kinds())}); another "
                                     "feeder may", elsewhere=True)
        return cls(job=job, fingerprint=fp, seed=seed, shuffle=bool(flags & 1),
                   drop_last=bool(flags & 2), seq_len=seq_len, world_size=world, rank=rank,
                   epoch=epoch, base=base, pos=pos, step=step, src=src, permutation=named.name)


def same_place(a: bytes, b: bytes) -> bool:
    """Whether two cursors (as a rank holds them: unverified bytes) name the same place in the
    same stream. Equal bytes do; so do two of a scheduled mixture that differ only in the schedule
    version in force when each was written (a live change splices the schedule past every batch
    planned, so a batch before it is the same under either: feeder.domain.schedules), provided
    both schedules started from the same one."""
    if a == b:
        return True
    ka, kb = _place_key(a), _place_key(b)
    return ka is not None and ka == kb


def _place_key(data: bytes) -> bytes | None:
    """A scheduled mixture's cursor without its schedule's segments and version (keeping the
    digest it started from) and without its MAC; None for any other cursor."""
    try:
        if len(data) < 4 + MAC_LEN or data[:2] != MAGIC or data[2] != VERSION or data[3] != KIND_SCHEDULED:
            return None
        at = 4
        for size in (2, 2):   # job, fingerprint
            (ln,) = struct.unpack_from(">H", data, at)
            at += size + ln
        (sl,) = struct.unpack_from(">I", data, at)
        src = Scheduled.unpack(data[at + 4:at + 4 + sl])
        import json

        base = json.loads(src.schedule).get("base", "")
        kept = Scheduled(names=src.names, fingerprints=src.fingerprints, epoch_samples=src.epoch_samples,
                         schedule=str(base)).pack()
        return data[:at] + kept + data[at + 4 + sl:-MAC_LEN]
    except (struct.error, UnicodeDecodeError, ValueError, TypeError, AttributeError):
        return None


def _mac(secret: bytes, body: bytes) -> bytes:
    if _native_mac is not None:   # the same bytes, holding the GIL (why: _native.c's mac)
        return _native_mac(_block_key(bytes(secret or DEV_SECRET)), body)[:MAC_LEN]
    return hmac.digest(secret or DEV_SECRET, body, "sha256")[:MAC_LEN]


@functools.lru_cache(maxsize=16)
def _block_key(key: bytes) -> bytes:
    """HMAC's key as its 64-byte block (RFC 2104): hashed if longer, then zero-padded."""
    return (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")


class CursorWriter:
    """The cursors of one stream's batches, ~1.5 us each instead of ~10 (a feeder writes one
    per batch, all under one GIL).

    Only (epoch, base, pos, step) move from batch to batch, so the head is packed once per
    segment, and HMAC-SHA256 is run from its two precomputed pads (RFC 2104): the inner hash of
    key^ipad + head is copied and fed the tail, the outer one the inner digest. Where the C
    extension is built, feeder/_native.c does the same for a whole run at once (~0.9 us a
    cursor, with the GIL held: see there why). The bytes equal
    Cursor.encode's either way (tests/test_cursor.py)."""

    def __init__(self, template: Cursor, secret: bytes):
        self.template = template
        self.secret = secret
        key = self._key = _block_key(bytes(secret or DEV_SECRET))
        self._ipad = bytes(b ^ 0x36 for b in key)
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
        self._heads: dict[int, tuple[bytes, "hashlib._Hash"]] = {}   # world size -> head, inner hash

    def encode(self, cursor: Cursor) -> bytes:
        """One cursor a plan wrote whole (its position is more than the moving fields)."""
        return cursor.encode(self.secret)

    def many(self, *, world: int, epoch: int, base: int, stops, first_step: int) -> list[bytes]:
        """Cursors after each batch of a run: positions `stops`, steps first_step + 1, + 2, ..."""
        got = self._heads.get(world)
        if got is None:
            head = dataclasses.replace(self.template, world_size=world).head()
            got = self._heads[world] = (head, hashlib.sha256(self._ipad + head))
        head, inner = got
        if _native_cursors is not None:
            return _native_cursors(self._key, head, epoch, base, stops, first_step)
        pack, outer, out = _TAIL.pack, self._outer, []
        for j, pos in enumerate(stops):
            tail = pack(epoch, base, pos, first_step + j + 1)
            i = inner.copy()
            i.update(tail)
            o = outer.copy()
            o.update(i.digest())
            out.append(head + tail + o.digest()[:MAC_LEN])
        return out
