"""A real text corpus available offline: this Python's standard library sources and docs
(for the demo, the benchmark's tokenizer and wire-size figures; nothing is downloaded)."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

CORPUS_BYTES = 12 << 20


def build_corpus(path: Path, limit: int = CORPUS_BYTES, suffixes: tuple[str, ...] = (".py", ".txt", ".rst")) -> int:
    """Standard-library files of these suffixes (.py sources, .txt/.rst docs), one document per
    file, sorted for determinism."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*") if p.suffix in suffixes and p.is_file()
                   and "site-packages" not in p.parts and "test" not in p.parts)
    total = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= limit:
                break
    return total
