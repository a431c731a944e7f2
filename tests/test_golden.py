"""The committed golden repacks (format version 1) must stay readable, and writable, forever.

tests/fixtures/golden/ holds four repacks of the same six tiny sources, each written once by
tests/fixtures/make_golden.py and never regenerated (their file hashes are pinned below):

* ``repack``: a raw merge into 8 KiB shards (one source cut across two shards);
* ``repack-zstd``: the same merge with zstd-compressed shards;
* ``repack-appended``: the first four sources merged, then the other two added (``repack
  add``), the cut one included;
* ``repack-fingerprints``: the raw merge with document fingerprints (``fingerprints.rpf``);
  the three above were written before fingerprints existed, and must stay readable and
  verifiable without them.

Every future version must read them (verify, inspect, extract byte-identical, the loader's
views) and write them again byte for byte from the same sources. If a change makes this test
fail, the change broke compatibility; fix the change, not the fixture.

The manifests record the absolute paths of the sources at merge time; nothing here depends on
them: sources are named as the blend files write them, relative to the blend file.
"""

from __future__ import annotations

import filecmp
import hashlib
import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fixtures import make_golden

from repack.cli import main
from repack.format import spec as fmt
from repack.format.manifest import dump_manifest, load_manifest
from repack.read.extract import extract
from repack.read.verify import verify
from repack.read.views import SourceDataset

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
SOURCES = GOLDEN / "sources"


@dataclass(frozen=True)
class Golden:
    """One committed repack and what is pinned about it."""

    folder: str
    #: sha256 of every file: proof that it was not regenerated
    pinned: dict[str, str]
    #: what ``repack inspect`` counts: bytes are the logical (uncompressed) shard bytes
    shards: int
    bytes: int
    #: the shards of each source, in blend order
    source_shards: list[list[int]]


#: sha256 of every file of each golden folder: proof that it was not regenerated.
PINNED = {
    "repack": {
        "index.rpx": "90a5d8e269422761defb8f638694e33dfc433a6ef1c7ffe0f5af8fac2365055a",
        "manifest.json": "43c15e68dccf5b27c5201bed22c0ba4cf936200494354399006dda7eb73a80b2",
        "shard-00000.bin": "9f56f575ddbf2ea0d561e43b8bd2b9025f80dcdaa52aba70f587e8ee444c9587",
        "shard-00001.bin": "a26d8ec5cd80aaa340edca84945dd1d2cfdc57e4ec8f6f4c73bbc52c175d80a0",
        "shard-00002.bin": "6dbc68e19083ce31b978c05547f03a692b0294d3870a70475dab941919e2c67f",
        "shard-00003.bin": "6014e68970b9616a6f1e7d77e53b07cc66319a69b793b642e6735ca4ac67bf66",
        "shard-00004.bin": "081cb123efd323c6c84032304a89bd2f1e2bfffeeaeb7882fb4fec2710dbf2f0",
    },
    "repack-zstd": {
        "index.rpx": "90a5d8e269422761defb8f638694e33dfc433a6ef1c7ffe0f5af8fac2365055a",
        "manifest.json": "aec75a6462869b542074aa2ca2879293da3f38324919f2444b9466e77f8c081a",
        "shard-00000.bin.zst": "d6b1d55f36b770e5f0be35e1cb48bf12e027166a8d91a1189d210a533d7a6f2b",
        "shard-00001.bin.zst": "849cf8a0de0624df29601c3f532038ad68cdde11beab07fb64973fa2b5477320",
        "shard-00002.bin.zst": "5ed20559221b4ccd14be6aa73eeae75fc5d41d32ea562d7022bc3c3889d400c3",
        "shard-00003.bin.zst": "82ee24c2c82fac4f9e13a01025294708ec1c5a86c80736d1f064a8d280a5af1a",
        "shard-00004.bin.zst": "e1253c43937268efc3b610a019f1ad42781f40469af1f9cb9f31b369366f5d71",
    },
    "repack-appended": {
        "index-1.rpx": "90a5d8e269422761defb8f638694e33dfc433a6ef1c7ffe0f5af8fac2365055a",
        "manifest.json": "1876a27a1eccb94144c069d2c73e58e31af3ccfe52d500ffc0b3b603dc076a09",
        "shard-00000.bin": "9f56f575ddbf2ea0d561e43b8bd2b9025f80dcdaa52aba70f587e8ee444c9587",
        "shard-00001.bin": "be80458df336bb9f6c6c624aefbca2be9e27b1479a65ad8cbc3425c9c27db182",
        "shard-00002.bin": "081cb123efd323c6c84032304a89bd2f1e2bfffeeaeb7882fb4fec2710dbf2f0",
        "shard-00003.bin": "5c94e3983c755b384f6d24c8a5c77ea45ade11f71f947fcfa2f247c393e8ec1a",
        "shard-00004.bin": "6dbc68e19083ce31b978c05547f03a692b0294d3870a70475dab941919e2c67f",
        "shard-00005.bin": "6014e68970b9616a6f1e7d77e53b07cc66319a69b793b642e6735ca4ac67bf66",
    },
    "repack-fingerprints": {
        "fingerprints.rpf": "632c22182de6a790b37939071fe0c01788c6ce91cc522598958cd24ad9fddb30",
        "index.rpx": "90a5d8e269422761defb8f638694e33dfc433a6ef1c7ffe0f5af8fac2365055a",
        "manifest.json": "5974ccf17d4bf9743e6b7d5f2b9087762bb13b422676837ca8938921a8286d50",
        "shard-00000.bin": "9f56f575ddbf2ea0d561e43b8bd2b9025f80dcdaa52aba70f587e8ee444c9587",
        "shard-00001.bin": "a26d8ec5cd80aaa340edca84945dd1d2cfdc57e4ec8f6f4c73bbc52c175d80a0",
        "shard-00002.bin": "6dbc68e19083ce31b978c05547f03a692b0294d3870a70475dab941919e2c67f",
        "shard-00003.bin": "6014e68970b9616a6f1e7d77e53b07cc66319a69b793b642e6735ca4ac67bf66",
        "shard-00004.bin": "081cb123efd323c6c84032304a89bd2f1e2bfffeeaeb7882fb4fec2710dbf2f0",
    },
}

GOLDENS = {
    "repack": Golden(
        "repack",
        PINNED["repack"],
        shards=5,
        bytes=18230,
        source_shards=[[0], [0], [4], [1], [1], [2, 3]],
    ),
    "repack-zstd": Golden(
        "repack-zstd",
        PINNED["repack-zstd"],
        shards=5,
        bytes=18230,
        source_shards=[[0], [0], [4], [1], [1], [2, 3]],
    ),
    "repack-appended": Golden(
        "repack-appended",
        PINNED["repack-appended"],
        shards=6,
        bytes=14146,
        source_shards=[[0], [0], [2], [1], [3], [4, 5]],
    ),
    "repack-fingerprints": Golden(
        "repack-fingerprints",
        PINNED["repack-fingerprints"],
        shards=5,
        bytes=18230,
        source_shards=[[0], [0], [4], [1], [1], [2, 3]],
    ),
}

TOTALS = {"sources": 6, "tokens": 5028, "sequences": 20, "documents": 13}

every_golden = pytest.mark.parametrize("golden", list(GOLDENS.values()), ids=list(GOLDENS))


def blend_prefixes() -> list[str]:
    """The prefixes as the committed blend file writes them."""
    items = json.loads((SOURCES / "blend.json").read_text())
    return items[1::2]


def test_every_golden_folder_is_pinned() -> None:
    found = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir() and p.name != "sources")
    assert found == sorted(GOLDENS) == sorted(make_golden.BUILDS)


@every_golden
def test_golden_files_are_the_committed_ones(golden: Golden) -> None:
    folder = GOLDEN / golden.folder
    found = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
    assert found == golden.pinned


@every_golden
def test_manifest_is_format_version_1(golden: Golden) -> None:
    folder = GOLDEN / golden.folder
    raw = json.loads((folder / "manifest.json").read_bytes())
    assert (raw["format"], raw["version"]) == ("repack", 1)
    assert raw["checksum_algorithm"] == "xxh3-128"
    index = raw["index"]["file"]
    assert (folder / index).read_bytes()[:12] == b"RPKINDX\x00\x01\x00\x00\x00"
    codecs = {shard.get("codec") for shard in raw["shards"]}
    assert codecs == ({"zstd"} if golden.folder == "repack-zstd" else {None})
    if golden.folder == "repack-appended":
        assert index == fmt.index_name(1)
        assert [b["source"] for b in raw["appended"]] == ["sources/blend.json"]
    else:
        assert index == fmt.INDEX_FILE and "appended" not in raw


@every_golden
def test_golden_verifies(golden: Golden) -> None:
    folder = GOLDEN / golden.folder
    report = verify(folder)
    assert report.ok, report.problems
    assert report.sources == 6
    result = CliRunner().invoke(main, ["verify", "-q", str(folder)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"OK: {len(golden.pinned)} files, ")


@every_golden
def test_golden_inspect_totals(golden: Golden) -> None:
    folder = GOLDEN / golden.folder
    result = CliRunner().invoke(main, ["inspect", "--json", str(folder)])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert {k: info["totals"][k] for k in TOTALS} == TOTALS
    assert (info["totals"]["shards"], info["totals"]["bytes"]) == (golden.shards, golden.bytes)
    assert [s["prefix"] for s in info["sources"]] == blend_prefixes()
    assert [(s["dtype"], s["multimodal"]) for s in info["sources"]] == [
        ("uint16", False),
        ("uint16", False),
        ("int32", False),
        ("uint16", True),
        ("uint16", False),
        ("uint16", False),
    ]
    assert [s["shards"] for s in info["sources"]] == golden.source_shards
    assert [s["splits"] for s in info["sources"]] == [
        [{"split": "all", "weight": weight}] for weight, *_ in make_golden.SOURCES.values()
    ]
    text = CliRunner().invoke(main, ["inspect", str(folder)]).stdout
    assert text.splitlines()[-1].startswith(
        "total: 6 sources, 5,028 tokens, 20 sequences, 13 documents in "
        f"{golden.shards} shard{'' if golden.shards == 1 else 's'}, "
    )


@every_golden
@pytest.mark.parametrize("prefix", blend_prefixes())
def test_golden_extracts_byte_identical(golden: Golden, prefix: str, tmp_path: Path) -> None:
    extract(GOLDEN / golden.folder, prefix, tmp_path / "x")
    for ext in (".bin", ".idx"):
        original = SOURCES / f"{prefix}{ext}"
        assert filecmp.cmp(original, tmp_path / f"x{ext}", shallow=False), f"{prefix}{ext}"


@every_golden
@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_golden_loader_reads_the_written_tokens(golden: Golden, mmap: bool) -> None:
    """The loader's views give the sequences, documents and modes make_golden.py wrote."""
    for prefix, (_, sequences, dtype, documents, modes) in make_golden.SOURCES.items():
        view = SourceDataset(str(GOLDEN / golden.folder), prefix, modes is not None, mmap)
        assert len(view) == len(sequences)
        for i, want in enumerate(sequences):
            got = view[i]
            if modes is not None:
                got, mode = got
                assert mode == modes[i]
            assert got.dtype == np.dtype(dtype) and got.tolist() == want, (prefix, i)
        expected = list(range(len(sequences) + 1)) if documents is None else documents
        assert view.document_indices.tolist() == expected


@every_golden
def test_todays_code_writes_the_golden_bytes(
    golden: Golden, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make_golden.py's build, run now from a copy of the sources, gives the committed bytes.

    The manifest records where the sources were and which version wrote it: with those two
    values put back, it is byte-identical too (self-checksum included).
    """
    shutil.copytree(SOURCES, tmp_path / "sources")
    monkeypatch.chdir(tmp_path)
    make_golden.BUILDS[golden.folder](golden.folder)
    ours, theirs = tmp_path / golden.folder, GOLDEN / golden.folder
    assert sorted(os.listdir(ours)) == sorted(golden.pinned)
    for name in golden.pinned:
        if name != "manifest.json":
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    committed = load_manifest(theirs)
    first = committed.sources[0]
    recorded_root = first.path[: -len(first.name)]
    body = json.loads((ours / "manifest.json").read_bytes())
    del body["checksum"]
    body["created_by"] = committed.created_by
    text = json.dumps(body).replace(str(tmp_path / "sources") + os.sep, recorded_root)
    assert (
        dump_manifest(json.loads(text), committed.algorithm)
        == (theirs / "manifest.json").read_bytes()
    )


@every_golden
def test_golden_fingerprints_are_each_documents_xxh3(golden: Golden) -> None:
    """The fingerprints are XXH3-64 of each document's bytes in the original ``.bin``
    (computed here with xxhash on the source files, not with repack's code); the repacks
    written before fingerprints say they have none."""
    import xxhash

    from repack.read.fingerprints import load_fingerprints
    from repack.read.reader import Repack

    folder = GOLDEN / golden.folder
    repack = Repack(folder)
    found = load_fingerprints(folder, repack.manifest)
    if golden.folder != "repack-fingerprints":
        assert isinstance(found, str) and found.startswith("no fingerprints")
        return
    header = (folder / "fingerprints.rpf").read_bytes()[:64]
    assert header[:16] == b"RPKFPRT\x00\x01\x00\x00\x00\x00\x00\x00\x00"
    assert int.from_bytes(header[16:24], "little") == 6
    assert int.from_bytes(header[24:32], "little") == TOTALS["documents"]
    for prefix, source in zip(blend_prefixes(), repack.manifest.sources):
        _, sequences, dtype, documents, _ = make_golden.SOURCES[prefix]
        data = (SOURCES / f"{prefix}.bin").read_bytes()
        itemsize = np.dtype(dtype).itemsize
        ends = np.cumsum([0] + [len(s) * itemsize for s in sequences])
        docs = list(range(len(sequences) + 1)) if documents is None else documents
        expected = [
            xxhash.xxh3_64_intdigest(data[ends[a] : ends[b]]) for a, b in itertools.pairwise(docs)
        ]
        assert found.of(source.id).tolist() == expected, prefix
