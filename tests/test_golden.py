"""The committed golden repack (format version 1) must stay readable by every future version.

tests/fixtures/golden/ was written once by tests/fixtures/make_golden.py and is never
regenerated: its file hashes are pinned below. If a change to repack makes this test fail,
the change broke backwards compatibility; fix the change, not the fixture.

The manifest records the absolute paths of the sources at merge time; nothing here depends on
them: sources are named as the blend file writes them, relative to the blend file.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.extract import extract
from repack.verify import verify

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
REPACK = GOLDEN / "repack"
SOURCES = GOLDEN / "sources"

#: sha256 of every file of the committed repack: proof that it was not regenerated.
PINNED = {
    "index.rpx": "90a5d8e269422761defb8f638694e33dfc433a6ef1c7ffe0f5af8fac2365055a",
    "manifest.json": "43c15e68dccf5b27c5201bed22c0ba4cf936200494354399006dda7eb73a80b2",
    "shard-00000.bin": "9f56f575ddbf2ea0d561e43b8bd2b9025f80dcdaa52aba70f587e8ee444c9587",
    "shard-00001.bin": "a26d8ec5cd80aaa340edca84945dd1d2cfdc57e4ec8f6f4c73bbc52c175d80a0",
    "shard-00002.bin": "6dbc68e19083ce31b978c05547f03a692b0294d3870a70475dab941919e2c67f",
    "shard-00003.bin": "6014e68970b9616a6f1e7d77e53b07cc66319a69b793b642e6735ca4ac67bf66",
    "shard-00004.bin": "081cb123efd323c6c84032304a89bd2f1e2bfffeeaeb7882fb4fec2710dbf2f0",
}

TOTALS = {"sources": 6, "shards": 5, "tokens": 5028, "sequences": 20, "documents": 13}


def blend_prefixes() -> list[str]:
    """The prefixes as the committed blend file writes them."""
    items = json.loads((SOURCES / "blend.json").read_text())
    return items[1::2]


def test_golden_files_are_the_committed_ones() -> None:
    found = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(REPACK.iterdir())}
    assert found == PINNED


def test_manifest_is_format_version_1() -> None:
    raw = json.loads((REPACK / "manifest.json").read_bytes())
    assert (raw["format"], raw["version"]) == ("repack", 1)
    assert raw["checksum_algorithm"] == "xxh3-128"
    assert (REPACK / "index.rpx").read_bytes()[:12] == b"RPKINDX\x00\x01\x00\x00\x00"


def test_golden_verifies() -> None:
    report = verify(REPACK)
    assert report.ok, report.problems
    assert report.sources == 6
    result = CliRunner().invoke(main, ["verify", "-q", str(REPACK)])
    assert result.exit_code == 0 and result.stdout.startswith("OK: 7 files, ")


def test_golden_inspect_totals() -> None:
    result = CliRunner().invoke(main, ["inspect", "--json", str(REPACK)])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert {k: info["totals"][k] for k in TOTALS} == TOTALS
    assert info["totals"]["bytes"] == 18230
    assert [s["prefix"] for s in info["sources"]] == blend_prefixes()
    assert [(s["dtype"], s["multimodal"]) for s in info["sources"]] == [
        ("uint16", False),
        ("uint16", False),
        ("int32", False),
        ("uint16", True),
        ("uint16", False),
        ("uint16", False),
    ]
    assert [s["shards"] for s in info["sources"]][-1] == [2, 3]  # cut across two shards
    text = CliRunner().invoke(main, ["inspect", str(REPACK)]).stdout
    assert text.splitlines()[-1].startswith(
        "total: 6 sources, 5,028 tokens, 20 sequences, 13 documents in 5 shard(s), 17.8 KiB;"
    )


@pytest.mark.parametrize("prefix", blend_prefixes())
def test_golden_extracts_byte_identical(prefix: str, tmp_path: Path) -> None:
    extract(REPACK, prefix, tmp_path / "x")
    for ext in (".bin", ".idx"):
        original = SOURCES / f"{prefix}{ext}"
        assert filecmp.cmp(original, tmp_path / f"x{ext}", shallow=False), f"{prefix}{ext}"
