"""The ``repack`` command line (moved from ``repack/cli.py``; split by command family next)."""

from repack.cli.diagnosis import main

__all__ = ["main"]
