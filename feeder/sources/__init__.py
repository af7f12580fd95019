"""Token sources. Each presents one packed token stream: `n_tokens`, `dtype`, `fingerprint`,
`vocab_size`, `eos_id` and `read(start, out)` filling `out` with tokens [start, start+len(out))."""
from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenSource(Protocol):
    name: str
    fingerprint: str
    n_tokens: int
    n_documents: int
    vocab_size: int
    eos_id: int
    dtype: np.dtype

    def read(self, start: int, out: np.ndarray) -> None: ...
