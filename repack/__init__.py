"""repack: consolidate Megatron-LM training blends into a few shards, losslessly."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
