"""Entry point of `python -m bench.cluster` (bench/cluster/cli.py has the options)."""

from __future__ import annotations

import sys

from bench.cluster.cli import main

if __name__ == "__main__":
    sys.exit(main())
