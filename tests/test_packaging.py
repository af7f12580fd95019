"""The package's shape: the layers import only downwards (feeder < client < trainer, and the
bench above feeder and client), the wheel a feeder host installs does not require torch and
names its packages as intended, `feeder` finds `bench` through its entry-point group without
importing it, and a serving feeder process never loads torch.

The full proof from a fresh venv (pip install ., serve, stream, then the client extra) needs
the package index and so lives in .ci/fresh-install.sh, outside `make test`."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from tests.helpers import FeederProc

ROOT = Path(__file__).resolve().parent.parent
# What each top-level package may import of this repository's packages.
ALLOWED = {"feeder": {"feeder"}, "client": {"feeder", "client"}, "trainer": {"feeder", "client", "trainer"},
           "bench": {"feeder", "client"}}
OURS = {"feeder", "client", "trainer", "bench", "feeder_bench", "feeder_client", "tests"}


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names of the absolute imports in one file (relative imports stay inside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_layers_import_only_downwards():
    """feeder never imports its client, trainer or bench (the bench used to live in feeder/ and
    import the client, so the two imported each other); the bench's own imports are relative,
    so it works installed as feeder_bench as well as from this tree as bench."""
    bad = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            wrong = (imported_top_levels(path) & OURS) - allowed
            if wrong:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, bad


def test_feeder_finds_bench_through_the_entry_point_group(monkeypatch, capsys):
    """Plugin commands come from `feeder.commands`; one that cannot be imported is left out,
    and a built-in command does not read the entry points at all."""
    import importlib.metadata

    from feeder import cli

    eps = [EntryPoint("broken", "no_such_module_here:register", "feeder.commands"),
           EntryPoint("bench", "bench.cli:register", "feeder.commands")]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [e for e in eps if e.group == group])
    args = cli.build_parser(["bench"]).parse_args(["bench", "--quick", "--rounds", "2"])
    from bench.cli import cmd_bench

    assert args.fn is cmd_bench and args.rounds == 2 and args.quick
    assert cli.main(["bench", "--rounds", "0"]) == cli.EXIT_USER
    err = capsys.readouterr().err
    assert err == "feeder bench: error: rounds must be a positive integer, got 0\n"
    # a stale install: the command is known, and says in one line why it cannot run
    assert cli.main(["broken", "--any", "flags"]) == cli.EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("feeder broken: error: `feeder broken` is registered (no_such_module_here:register) but "
                          "cannot be loaded: No module named 'no_such_module_here'") and err.count("\n") == 1, err

    def no_reading(group):
        raise AssertionError("a built-in command read the entry points")

    monkeypatch.setattr(importlib.metadata, "entry_points", no_reading)
    assert cli.build_parser(["serve"]).parse_args(["serve", "--source", "x"]).fn is cli.cmd_serve


def test_a_serving_feeder_process_never_loads_torch(dataset):
    """`feeder serve` streaming to a client: the feeder's process has no torch library mapped
    (torch is the client extra's; a feeder host installs without it)."""
    from client import ClientConfig, FeederClient
    from feeder.config import StreamSpec

    f = FeederProc(dataset)
    try:
        spec = StreamSpec(job="no-torch", rank=0, world_size=2, seq_len=16, micro_batch=2, num_epochs=1)
        assert sum(b.tokens.numel() for b in FeederClient(ClientConfig(targets=(f.address,), spec=spec))) > 0
        maps = Path(f"/proc/{f.proc.pid}/maps").read_text()
        assert "torch" not in maps, [line for line in maps.splitlines() if "torch" in line][:3]
    finally:
        f.stop()


def test_the_wheel_requires_torch_only_for_the_client_extra(tmp_path):
    """Built offline from a copy of the tree: torch only under the client extra (train and
    bench take it through client), the bench installed as feeder_bench (no top-level `bench`),
    `feeder bench` registered in the feeder.commands group, tokenizer.py in place of the
    tokenize.py that shadowed the standard library's."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "data", "results.json", "*.png", "*_pb2*", ".generated")
    for name in ("protos", "feeder", "client", "trainer", "bench"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "wheels"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("token_feeder-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        eps = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert {"feeder", "client", "trainer", "feeder_bench"} <= tops and "bench" not in tops, tops
    assert "feeder/tokenizer.py" in names and "feeder/tokenize.py" not in names
    assert "feeder/bench.py" not in names and "feeder_bench/h2count.py" in names
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    torch = [r for r in requires if r.startswith("torch")]
    assert torch and all('extra == "client"' in r for r in torch), torch
    assert not [r for r in requires if r.startswith("deepspeed") and 'extra == "train"' not in r]
    assert any(r.startswith("token-feeder[client]") and 'extra == "train"' in r for r in requires), requires
    assert "[feeder.commands]\nbench = feeder_bench.cli:register" in eps, eps


def test_a_shuffle_that_needs_torch_says_so_where_torch_is_not_installed(monkeypatch):
    """torch's randperm is still the fallback (past 2^32/20 samples, or without the C shuffle);
    on a feeder host installed without the client extra that is a precise refusal
    (FAILED_PRECONDITION through the servicer), not an ImportError from deep in a stream."""
    from feeder import sampler
    from feeder.errors import FailedPrecondition

    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` raises ImportError
    with pytest.raises(FailedPrecondition, match=r"shuffling 214,748,364 samples needs torch's randperm "
                                                 r"\(this many samples\): pip install 'token-feeder\[client\]'"):
        sampler.randperm(2**32 // 20, 1)
    monkeypatch.setitem(sys.modules, "feeder._shuffle", None)
    with pytest.raises(FailedPrecondition, match="a feeder built without a C compiler"):
        sampler.randperm(10, 1)
