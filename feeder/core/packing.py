"""Packing kinds: how a source's documents become a stream's samples. The one place a kind is named.

Pure: a table of kinds, no I/O. A kind is a layer over any source whose documents it can read
(feeder.sources.Documents): its `wrap(source, seq_len, ctx)` returns the table a plan reads the
stream's samples from (feeder.sources.PackedSamples: `n_samples`, `fingerprint`, `dtype`,
`locate`, `boundaries`). Sample i of a packed stream is addressed as concat's window i (row
start i·seq_len), so the sampler's dealing, cursors, resume, reshard, workers, members and
context parallelism are one code path for every kind.

* `concat`: the source's own windows of seq_len + 1 tokens (no wrap: the source is the table).
* `best_fit`: bins of whole documents (feeder.sources.packed), registered by that module.
* anything else a deployment registers (docs/extending.md: a 20-line packing in a test).

A kind's `prefix` begins the fingerprint of every stream it packs, so a cursor of another
packing is told from one of another replica's data (feeder.core.sampling_key). Which kinds a
feeder serves is the feeder's business: a client names one, and the feeder refuses a name it
does not know when it plans the stream (`get`), listing those it serves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from feeder.core.errors import InvalidArgument

CONCAT = "concat"


@dataclass(frozen=True)
class PackingKind:
    name: str
    prefix: str                      # how its streams' fingerprints begin ("" for concat: the data's own)
    wrap: Callable | None = None     # (source, seq_len, ctx) -> its samples' table; None: the source's windows


_KINDS: dict[str, PackingKind] = {}


def register(kind: PackingKind) -> PackingKind:
    """Make `kind` servable (once per process; registering the same kind again is a no-op)."""
    if _KINDS.get(kind.name) == kind:
        return kind
    if kind.name in _KINDS:
        raise ValueError(f"packing {kind.name!r} is registered already")
    if not kind.name or not kind.name.isprintable() or (kind.wrap is None) != (kind.prefix == ""):
        raise ValueError(f"packing {kind.name!r}: a printable name, and a wrap with a fingerprint prefix "
                         "(only concat, the source's own windows, has neither)")
    for other in _KINDS.values():
        if other.prefix and (other.prefix.startswith(kind.prefix) or kind.prefix.startswith(other.prefix)):
            raise ValueError(f"packing {kind.name!r}: its fingerprint prefix {kind.prefix!r} is not told apart "
                             f"from {other.name!r}'s {other.prefix!r}")
    _KINDS[kind.name] = kind
    return kind


def get(name: str) -> PackingKind:
    """The kind a stream names; InvalidArgument (listing those served) for one this feeder lacks."""
    kind = _KINDS.get(name)
    if kind is None:
        raise InvalidArgument(f"packing {name!r} is not one this feeder serves; it serves: "
                              f"{', '.join(sorted(_KINDS))}")
    return kind


def names() -> tuple[str, ...]:
    return tuple(_KINDS)


def of_fingerprint(fingerprint: str) -> str:
    """The packing a stream's fingerprint says its samples have (concat: none of the prefixes)."""
    for kind in _KINDS.values():
        if kind.prefix and fingerprint.startswith(kind.prefix):
            return kind.name
    return CONCAT


register(PackingKind(CONCAT, ""))
