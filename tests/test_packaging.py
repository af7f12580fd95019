"""The package's shape: the layers import only downwards (feeder < client < trainer, and the
bench above feeder and client), the wheel a feeder host installs does not require torch and
names its packages as intended (client/, trainer/ and bench/ as feeder_client, feeder_trainer
and feeder_bench, and nothing imports them by their folders' names), `feeder` finds `bench` through its entry-point group without
importing it, and a serving feeder process never loads torch.

The full proof from a fresh venv (pip install ., serve, stream, then the client extra) needs
the package index and so lives in .ci/fresh-install.sh, outside `make test`."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from tests.helpers import FeederProc

ROOT = Path(__file__).resolve().parent.parent
# What each folder may import (absolutely) of this repository's packages: inside one, imports
# are relative, so it runs under its folder's name and its installed name alike (trainer/train.py
# names its own package only when run as a file, `deepspeed trainer/train.py`, where it has none).
ALLOWED = {"feeder": {"feeder"}, "client": {"feeder"}, "trainer": {"feeder", "feeder_client", "feeder_trainer"},
           "bench": {"feeder", "feeder_client"}}
INSTALLED = {"feeder_client": "client", "feeder_trainer": "trainer", "feeder_bench": "bench"}
OURS = {"feeder", "tests", *INSTALLED, *INSTALLED.values()}


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
    import the client, so the two imported each other); client, trainer and bench import their
    own modules relatively, so each works installed (feeder_client...) as well as from this
    tree by its folder's name, and the others by their installed names."""
    bad = []
    for pkg, allowed in ALLOWED.items():
        for path in sorted((ROOT / pkg).rglob("*.py")):
            wrong = (imported_top_levels(path) & OURS) - allowed
            if wrong:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, bad


def is_module(dotted: str) -> bool:
    """Whether a dotted name is one of this tree's modules (not a file name like client.crt)."""
    parts = dotted.split(".")
    return ROOT.joinpath(*parts).is_dir() or ROOT.joinpath(*parts[:-1], parts[-1] + ".py").exists()


def test_nothing_imports_the_folders_by_their_names():
    """One name per process: a module imported as `client.stream` and as `feeder_client.stream`
    is two modules (two FeederClient classes, two module states), so no code, test, script or
    document of this repository names `client`, `trainer` or `bench` as a module: not in an
    import, a `python -m`, a forkserver preload or an entry point."""
    bad = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if path.relative_to(ROOT).parts[0] in {".venv", "build", "demo"}:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else
                     [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", node.value) else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] in INSTALLED.values() and is_module(n)]
    folder_module = re.compile(r"(\bfrom (client|trainer|bench)\b[. ]|\bimport (client|trainer|bench)\b|"
                               r"-m (client|trainer|bench)\b|= (client|trainer|bench)\.)")
    for path in [ROOT / "Makefile", ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / ".ci").glob("*"))]:
        bad += [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                if folder_module.search(line)]
    assert not bad, bad


def test_feeder_finds_bench_through_the_entry_point_group(monkeypatch, capsys):
    """Plugin commands come from `feeder.commands`; one that cannot be imported is left out,
    and a built-in command does not read the entry points at all."""
    import importlib.metadata

    from feeder import cli

    eps = [EntryPoint("broken", "no_such_module_here:register", "feeder.commands"),
           EntryPoint("bench", "feeder_bench.cli:register", "feeder.commands")]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [e for e in eps if e.group == group])
    args = cli.build_parser(["bench"]).parse_args(["bench", "--quick", "--rounds", "2"])
    from feeder_bench.cli import cmd_bench

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
    from feeder.ops.cli_serve import cmd_serve

    assert cli.build_parser(["serve"]).parse_args(["serve", "--source", "x"]).fn is cmd_serve


def test_a_serving_feeder_process_never_loads_torch(dataset):
    """`feeder serve` streaming to a client: the feeder's process has no torch library mapped
    (torch is the client extra's; a feeder host installs without it)."""
    from feeder_client import ClientConfig, FeederClient
    from feeder.core.config import StreamSpec

    f = FeederProc(dataset)
    try:
        spec = StreamSpec(job="no-torch", rank=0, world_size=2, seq_len=16, micro_batch=2, num_epochs=1)
        assert sum(b.tokens.numel() for b in FeederClient(ClientConfig(targets=(f.address,), spec=spec))) > 0
        maps = Path(f"/proc/{f.proc.pid}/maps").read_text()
        assert "torch" not in maps, [line for line in maps.splitlines() if "torch" in line][:3]
    finally:
        f.stop()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built offline (no build isolation, no index) from a copy of the tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "data", "results.json", "*.png", "*_pb2*", ".generated")
    for name in ("protos", "feeder", "client", "trainer", "bench"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(tmp / "wheels"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (tmp / "wheels").glob("token_feeder-*.whl")
    return whl


def requirements_without_extras(requires: list[str]) -> list:
    """The Requires-Dist lines that apply to `pip install token-feeder` (no extra named)."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_the_wheel_requires_torch_only_for_the_client_extra(wheel):
    """torch only under the client extra (train and bench take it through client), and no
    dependency of the core install brings it either (their metadata, as installed here,
    followed to the end: what `pip install .` resolves, without asking the index); the
    packages under their installed names only (feeder, feeder_client, feeder_trainer,
    feeder_bench; no top-level client, trainer or bench), `feeder bench` registered in the
    feeder.commands group, tokenizer.py in place of the tokenize.py that shadowed the
    standard library's."""
    import importlib.metadata as md

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        eps = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"feeder", "feeder_client", "feeder_trainer", "feeder_bench"}, tops
    assert "feeder/ops/tokenizer.py" in names and "feeder/tokenize.py" not in names
    assert "feeder/bench.py" not in names and "feeder_bench/h2count.py" in names
    assert {"feeder_client/dataset.py", "feeder_trainer/train.py", "feeder_trainer/ds_config.json"} <= set(names)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    torch = [r for r in requires if r.split(";")[0].split(">")[0].split("=")[0].strip() == "torch"]   # (not torchft)
    assert torch and all('extra == "client"' in r for r in torch), torch
    assert not [r for r in requires if r.startswith("deepspeed") and 'extra == "train"' not in r]
    assert any(r.startswith("token-feeder[client]") and 'extra == "train"' in r for r in requires), requires
    assert "[feeder.commands]\nbench = feeder_bench.cli:register" in eps, eps

    seen, todo = set(), requirements_without_extras(requires)
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += requirements_without_extras(md.requires(req.name) or [])
        except md.PackageNotFoundError:   # a marker-excluded dependency never installed here
            pass
    assert "numpy" in seen and "grpcio" in seen, seen
    assert not seen & {"torch", "deepspeed", "triton"} and not any(n.startswith("nvidia-") for n in seen), seen


def test_the_installed_packages_import_by_their_names_from_outside_the_tree(wheel, tmp_path):
    """Installed from the wheel (offline, no dependencies: this venv has them), the site holds
    feeder, feeder_client, feeder_trainer and feeder_bench and no client, trainer or bench; run
    from outside the repository with that site first, each imports from there, the client's
    and trainer's relative imports included, and `python -m feeder_trainer.train --help` runs."""
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                        str(wheel)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    tops = {p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".libs")) and p.name != "bin"}
    assert tops == {"feeder", "feeder_client", "feeder_trainer", "feeder_bench"}, tops
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import feeder, feeder_client, feeder_trainer.model, feeder_bench.cli\n"
            "from feeder_client import FeederDataset, FeederClient\n"
            "from feeder_client.stream import FeederClient as F\n"
            "assert F is FeederClient\n"
            "for m in (feeder, feeder_client, feeder_trainer.model, feeder_bench.cli):\n"
            "    print(m.__file__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    files = r.stdout.split()
    assert len(files) == 4 and all(f.startswith(str(site)) for f in files), files
    r = subprocess.run([sys.executable, "-m", "feeder_trainer.train", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--targets" in r.stdout, r.stderr[-3000:]


def test_a_feeder_without_its_c_shuffle_refuses_torch_orders_and_serves_stateless_ones(monkeypatch):
    """The feeder never imports torch (issue 25): torch's orders come from feeder/_shuffle.c at
    every n. A feeder installed without a C compiler refuses them precisely (FAILED_PRECONDITION,
    marked for another feeder to try), not with an ImportError from deep in a stream, and still
    serves the stateless order (numpy)."""
    import numpy as np

    from feeder.core import order, sampler
    from feeder.core.errors import FailedPrecondition

    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` raises ImportError: never needed
    assert len(sampler.randperm(2**20, 1)) == 2**20
    monkeypatch.setattr(order, "_c", None)             # "no C compiler at install"
    with pytest.raises(FailedPrecondition, match="installed without its C shuffle") as e:
        sampler.randperm(10, 1, "torch")
    assert e.value.elsewhere
    ids = sampler.epoch_order(1000, 1, 0, True, "stateless")[np.arange(1000)]
    assert sorted(ids.tolist()) == list(range(1000))
