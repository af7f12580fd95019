"""Rows: where a run's samples lie, without copying them (what `Plan.locate` returns).

Pure numpy (and the optional C gather). Below the sources and the pipeline: a source says
where rows lie, and the reply writer (feeder.service.wire) copies them straight into the
reply, one copy instead of two.
"""
from __future__ import annotations

import numpy as np

try:
    from feeder._native import gather as _gather   # memcpy per sample, without the GIL
except ImportError:  # no C compiler at install: numpy's fancy index
    _gather = None


class Rows:
    """Rows of n tokens cut from a few buffers: row i is bufs[which[i]][offs[i]:offs[i] + n]
    (what Plan.locate returns; the reply writer copies them straight into the reply)."""

    __slots__ = ("bufs", "which", "offs", "n")

    def __init__(self, bufs: list[np.ndarray], which: np.ndarray, offs: np.ndarray, n: int):
        self.bufs, self.which, self.offs, self.n = bufs, which, offs, n

    @classmethod
    def of(cls, tokens: np.ndarray) -> "Rows":
        """The rows of a [k, n] array (tokens a plan read itself)."""
        k, n = tokens.shape
        return cls([np.ascontiguousarray(tokens).reshape(-1)], np.zeros(k, dtype=np.int64),
                   np.arange(k, dtype=np.int64) * n, n)

    def __len__(self) -> int:
        return len(self.which)

    def gather(self, dtype: np.dtype) -> np.ndarray:
        out = np.empty((len(self.which), self.n), dtype=dtype)
        if _gather is not None:
            _gather(self.bufs, self.which, self.offs, self.n, out)
        else:
            for b, buf in enumerate(self.bufs):
                sel = np.flatnonzero(self.which == b)
                if not len(sel):   # (a chunk shorter than a row holds none: its rows were read aside)
                    continue
                out[sel] = np.lib.stride_tricks.sliding_window_view(buf, self.n)[self.offs[sel]]
        return out
