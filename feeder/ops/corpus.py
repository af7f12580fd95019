"""A real text corpus available offline: this Python's standard library sources and docs
(for the demo, the benchmark's tokenizer and wire-size figures; nothing is downloaded)."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Callable

CORPUS_BYTES = 12 << 20


def _stdlib_files(suffixes: tuple[str, ...]) -> list[Path]:
    """This Python's standard library files of these suffixes, sorted, tests and site-packages left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.rglob("*") if p.suffix in suffixes and p.is_file()
                  and "site-packages" not in p.parts and "test" not in p.parts)


def _write(path: Path, files: list[Path], text_of: Callable[[Path], str | None], limit: int) -> int:
    """One JSON line {"text": ...} per file whose text_of is not None, until `limit` characters."""
    total = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            try:
                text = text_of(p)
            except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
                continue
            if text is None:
                continue
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text)
            if total >= limit:
                break
    return total


def build_corpus(path: Path, limit: int = CORPUS_BYTES, suffixes: tuple[str, ...] = (".py", ".txt", ".rst")) -> int:
    """Standard-library files of these suffixes (.py sources, .txt/.rst docs), one document per
    file, sorted for determinism."""
    return _write(path, _stdlib_files(suffixes), lambda p: p.read_text(encoding="utf-8"), limit)


def build_docs_corpus(path: Path, limit: int = CORPUS_BYTES) -> int:
    """The standard library's documentation text: its .txt/.rst files, then the docstrings of
    its modules (one document per module: its docstring and those of its classes and
    functions), sorted for determinism. English prose, unlike the sources' code."""
    import ast

    def text_of(p: Path) -> str | None:
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".py":
            tree = ast.parse(text)
            nodes = [tree, *(n for n in ast.walk(tree)
                             if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
            text = "\n\n".join(d for d in map(ast.get_docstring, nodes) if d)
        return text or None

    files = sorted(_stdlib_files((".txt", ".rst", ".py")), key=lambda p: (p.suffix == ".py", str(p)))
    return _write(path, files, text_of, limit)
