"""Every command on every kind of repack, as a user runs them (the command line).

Kinds (``KINDS``), all built from the same sources through ``repack merge`` / ``repack add``:

* ``raw``: a plain merge (one shard per dtype, no source cut);
* ``cut``: a merge into 8 KiB shards: many shards, most sources cut across two or more;
* ``zstd``: the cut merge with zstd-compressed shards;
* ``appended``: the first sources merged (cut), then the whole blend added with ``repack add``
  (the sources held are skipped, the others land in new shards);
* ``appended-zstd``: the same on the compressed merge (the added shards are compressed too);
* ``removed``, ``removed-zstd``: the cut merge (raw, compressed), then ``repack remove`` of two
  loader sources and an edge source (their shards rewritten under new file numbers).

Commands (the ``test_*`` functions below), each run on every kind and asserting a result, not
just the absence of a crash:

* ``verify`` (with 1 and 3 workers) and ``verify --json``: exit 0, ``OK`` counting every file
  and source;
* ``verify --sources`` (text, ``--json`` and the real console script): every original compared
  byte for byte, OK;
* ``inspect`` and ``inspect --json``: every source with its prefix, split, weight, dtype and
  counts as read from the originals, and the totals;
* ``extract`` of every source (by its name in the blend or by its absolute path): both files
  byte-identical to the originals;
* ``add`` of two more sources to a copy: existing shards untouched, the new sources verify and
  extract byte-identical, compressed like the rest;
* the Megatron loader, ``repack.megatron.dataset_class(OUT)`` under real megatron-core: the
  samples of stock ``GPTDataset`` over the original prefixes, bit for bit.

A new kind is one more entry in ``KINDS``: a function that builds it with the command line in
a given folder, the sources it holds and what makes it that kind; every command above then runs
on it with no other change (the loader cell compares with stock Megatron over the loader
sources the kind holds).
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from fixtures import make_golden
from kill_support import repack_command
from megatron_support import (
    GPTDataset,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    weights_for,
    write_sources,
)

from repack.cli import main
from repack.format.manifest import Manifest, load_manifest
from repack.inputs.sources import read_source_index
from repack.megatron import dataset_class

SHARD_SIZE = "8KiB"
#: Samples per split asked of the Megatron builder.
SIZES = [300, 30, 30]


def cli(*args: object) -> Result:
    """``repack ARGS`` through CliRunner; never a crash, never a traceback."""
    result = CliRunner().invoke(main, [os.fspath(a) for a in args])
    assert "Traceback" not in result.output and "Aborted" not in result.output, result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def ok(*args: object) -> Result:
    """``repack ARGS``, which must succeed and print no error."""
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert "Error" not in result.stderr, result.stderr
    return result


# --- the sources ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """The sources every kind is built from, and blends naming them."""

    root: Path
    #: every source, as the blends write them (relative to ``root``), in blend order
    names: list[str]
    weights: list[float]
    #: sources that Megatron's GPTDataset can split 90/5/5 (absolute prefixes)
    loader: list[str]
    #: the whole blend, and its first ``first`` sources
    blend: Path
    first_blend: Path
    #: two sources no kind holds (for ``add``; the second of another dtype), and their blend
    extra: list[str]
    extra_blend: Path

    def path(self, name: str) -> str:
        """The absolute prefix of a source named as in the blend."""
        return str(self.root / name)


def _write_blend(path: Path, names: list[str], weights: list[float]) -> Path:
    path.write_text(json.dumps([x for pair in zip(weights, names) for x in pair]))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    """Eight sources Megatron can sample (uint16 and int32, multi-sequence documents), then the
    golden repack's six (an empty sequence, an empty document, int32 ids, a multimodal source,
    one larger than a shard)."""
    root = tmp_path_factory.mktemp("matrix")
    loader = write_sources(root, 8, seed=31)
    edge = [f"edge/{prefix}" for prefix in make_golden.write_prefixes(root / "edge")]
    names = [os.path.relpath(p, root) for p in loader] + edge
    weights = weights_for(names, seed=31)
    blend = _write_blend(root / "blend.json", names, weights)
    # the first blend: some loader sources and some edge sources, so that `add` brings both
    first = _write_blend(root / "first.json", names[:5] + names[8:11], weights[:5] + weights[8:11])
    extra = write_sources(root, 2, seed=32, int32_every=2, folder="extra")  # uint16, int32
    extra_blend = _write_blend(root / "extra.json", extra, [0.5, 0.5])
    return Inputs(root, names, weights, loader, blend, first, extra, extra_blend)


# --- the kinds of repack ----------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """How to build one kind of repack, and what it must hold."""

    #: writes the repack into the folder (absent) with the command line
    build: Callable[[Inputs, Path], None]
    #: the sources it holds, as blends name them, in manifest order
    holds: Callable[[Inputs], list[str]]
    #: what makes this kind what it is, checked on its manifest
    premise: Callable[[Manifest], bool]
    compressed: bool = False


def _appended_order(inputs: Inputs) -> list[str]:
    first = inputs.names[:5] + inputs.names[8:11]
    return first + [n for n in inputs.names if n not in first]


def _cut(manifest: Manifest) -> bool:
    return len(manifest.shards) > 4 and any(len(s.segments) > 1 for s in manifest.sources)


def _merged(*options: str) -> Callable[[Inputs, Path], None]:
    def build(inputs: Inputs, out: Path) -> None:
        ok("merge", "-q", *options, inputs.blend, out)

    return build


def _appended(*options: str) -> Callable[[Inputs, Path], None]:
    def build(inputs: Inputs, out: Path) -> None:
        ok("merge", "-q", *options, inputs.first_blend, out)
        added = ok("add", "-q", out, inputs.blend)
        assert added.stdout.startswith(f"added {len(inputs.names) - 8} sources ")

    return build


#: sources the removed kinds lose: loader sources in the first and last shards, an edge source
REMOVED = (1, 6, 9)


def _removed(*options: str) -> Callable[[Inputs, Path], None]:
    def build(inputs: Inputs, out: Path) -> None:
        ok("merge", "-q", *options, inputs.blend, out)
        ok("remove", "-q", out, *(inputs.names[i] for i in REMOVED))

    return build


def _kept(inputs: Inputs) -> list[str]:
    return [n for i, n in enumerate(inputs.names) if i not in REMOVED]


def _rewritten(manifest: Manifest) -> bool:
    """Some shard was rewritten by ``repack remove``: its file number is not its position."""
    return any(not s.file.startswith(f"shard-{k:05d}.") for k, s in enumerate(manifest.shards))


KINDS: dict[str, Kind] = {
    "raw": Kind(
        _merged(),
        lambda i: i.names,
        lambda m: all(len(s.segments) == 1 for s in m.sources) and len(m.shards) == 2,
    ),
    "cut": Kind(_merged("--shard-size", SHARD_SIZE), lambda i: i.names, _cut),
    "zstd": Kind(
        _merged("--shard-size", SHARD_SIZE, "--compress", "zstd"),
        lambda i: i.names,
        lambda m: _cut(m) and all(s.codec == "zstd" for s in m.shards),
        compressed=True,
    ),
    "appended": Kind(
        _appended("--shard-size", SHARD_SIZE),
        _appended_order,
        lambda m: _cut(m) and len(m.appended) == 1 and m.index_file == "index-1.rpx",
    ),
    "appended-zstd": Kind(
        _appended("--shard-size", SHARD_SIZE, "--compress", "zstd:5"),
        _appended_order,
        lambda m: _cut(m) and len(m.appended) == 1 and all(s.codec == "zstd" for s in m.shards),
        compressed=True,
    ),
    "removed": Kind(
        _removed("--shard-size", SHARD_SIZE),
        _kept,
        lambda m: _cut(m) and _rewritten(m),
    ),
    "removed-zstd": Kind(
        _removed("--shard-size", SHARD_SIZE, "--compress", "zstd"),
        _kept,
        lambda m: _cut(m) and _rewritten(m) and all(s.codec == "zstd" for s in m.shards),
        compressed=True,
    ),
}

every_kind = pytest.mark.parametrize("kind", list(KINDS))


@pytest.fixture(scope="module")
def repacks(inputs: Inputs, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``repacks(kind)``: the repack of that kind, built on first use. Read-only."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            out = tmp_path_factory.mktemp(f"kind-{kind}") / "out"
            KINDS[kind].build(inputs, out)
            built[kind] = out
        return built[kind]

    return get


@dataclass(frozen=True)
class Facts:
    """What the originals say about a source."""

    dtype: str
    multimodal: bool
    tokens: int
    sequences: int
    documents: int


def facts(prefix: str) -> Facts:
    info = read_source_index(prefix)
    return Facts(
        info.info.dtype.name,
        info.modes is not None,
        info.info.token_count,
        info.info.sequence_count,
        info.info.document_count - 1,
    )


# --- the matrix -------------------------------------------------------------------------------


@every_kind
def test_kind_is_what_it_claims(kind: str, inputs: Inputs, repacks) -> None:
    manifest = load_manifest(repacks(kind))
    assert KINDS[kind].premise(manifest)
    assert [s.name for s in manifest.sources] == KINDS[kind].holds(inputs)


@every_kind
def test_verify(kind: str, inputs: Inputs, repacks) -> None:
    out = repacks(kind)
    files = len(os.listdir(out))
    n = len(KINDS[kind].holds(inputs))
    text = ok("verify", "-q", out).stdout
    assert text.startswith(f"OK: {files} files, ") and text.endswith(f", {n} sources\n"), text
    # the same report whether shards are hashed one at a time or in parallel
    assert ok("verify", "-q", "--workers", "1", out).stdout == text
    assert ok("verify", "-q", "--workers", "3", out).stdout == text
    report = json.loads(ok("verify", "-q", "--json", out).stdout)
    assert report["ok"] and report["problems"] == []
    assert (report["files_checked"], report["sources_checked"]) == (files, n)
    assert report["originals_compared"] == 0


@every_kind
def test_verify_sources(kind: str, inputs: Inputs, repacks) -> None:
    out = repacks(kind)
    n = len(KINDS[kind].holds(inputs))
    text = ok("verify", "-q", "--sources", out).stdout
    assert text.startswith("OK: ") and text.endswith(
        f", {n} sources; {n} originals compared byte for byte\n"
    ), text
    report = json.loads(ok("verify", "-q", "--sources", "--json", out).stdout)
    assert report["ok"] and report["originals_compared"] == n
    assert report["originals_missing"] == [] and report["problems"] == []
    # the console script, in a process of its own, as the user ran it
    done = subprocess.run(
        [*repack_command(), "verify", "-q", "--sources", out], capture_output=True, text=True
    )
    assert (done.returncode, done.stderr, done.stdout) == (0, "", text)


@every_kind
def test_inspect(kind: str, inputs: Inputs, repacks) -> None:
    out = repacks(kind)
    names = KINDS[kind].holds(inputs)
    weight = dict(zip(inputs.names, inputs.weights))
    info = json.loads(ok("inspect", "--json", out).stdout)
    manifest = load_manifest(out)
    expected = []
    for name in names:
        f = facts(inputs.path(name))
        expected.append(
            {
                "prefix": name,
                "path": inputs.path(name),
                "splits": [{"split": "all", "weight": weight[name]}],
                "dtype": f.dtype,
                "multimodal": f.multimodal,
                "tokens": f.tokens,
                "sequences": f.sequences,
                "documents": f.documents,
            }
        )
    assert [{k: s[k] for k in expected[0]} for s in info["sources"]] == expected
    assert [s["shards"] for s in info["sources"]] == [
        sorted({seg.shard for seg in s.segments}) for s in manifest.sources
    ]
    totals = {
        "sources": len(names),
        "shards": len(manifest.shards),
        "tokens": sum(e["tokens"] for e in expected),
        "sequences": sum(e["sequences"] for e in expected),
        "documents": sum(e["documents"] for e in expected),
        "bytes": sum(s.size for s in manifest.shards),
    }
    assert info["totals"] == totals
    lines = ok("inspect", out).stdout.splitlines()
    assert lines[0].split() == [
        "id", "prefix", "splits", "dtype", "tokens", "sequences", "documents", "shard"
    ]  # fmt: skip
    for row, e in zip(lines[1 : 1 + len(names)], expected, strict=True):
        cells = row.split()
        assert cells[1:4] == [
            e["prefix"],
            f"all:{weight[e['prefix']]:g}",
            e["dtype"] + ("+mm" if e["multimodal"] else ""),
        ]
        assert cells[4:7] == [f"{e['tokens']:,}", f"{e['sequences']:,}", f"{e['documents']:,}"]
    t = totals
    assert lines[-1].startswith(
        f"total: {t['sources']} sources, {t['tokens']:,} tokens, {t['sequences']:,} sequences, "
        f"{t['documents']:,} documents in {t['shards']} shard{'' if t['shards'] == 1 else 's'}, "
    )
    assert lines[-1].endswith(
        "; blend "
        + (f"{inputs.first_blend} (data-path), added " if kind.startswith("appended") else "")
        + f"{inputs.blend} (data-path)"
    )


@every_kind
def test_extract_every_source(kind: str, inputs: Inputs, repacks, tmp_path: Path) -> None:
    out = repacks(kind)
    for number, name in enumerate(KINDS[kind].holds(inputs)):
        dest = tmp_path / f"x{number}"
        # named as the blend writes it, or by its absolute path: both are the same source
        result = ok("extract", "-q", out, inputs.path(name) if number % 2 else name, dest)
        assert result.stdout.startswith(f"wrote {dest}.bin (") and result.stdout.endswith(
            f" and {dest}.idx for {name}\n"
        )
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(inputs.path(name) + ext, f"{dest}{ext}", shallow=False), name


@every_kind
def test_add(kind: str, inputs: Inputs, repacks, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(repacks(kind), out)
    before = load_manifest(out)
    shard_bytes = {s.file: (out / s.file).read_bytes() for s in before.shards}
    result = ok("add", "-q", "--json", out, inputs.extra_blend)
    assert json.loads(result.stdout)["sources"] == 2
    after = load_manifest(out)
    assert [s.name for s in after.sources] == KINDS[kind].holds(inputs) + inputs.extra
    new_shards = after.shards[len(before.shards) :]
    assert new_shards and all(
        (s.codec == "zstd") == KINDS[kind].compressed for s in new_shards
    )  # stored like the shards before
    assert len({s.dtype_code for s in new_shards}) == 2  # a group of shards per dtype
    for name, data in shard_bytes.items():
        assert (out / name).read_bytes() == data, f"{name} was rewritten"
    n = len(after.sources)
    text = ok("verify", "-q", "--sources", out).stdout
    assert text.startswith("OK: ") and f"; {n} originals compared byte for byte" in text
    for number, prefix in enumerate(inputs.extra):
        dest = tmp_path / f"x{number}"
        ok("extract", "-q", out, prefix, dest)
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(prefix + ext, f"{dest}{ext}", shallow=False)
    info = json.loads(ok("inspect", "--json", out).stdout)
    assert info["totals"]["sources"] == n and info["totals"]["shards"] == len(after.shards)
    # nothing new: refused with one line, the repack unchanged
    again = cli("add", "-q", out, inputs.extra_blend)
    assert again.exit_code == 3 and again.stderr.startswith("Error: ")
    assert "already in" in again.stderr and len(again.stderr.splitlines()) == 1


@pytest.fixture(scope="module")
def stock_samples(inputs: Inputs, tmp_path_factory: pytest.TempPathFactory):
    """``stock_samples(prefixes)``: the samples of stock ``GPTDataset`` over those original
    prefixes (with their blend weights), built once per set of prefixes."""
    init_process_group(tmp_path_factory.mktemp("gloo"))
    built: dict[tuple[str, ...], list] = {}

    def get(prefixes: list[str]) -> list:
        key = tuple(prefixes)
        if key not in built:
            cache = tmp_path_factory.mktemp("stock-cache")
            config = gpt_config(prefixes, _weights(inputs, prefixes), cache=cache)
            built[key] = collect(build(GPTDataset, config, SIZES))
        return built[key]

    return get


def _weights(inputs: Inputs, prefixes: list[str]) -> list[float]:
    weight = dict(zip(inputs.names, inputs.weights))
    return [weight[os.path.relpath(p, inputs.root)] for p in prefixes]


@every_kind
@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_megatron_loader(
    kind: str, mmap: bool, inputs: Inputs, repacks, stock_samples, tmp_path: Path
) -> None:
    out = repacks(kind)
    held = {inputs.path(name) for name in KINDS[kind].holds(inputs)}
    prefixes = [p for p in inputs.loader if p in held]
    assert len(prefixes) > 1  # a blend, of the loader sources this kind holds
    config = gpt_config(prefixes, _weights(inputs, prefixes), cache=tmp_path, mmap=mmap)
    ours = collect(build(dataset_class(out), config, SIZES))
    assert all(len(split) >= size for split, size in zip(ours, SIZES, strict=True))
    assert_same_samples(stock_samples(prefixes), ours)
