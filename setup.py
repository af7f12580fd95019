"""Build hooks: generate the gRPC code from protos/ at build and install time, and build the
small optional C parts: the shuffle (feeder/_shuffle.c; without a compiler the feeder uses
torch's), and the token gather and reply writer (feeder/_native.c; without it, numpy and the
Python writer in service/wire.py).

The packages: feeder (and its subpackages), client and trainer, and the benchmark, whose
folder bench/ is installed as `feeder_bench` (a top-level `bench` would be anyone's name;
its imports are relative, so it runs under either name)."""
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


setup(cmdclass={"build_py": BuildWithProtos},
      packages=[*find_packages(include=["feeder", "feeder.*", "client", "client.*", "trainer", "trainer.*"]),
                # a tree copied without bench/ (deploy/Dockerfile's feeder image) installs without it
                *(["feeder_bench"] if (HERE / "bench" / "__init__.py").exists() else [])],
      package_dir={"feeder_bench": "bench"},
      ext_modules=[Extension("feeder._shuffle", ["feeder/_shuffle.c"], optional=True),
                   Extension("feeder._native", ["feeder/_native.c"], optional=True,
                             extra_compile_args=["-O3"])])
