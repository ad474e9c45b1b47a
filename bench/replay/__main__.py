"""Entry point of `python -m bench.replay` (see bench/replay/cli.py for the options)."""

from __future__ import annotations

import sys

from bench.replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
