"""The tests import this checkout's client, trainer and bench under their installed names.

client/, trainer/ and bench/ are installed as `feeder_client`, `feeder_trainer` and
`feeder_bench` (setup.py), and the tests import them by those names only (one name per
process: the same module under two names would be two copies). The current directory puts
this checkout's `feeder` and `tests` first on sys.path, but no folder here is named
`feeder_client`: an editable install (`make env`) resolves that name through setuptools'
finder, which points at the tree that was installed, so a second checkout of the repository
(a git worktree, a CI clone beside a developer's venv) would test the installed tree's client
with its own feeder. The finder below, first on sys.meta_path, maps the three names to this
checkout's folders whenever this package is imported (pytest imports it before any conftest
or test module; `python -m tests.chaos` before the harness). It finds the package itself
only; submodules then come from the package's __path__, i.e. from the same folder.

Processes the tests start themselves (`python -m feeder.cli`, `deepspeed trainer/train.py`,
multiprocessing's spawn and forkserver children) do not import this package, so they resolve
the names through the installed finder. In CI, a fresh clone installed editable, that is the
same tree; a worktree beside another tree's venv must put its own folders first for them
(for example PYTHONPATH to a directory of links feeder_client -> client and so on)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_FOLDERS = {"feeder_client": "client", "feeder_trainer": "trainer", "feeder_bench": "bench"}


class _CheckoutFinder:
    """A meta path finder for the three installed names, from this checkout's folders."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        folder = _FOLDERS.get(fullname)
        if folder is None or not (_ROOT / folder / "__init__.py").exists():
            return None
        return importlib.util.spec_from_file_location(fullname, _ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(_ROOT / folder)])


def _install() -> None:
    loaded = {n: Path(sys.modules[n].__file__).resolve().parent for n in _FOLDERS if n in sys.modules}
    wrong = {n: str(p) for n, p in loaded.items() if p != _ROOT / _FOLDERS[n]}
    if wrong:   # imported before this package from elsewhere: say so rather than test a mix
        raise ImportError(f"{wrong} were imported from another tree before tests/ could map them to {_ROOT}")
    if not any(isinstance(f, type) and f.__name__ == "_CheckoutFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutFinder)


_install()
