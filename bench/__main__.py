"""`python -m bench` (or `python -m feeder_bench` where installed): see bench.cli."""
import sys

from .cli import main

sys.exit(main())
