"""The point of repack: the files of a repack do not grow with the number of sources."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from repack.format.manifest import load_manifest
from repack.merge import merge
from repack.read.verify import verify
from repack.synth import write_prefix


def tiny_blend(root: Path, count: int) -> Path:
    """``count`` sources of 1 to 3 tokens, alternating uint16 and int32, in nested folders."""
    items: list[object] = []
    for i in range(count):
        dtype = np.uint16 if i % 2 == 0 else np.int32
        prefix = f"data/part-{i % 7}/src-{i:04d}"
        sequences = [np.arange(i % 3 + 1) + i]
        write_prefix(root / prefix, sequences, dtype=dtype)
        items += [1.0, prefix]
    blend = root / "blend.json"
    blend.write_text(json.dumps(items))
    return blend


@pytest.mark.parametrize("count", [10, 1000])
def test_file_names_do_not_depend_on_source_count(tmp_path: Path, count: int) -> None:
    out = tmp_path / "out"
    merge(tiny_blend(tmp_path / "src", count), out)
    assert sorted(os.listdir(out)) == [
        "fingerprints.rpf",
        "index.rpx",
        "manifest.json",
        "shard-00000.bin",
        "shard-00001.bin",
    ]
    manifest = load_manifest(out)
    assert len(manifest.sources) == count
    assert len(manifest.shards) == 2  # one per dtype
    assert verify(out).ok
