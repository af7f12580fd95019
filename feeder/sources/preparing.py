"""What this process is preparing for streams that cannot start yet (a Kafka epoch's snapshot
being built here or by another feeder sharing the cache directory), and how far it is: sources
note it, the servicer tells waiting ranks, metrics and logs show it. Plain data, any thread."""
from __future__ import annotations

import threading

from feeder.core import scope

_lock = threading.Lock()
_notes: dict[str, dict] = {}


def note(key: str, what: str, done: float | None = None) -> None:
    """`what` is being prepared (`done`: the share finished, 0..1, when known)."""
    with _lock:
        _notes[key] = {"what": what, "done": done}


def finished(key: str) -> None:
    with _lock:
        _notes.pop(key, None)


def current() -> dict[str, dict]:
    """{key: {"what": text, "done": share or None}} of everything being prepared now."""
    with _lock:
        return {k: dict(v) for k, v in _notes.items()}


def summary() -> str:
    """One line for a waiting rank (what is prepared is not said to a token scoped to some jobs
    or datasets: a note names a topic and its offsets, perhaps another team's)."""
    notes = current()
    if not notes or not scope.current().everything:
        return "the feeder is preparing the stream"
    return "; ".join(v["what"] for v in notes.values())
