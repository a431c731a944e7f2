"""``repack doctor`` finds duplicate data: from a repack's fingerprints (no token read) and,
with ``--duplicates``, from a plain blend's tokens; both give the same report.

The blend made here holds, next to two ordinary sources ``a`` and ``b``:

* ``copy``: a byte-identical copy of ``a`` under another path (``identical-sources``);
* ``eight``: 40 documents, each present 8 times (``repeated-documents``; 280 of its 320
  documents are repeats, and a document of it drawn for e epochs is seen 8e times);
* ``half``: 60 documents of which 30 are documents of ``b`` (``shared-documents``);
* ``held``, the valid split of the per-split blend: 25 documents of which 5 are in ``a``
  (``split-overlap``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.doctor.duplicates import _RECORD
from repack.merge import merge

CODES = {"identical-sources", "repeated-documents", "shared-documents", "split-overlap"}


def documents(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    return [rng.integers(0, 50000, rng.integers(5, 60)) for _ in range(count)]


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from repack.synth import write_prefix

    root = tmp_path_factory.mktemp("dups")
    rng = np.random.default_rng(19)
    a, b = documents(rng, 50), documents(rng, 70)
    unique8 = documents(rng, 40)
    eight = [unique8[k] for k in rng.permutation(np.repeat(np.arange(40), 8))]
    half = [b[k] for k in rng.choice(70, 30, replace=False)] + documents(rng, 30)
    held = [a[k] for k in (1, 7, 11, 20, 42)] + documents(rng, 20)
    for name, docs in (("a", a), ("b", b), ("eight", eight), ("half", half), ("held", held)):
        write_prefix(root / "data" / name, docs, dtype=np.uint16)
    (root / "copies").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(root / "data" / f"a{ext}", root / "copies" / f"a{ext}")
    train = ["data/a", "data/b", "copies/a", "data/eight", "data/half"]
    per_split = {
        "train": [x for p in train for x in (1.0, p)],
        "valid": [1.0, "data/held"],
        "test": None,
    }
    (root / "per_split.json").write_text(json.dumps(per_split))
    (root / "flat.json").write_text(json.dumps([x for p in train for x in (1.0, p)]))
    for name in ("per_split", "flat"):
        merge(root / f"{name}.json", root / f"{name}-repack", shard_size=1 << 16)
    return {
        "per_split": root / "per_split.json",
        "flat": root / "flat.json",
        "per_split_repack": root / "per_split-repack",
        "flat_repack": root / "flat-repack",
    }


def doctor_json(target: Path, *options: str) -> dict:
    args = ["doctor", "-q", "--json", str(target), "--seq-length", "16", *options]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


def found(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for problem in report["problems"]:
        if problem["code"] in CODES:
            out.setdefault(problem["code"], []).append(problem)
    return out


def by_source(report: dict) -> dict[str, dict]:
    return {row["prefix"]: row["duplicates"] for row in report["sources"]}


def check_per_split(report: dict) -> None:
    problems = found(report)
    assert set(problems) == CODES, report["problems"]
    [identical] = problems["identical-sources"]
    assert identical["source"] == "copies/a" and "data/a" in identical["message"]
    [repeated] = problems["repeated-documents"]
    assert repeated["source"] == "data/eight"
    assert "280 of its 320 documents" in repeated["message"]
    assert "there 8 times" in repeated["message"]
    [shared] = problems["shared-documents"]
    assert shared["source"] == "data/half"
    assert "30 of its 60 documents (50.0%" in shared["message"] and "data/b" in shared["message"]
    [overlap] = problems["split-overlap"]
    assert (overlap["source"], overlap["split"]) == ("data/held", "valid")
    assert "5 of its 25 valid documents" in overlap["message"]
    assert "data/a" in overlap["message"]
    rows = by_source(report)
    assert rows["data/eight"]["repeated_documents"] == 280
    assert rows["data/eight"]["max_copies"] == 8
    assert rows["copies/a"]["identical_to"] == "data/a"
    assert rows["data/half"]["shared_documents"] == 30
    assert rows["data/held"]["split_overlap"]["valid"]["documents"] == 5
    assert rows["data/b"]["repeated_documents"] == 0 and rows["data/b"]["max_copies"] == 1
    # the effective repetition: a document of `eight` is seen 8 times its epochs
    epochs = next(r for r in report["sources"] if r["prefix"] == "data/eight")["splits"]
    drawn = epochs["train"]["epochs"]
    assert rows["data/eight"]["effective_epochs"]["train"] == pytest.approx(8 * drawn)
    repetition = [
        p for p in report["problems"] if p["code"] == "repetition" and p["source"] == "data/eight"
    ]
    assert len(repetition) == 1 and "most-seen document is seen" in repetition[0]["message"]
    # unique tokens: `copy` adds none, `eight` adds an eighth of its tokens, `half` a half
    summary = report["duplicates"]
    assert summary["available"]
    tokens = {r["prefix"]: r["tokens"] for r in report["sources"]}
    unique = summary["splits"]["train"]["unique_tokens"]
    drawn_tokens = summary["splits"]["train"]["tokens"]
    assert drawn_tokens == sum(tokens[p] for p in tokens if p != "data/held")
    assert unique < drawn_tokens - tokens["copies/a"]


SAMPLES = ["--samples", "20000,200,0"]


def test_doctor_on_a_repack_names_each_duplicate(blend) -> None:
    report = doctor_json(blend["per_split_repack"], *SAMPLES)
    assert report["duplicates"]["origin"] == "fingerprints"
    check_per_split(report)


def test_doctor_on_the_plain_blend_with_duplicates_says_the_same(blend) -> None:
    from_repack = doctor_json(blend["per_split_repack"], *SAMPLES)
    from_tokens = doctor_json(blend["per_split"], "--duplicates", *SAMPLES)
    assert from_tokens["duplicates"]["origin"] == "tokens"
    check_per_split(from_tokens)
    same = ("problems", "sources")
    for member in same:
        assert from_tokens[member] == from_repack[member], member
    a, b = dict(from_tokens["duplicates"]), dict(from_repack["duplicates"])
    assert a.pop("origin") == "tokens" and b.pop("origin") == "fingerprints"
    assert a == b


def test_partitioned_analysis_gives_the_same_report(blend) -> None:
    whole = doctor_json(blend["per_split_repack"], *SAMPLES)
    parts = doctor_json(blend["per_split_repack"], "--duplicates-memory", "4KiB", *SAMPLES)
    assert parts["duplicates"]["partitions"] > 8  # premise: really partitioned
    assert whole["duplicates"]["partitions"] == 1
    for report in (whole, parts):
        del report["duplicates"]["partitions"]
    assert parts == whole


def test_split_slices_overlap_when_a_source_repeats(blend) -> None:
    # --split 90,10,0: `eight`'s valid slice holds documents of its train slice; `b`'s valid
    # slice (its last 7 documents) holds some of the 30 that `half` copied, in half's train
    # slice; `a` and its copy have the same valid slice, which neither trains on
    report = doctor_json(blend["flat_repack"], "--split", "90,10,0", "--samples", "2000,100,0")
    overlaps = {p["source"]: p for p in found(report)["split-overlap"]}
    assert set(overlaps) == {"data/b", "data/eight"}, report["problems"]
    assert all(p["split"] == "valid" for p in overlaps.values())
    assert "(e.g. in data/half)" in overlaps["data/b"]["message"]
    rows = by_source(report)
    assert rows["data/a"]["split_overlap"] == rows["copies/a"]["split_overlap"] == {}
    assert rows["data/half"]["split_overlap"] == {}
    # the blend's own split: `eight` holds 320 documents, 32 in valid, each also in train
    # unless all 8 copies fell in valid (none of the 40 here)
    assert rows["data/eight"]["split_overlap"]["valid"]["documents"] == 32
    same = doctor_json(
        blend["flat"], "--duplicates", "--split", "90,10,0", "--samples", "2000,100,0"
    )
    assert same["problems"] == report["problems"]


def test_thresholds_are_options(blend) -> None:
    report = doctor_json(
        blend["per_split_repack"],
        "--max-repeated-share",
        "0.9",
        "--max-shared-share",
        "0.6",
        "--max-split-overlap",
        "0.5",
        *SAMPLES,
    )
    assert set(found(report)) == {"identical-sources"}
    text = CliRunner().invoke(
        main, ["doctor", "-q", str(blend["per_split_repack"]), "--seq-length", "16", *SAMPLES]
    )
    assert "WARNING [identical-sources] copies/a: a byte-identical copy of data/a" in text.stdout
    assert "Duplicates (exact, from fingerprints): 280 of" in text.stdout


def test_a_blend_without_duplicates_asks_for_them(blend) -> None:
    report = doctor_json(blend["per_split"], *SAMPLES)
    assert report["duplicates"]["available"] is False
    assert "--duplicates" in report["duplicates"]["reason"]
    assert not found(report)


def test_a_repack_without_fingerprints_says_so_and_reads_tokens_if_asked(
    blend, tmp_path: Path
) -> None:
    out = tmp_path / "old"
    merge(blend["per_split"], out, fingerprints=False)
    report = doctor_json(out, *SAMPLES)
    assert report["duplicates"]["available"] is False
    assert report["duplicates"]["reason"].startswith("no fingerprints")
    assert not found(report)
    read = doctor_json(out, "--duplicates", *SAMPLES)
    assert read["duplicates"]["origin"] == "tokens"
    check_per_split(read)


def test_an_ordinary_blend_has_no_duplicates(demo_blend, demo_repack: Path) -> None:
    # the demo generator draws every document at random: no two are alike (its empty
    # document is left out, as every empty document is)
    report = doctor_json(demo_repack, "--split", "90,10,0", "--samples", "20000,200,0")
    assert report["duplicates"]["available"]
    assert report["duplicates"]["repeated_documents"] == 0
    assert report["duplicates"]["source_pairs_sharing"] == 0
    assert not found(report), found(report)
    assert any(row["duplicates"]["empty_documents"] for row in report["sources"])


def test_the_fast_path_for_documents_found_once_counts_as_the_grouping(blend) -> None:
    """partition() sends documents found once through a shortcut (and a few of them, by a
    table collision, through the grouping): the figures are those of grouping everything."""
    from repack.doctor.duplicates import SPLIT_BITS, _Accumulator
    from repack.fingerprints import load_fingerprints
    from repack.reader import Repack

    repack = Repack(blend["per_split_repack"])
    found_fp = load_fingerprints(blend["per_split_repack"], repack.manifest)
    rng = np.random.default_rng(3)
    chunks = []
    for source in repack.manifest.sources:
        lengths, _, docs, _ = repack.source_arrays(source)
        ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])[docs]
        records = np.zeros(len(docs) - 1, _RECORD)
        records["key"] = found_fp.of(source.id)
        records["tokens"] = np.diff(ends)
        records["source"] = source.id
        records["mask"] = rng.choice([SPLIT_BITS["train"], 2, 3, 4], len(records))
        chunks.append(records)
    records = np.concatenate(chunks)
    epochs = rng.random((len(repack.manifest.sources), 3))
    fast, slow = _Accumulator(len(chunks)), _Accumulator(len(chunks))
    fast.epochs = slow.epochs = epochs
    fast.partition(records)
    slow._groups(records)
    for name in ("repeated_documents", "repeated_tokens", "max_copies", "shared_documents",
                 "shared_tokens", "effective", "overlap"):  # fmt: skip
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.pairs == slow.pairs and fast.unique_tokens == slow.unique_tokens
    assert fast.partner() == slow.partner()
