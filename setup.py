"""Build hooks: generate the gRPC code from protos/ at build and install time, and build the
small optional C parts: the shuffle (feeder/_shuffle.c; without a compiler the feeder uses
torch's), and the token gather and reply writer (feeder/_native.c; without it, numpy and the
Python writer in service/wire.py).

The packages: feeder (and its subpackages), and three folders installed under names that say
whose they are, because `client`, `trainer` and `bench` would be anyone's names and a user's
own module of that name would shadow ours or be shadowed by it: client/ as `feeder_client`,
trainer/ as `feeder_trainer`, bench/ as `feeder_bench`. Their imports of each other's modules
are relative, so the code runs under the folder's name as well as the installed one; code
that imports one of them from another package uses the installed name only (one name per
process: the same module under two names is two copies, and isinstance and module state
break between them)."""
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithProtos(build_py):
    def run(self):
        import sys

        sys.path.insert(0, str(HERE))
        from feeder._protogen import generate

        generate()
        super().run()


# installed name -> folder; a tree copied without one of them (deploy/Dockerfile's feeder image
# has no bench/) installs without it
RENAMED = {name: folder for name, folder in (("feeder_client", "client"), ("feeder_trainer", "trainer"),
                                             ("feeder_bench", "bench"))
           if (HERE / folder / "__init__.py").exists()}


def renamed_packages() -> list[str]:
    """Each renamed folder's package and its subpackages, by their installed names."""
    return [f"{name}{'.' + sub if sub else ''}" for name, folder in RENAMED.items()
            for sub in ["", *find_packages(where=str(HERE / folder))]]


setup(cmdclass={"build_py": BuildWithProtos},
      packages=[*find_packages(include=["feeder", "feeder.*"]), *renamed_packages()],
      package_dir=RENAMED,
      ext_modules=[Extension("feeder._shuffle", ["feeder/_shuffle.c"], optional=True, extra_compile_args=["-O3"]),
                   Extension("feeder._native", ["feeder/_native.c"], optional=True,
                             # (no fused multiply-add: the blendings' double arithmetic is the Python's)
                             extra_compile_args=["-O3", "-ffp-contract=off"])])
