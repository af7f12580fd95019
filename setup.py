"""Build hook: generate the gRPC code from protos/ at build and install time."""
from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self):
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from feeder._protogen import generate

        generate()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
