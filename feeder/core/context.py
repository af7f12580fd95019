"""Context parallelism: which positions of each sample a context-parallel member gets.

Pure numpy. A sample is seq_len + 1 tokens (the inputs and their labels shifted by one); a
context-parallel group of C members splits its seq_len input positions:

* `contiguous` (DeepSpeed Ulysses): member c gets the c-th of C equal chunks;
* `zigzag` (Megatron-LM's load-balanced split for causal ring attention): the sequence in 2C
  equal chunks, member c gets chunks c and 2C-1-c, so every member does the same share of
  causal attention's work.

A member needs the inputs at its positions and the labels there (the next token of each), so
each of its chunks is a window of chunk + 1 consecutive tokens of the sample: one window
(contiguous) or two (zigzag). The feeder sends exactly those windows, 1/C of the sample's bytes
plus a token per window.
"""
from __future__ import annotations

import numpy as np

LAYOUTS = ("zigzag", "contiguous")


def chunks(cp_size: int, layout: str) -> int:
    """How many equal chunks the inputs are cut into."""
    return 2 * cp_size if layout == "zigzag" else cp_size


def divisibility(seq_len: int, cp_size: int, layout: str) -> str:
    """Why seq_len cannot be split this way ("" when it can)."""
    k = chunks(cp_size, layout)
    if cp_size > 1 and seq_len % k:
        how = (f"2 x cp_size = {k} equal chunks (Megatron's load-balanced zigzag split)" if layout == "zigzag"
               else f"cp_size = {k} equal chunks")
        return (f"seq_len {seq_len} cannot be split for context parallelism: cp_layout={layout!r} cuts each "
                f"sample's inputs into {how}; use a seq_len that is a multiple of {k}")
    return ""


def windows(seq_len: int, cp_size: int, cp_rank: int, layout: str) -> list[tuple[int, int]]:
    """(offset, length) in the sample of each window member `cp_rank` receives, in order."""
    if cp_size == 1:
        return [(0, seq_len + 1)]
    k = chunks(cp_size, layout)
    size = seq_len // k
    picks = (cp_rank, k - 1 - cp_rank) if layout == "zigzag" else (cp_rank,)
    return [(c * size, size + 1) for c in picks]


def positions(seq_len: int, cp_size: int, cp_rank: int, layout: str) -> np.ndarray:
    """int64 [seq_len / cp_size]: the input positions (0..seq_len-1) the member holds, in order."""
    return np.concatenate([np.arange(o, o + n - 1, dtype=np.int64)
                           for o, n in windows(seq_len, cp_size, cp_rank, layout)])


def take(tokens: np.ndarray, ws: list[tuple[int, int]]) -> np.ndarray:
    """The windows `ws` of each sample: [n, seq_len + 1] -> [n, sum of the windows' lengths],
    C-contiguous (a row's windows one after the other)."""
    if len(ws) == 1:
        o, n = ws[0]
        return np.ascontiguousarray(tokens[:, o:o + n])
    return np.concatenate([tokens[:, o:o + n] for o, n in ws], axis=1)


def cut(tokens: np.ndarray, seq_len: int, cp_size: int, cp_rank: int, layout: str) -> np.ndarray:
    """A member's windows of each sample (see `windows`)."""
    return take(tokens, windows(seq_len, cp_size, cp_rank, layout))


def split(rows: np.ndarray, n_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """A member's received rows [n, k * (w + 1)] -> (inputs, labels), each [n, k * w]: each
    window's first w tokens are inputs, its last w their labels."""
    n = rows.shape[0]
    win = rows.reshape(n, n_windows, -1)
    return win[:, :, :-1].reshape(n, -1), win[:, :, 1:].reshape(n, -1)
