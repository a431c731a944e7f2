"""The manifest refuses what it does not understand or what would mislead a reader, with a
FormatError naming manifest.json; every crafted manifest here carries a valid self-checksum, so
only the structural checks can catch it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from repack import format as fmt
from repack.errors import FormatError
from repack.manifest import dump_manifest, load_manifest
from repack.merge import merge
from repack.reader import Repack
from repack.synth import write_prefix


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifest")
    rng = np.random.default_rng(3)
    for name in ("a", "b"):
        sequences = [rng.integers(0, 1000, int(n)).astype(np.uint16) for n in (5, 900, 7)]
        write_prefix(root / "data" / name, sequences)
    (root / "blend.json").write_text('[1, "data/a", 2, "data/b"]')
    out = root / "out"
    merge(root / "blend.json", out, shard_size=4096)
    return out


def rewrite(out: Path, change: Callable[[dict], None], tmp_path: Path) -> Path:
    """A copy of ``out`` whose manifest was changed by ``change`` and re-checksummed."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in out.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    raw = json.loads((copy / fmt.MANIFEST_FILE).read_bytes())
    algorithm = raw.pop("checksum").split(":")[0]
    change(raw)
    (copy / fmt.MANIFEST_FILE).write_bytes(dump_manifest(raw, algorithm))
    return copy


def test_rewrite_without_change_is_accepted(pristine: Path, tmp_path: Path) -> None:
    copy = rewrite(pristine, lambda raw: None, tmp_path)
    assert load_manifest(copy).sources[1].name == "data/b"


def _set(path: tuple, value) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set(("version",), 2), r"format version 2 is not supported .*upgrade repack"),
        (_set(("format",), "other"), r"format is 'other', expected 'repack'"),
        (_set(("index", "file"), "../index.rpx"), r"index.file is '\.\./index\.rpx', expected a "),
        (_set(("index", "file"), "other.rpx"), r"index.file is 'other.rpx', expected 'index.rpx'"),
        (_set(("shards", 0, "file"), "/etc/passwd"), r"shards\[0\]\.file is '/etc/passwd'"),
        (_set(("sources", 1, "segments", 0, "first"), 1), r"does not continue the source"),
        (_set(("sources", 0, "idx_size"), 35), r"idx_size is 35, which disagrees"),
        (_set(("sources", 0, "multimodal"), "yes"), r"multimodal is 'yes', expected true"),
        (_set(("sources", 0, "tokens"), -1), r"tokens is -1, expected an integer >= 0"),
        (_set(("blend",), {"form": "nope"}), r"blend: "),
        (_set(("checksum_algorithm",), "sha256"), r"the manifest's own checksum is not sha256"),
    ],
)
def test_structurally_wrong_manifest_is_refused(
    pristine: Path, tmp_path: Path, change, message: str
) -> None:
    copy = rewrite(pristine, change, tmp_path)
    with pytest.raises(FormatError, match=message) as caught:
        Repack(str(copy))
    assert str(caught.value).startswith(f"{copy / fmt.MANIFEST_FILE}: invalid manifest: ")
