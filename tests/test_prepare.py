"""``repack prepare``: after it, the job's own build (``BlendedMegatronDatasetBuilder`` with the
repacked class, the same config) writes no cache file and reads the same samples as a job that
built for itself; the files prepare writes are those the job writes. Real megatron-core, no
mocks."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from megatron_support import (
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    weights_for,
    write_flat_blend,
    write_sources,
)
from readme_support import DEMO, readme_blocks, shell

from repack.cli import main
from repack.megatron import dataset_class
from repack.merge import merge

pytestmark = pytest.mark.megatron

#: The run: 10 iterations of 8 samples, an evaluation of 2 iterations every 5.
TRAIN_ITERS, GBS, EVAL_INTERVAL, EVAL_ITERS, SEQ, SPLIT, SEED = 10, 8, 5, 2, 64, "90,5,5", 4321
#: Megatron-LM's get_train_valid_test_num_samples for it.
SIZES = [
    TRAIN_ITERS * GBS,
    (TRAIN_ITERS // EVAL_INTERVAL + 1) * EVAL_ITERS * GBS,
    EVAL_ITERS * GBS,
]
#: tests/megatron_support.py's Tok's identifiers, as the job's tokenizer gives them.
TOKENIZER = json.dumps({"class": "Tok", "vocab_size": 65000})


@pytest.fixture(scope="module")
def repack_dir(tmp_path_factory) -> tuple[Path, list[str], list[float]]:
    root = tmp_path_factory.mktemp("prepare")
    prefixes = write_sources(root, 9, sequences=(30, 50), tokens=(20, 120))
    weights = weights_for(prefixes, seed=3)
    merge(write_flat_blend(root / "blend.json", prefixes, weights), root / "out")
    init_process_group()
    return root / "out", prefixes, weights


def _prepare(repack: Path | str, cache: Path, *extra: str):
    return CliRunner().invoke(main, _prepare_args(repack, cache, *extra))


def _prepare_args(repack: Path | str, cache: Path, *extra: str) -> list[str]:
    return [
        "prepare",
        os.fspath(repack),
        "--seq-length",
        str(SEQ),
        "--split",
        SPLIT,
        "--seed",
        str(SEED),
        "--train-iters",
        str(TRAIN_ITERS),
        "--global-batch-size",
        str(GBS),
        "--eval-interval",
        str(EVAL_INTERVAL),
        "--eval-iters",
        str(EVAL_ITERS),
        "--data-cache-path",
        os.fspath(cache),
        "--tokenizer-identifiers",
        TOKENIZER,
        "-q",
        *extra,
    ]


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def _job(repack: Path | str, prefixes, weights, cache: Path):
    """The job's own build and every sample of every split."""
    config = gpt_config(prefixes, weights, seed=SEED, sequence_length=SEQ, split=SPLIT, cache=cache)
    return collect(build(dataset_class(os.fspath(repack)), config, SIZES))


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_job_writes_nothing_after_prepare(repack_dir, tmp_path, workers):
    repack, prefixes, weights = repack_dir
    prepared = tmp_path / "prepared"
    result = _prepare(repack, prepared, "--workers", str(workers), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["datasets"] == 3 * len(prefixes)
    assert report["split_samples"] == SIZES
    assert report["files"] == sorted(os.listdir(prepared))
    assert report["bytes"] == sum(p.stat().st_size for p in prepared.iterdir())
    before = _listing(prepared)
    assert sum(n.endswith("-description.txt") for n in before) == 3  # a blend per split

    samples = _job(repack, prefixes, weights, prepared)
    assert _listing(prepared) == before  # the job built nothing, wrote nothing

    fresh = tmp_path / "fresh"
    assert_same_samples(_job(repack, prefixes, weights, fresh), samples)
    if workers == 1:  # the job's own files, byte for byte (workers pack in a pack each)
        assert sorted(os.listdir(fresh)) == sorted(before)
        for name in before:
            assert (fresh / name).read_bytes() == (prepared / name).read_bytes(), name
    else:
        ours = {n for n in before if not n.startswith("pack-")}
        assert ours < set(os.listdir(fresh))
        for name in ours - {"repack-index-cache.json", "repack-index-cache.lock"}:
            assert (fresh / name).read_bytes() == (prepared / name).read_bytes(), name


def test_second_prepare_builds_nothing(repack_dir, tmp_path):
    repack, _, _ = repack_dir
    assert _prepare(repack, tmp_path / "c").exit_code == 0
    before = _listing(tmp_path / "c")
    again = _prepare(repack, tmp_path / "c")
    assert again.exit_code == 0, again.output
    assert again.output.startswith(f"nothing to build: {len(before)} files already there")
    assert _listing(tmp_path / "c") == before


def test_prepare_refuses_a_blend_file(repack_dir, tmp_path):
    repack, _, _ = repack_dir
    result = _prepare(repack.parent / "blend.json", tmp_path / "c")
    assert result.exit_code == 3
    assert "blend.json: not a repack" in result.output
    assert "Traceback" not in result.output


@pytest.mark.once
@pytest.mark.slow
def test_readme_prepare_examples_run(tmp_path):
    """README's `repack prepare` examples, after its demo, print what it shows (the seconds
    and bytes aside: the catalog records the sources' paths, longer here)."""
    sh = shell(tmp_path, options="-eo pipefail", timeout=600)
    setup = sh(DEMO)
    assert setup.returncode == 0, setup.stderr
    outputs: list[str] = []
    for lang, lines in readme_blocks("prepare"):
        if lang == "text":
            assert [_untimed(line) for line in lines] == [_untimed(out) for out in outputs]
            continue
        for line in lines:
            done = sh(line)
            assert done.returncode == 0, (line, done.stderr)
            outputs.append(done.stdout.strip())
    assert len(outputs) == 2


def _untimed(line: str) -> str:
    return re.sub(r"[0-9.]+ KiB in [0-9.]+ s$", "… KiB in … s", line)


def test_a_job_with_another_tokenizer_builds_its_own(repack_dir, tmp_path):
    """The tokenizer's identifiers are in every cache name: prepared with repack's placeholder,
    the job (another tokenizer) finds nothing and builds."""
    repack, prefixes, weights = repack_dir
    prepared = tmp_path / "prepared"
    args = [a for a in _prepare_args(repack, prepared) if a not in ("--tokenizer-identifiers",)]
    args.remove(TOKENIZER)
    assert CliRunner().invoke(main, args).exit_code == 0
    before = _listing(prepared)
    _job(repack, prefixes, weights, prepared)
    assert set(_listing(prepared)) > set(before)


def test_prepare_takes_the_tokenizer_of_an_earlier_job(repack_dir, tmp_path):
    """Without --tokenizer-identifiers, those an earlier job recorded in the cache folder (in
    its blends' descriptions) name the files: the next run (another seed) then builds nothing."""
    repack, prefixes, weights = repack_dir
    cache = tmp_path / "cache"
    _job(repack, prefixes, weights, cache)  # an earlier run, seed SEED
    args = _prepare_args(repack, cache, "--json")
    args.remove("--tokenizer-identifiers")
    args.remove(TOKENIZER)
    args[args.index("--seed") + 1] = str(SEED + 1)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["notes"] == []
    before = _listing(cache)
    config = gpt_config(prefixes, weights, seed=SEED + 1, sequence_length=SEQ, split=SPLIT)
    config.path_to_cache = os.fspath(cache)
    collect(build(dataset_class(os.fspath(repack)), config, SIZES))
    assert _listing(cache) == before


@pytest.mark.slow
def test_prepare_a_bucket_repack(s3, repack_dir, tmp_path, monkeypatch):
    """A repack on S3: prepared into a shared --data-cache-path, the job's build (its node-local
    cache elsewhere) writes nothing there and reads a fresh job's samples."""
    _, prefixes, weights = repack_dir
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    url = f"s3://{s3.new_bucket()}/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url, shard_size=8192)
    prepared = tmp_path / "prepared"
    args = _prepare_args(url, prepared, "--workers", "2")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("built the indices of 27 datasets into ")
    before = _listing(prepared)
    samples = _job(url, prefixes, weights, prepared)
    assert _listing(prepared) == before
    assert_same_samples(_job(url, prefixes, weights, tmp_path / "fresh"), samples)


def test_doctor_warns_of_a_cache_prepared_for_other_settings(repack_dir, tmp_path):
    repack, _, _ = repack_dir
    cache = tmp_path / "cache"
    assert _prepare(repack, cache).exit_code == 0  # seed SEED

    def doctor(seed: int) -> list[dict]:
        args = ["doctor", os.fspath(repack), "--seq-length", str(SEQ), "--split", SPLIT]
        args += ["--train-iters", str(TRAIN_ITERS), "--global-batch-size", str(GBS)]
        args += ["--data-cache-path", os.fspath(cache), "--seed", str(seed), "--json", "-q"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code in (0, 1), result.output
        return [p for p in json.loads(result.output)["problems"] if p["code"] == "prepared-cache"]

    assert doctor(SEED) == []
    (found,) = doctor(SEED + 1)
    assert found["level"] == "warning"
    assert f"seed {SEED}, seq-length {SEQ}, split '{SPLIT}'" in found["message"]
    assert "run repack prepare with the job's settings" in found["message"]


@pytest.mark.once
def test_prepare_reads_the_settings_from_a_checkpoint(repack_dir, tmp_path):
    """--checkpoint: the run's saved arguments (its blend and --data-cache-path included) are
    the settings; the job then writes nothing."""
    import argparse

    torch = pytest.importorskip("torch")
    repack, prefixes, weights = repack_dir
    cache = tmp_path / "cache"
    data_path = [str(x) for pair in zip(weights, prefixes) for x in pair]
    args = {
        "seq_length": SEQ,
        "split": SPLIT,
        "seed": SEED,
        "global_batch_size": GBS,
        "micro_batch_size": 2,
        "data_parallel_size": 2,
        "train_iters": TRAIN_ITERS,
        "eval_interval": EVAL_INTERVAL,
        "eval_iters": EVAL_ITERS,
        "mid_level_dataset_surplus": 0.005,
        "data_path": data_path,
        "data_cache_path": os.fspath(cache),
    }
    folder = tmp_path / "ckpt" / "iter_0000010" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(**args), "iteration": 10}, folder / "model_optim_rng.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")
    checkpoint = ["--checkpoint", os.fspath(tmp_path / "ckpt")]
    asked = ["prepare", os.fspath(repack), *checkpoint, "-q", "--json"]
    result = CliRunner().invoke(main, [*asked, "--tokenizer-identifiers", TOKENIZER])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["split_samples"] == SIZES
    before = _listing(cache)
    _job(repack, prefixes, weights, cache)
    assert _listing(cache) == before


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_prepare_a_per_split_blend(repack_dir, tmp_path, workers):
    """A repack of a per-split blend: --split is ignored, as Megatron ignores it (the
    descriptions say split None); the job then writes nothing."""
    _, prefixes, weights = repack_dir
    per_split = {
        "train": [x for pair in zip(weights[:6], prefixes[:6]) for x in pair],
        "valid": prefixes[6:8],
        "test": [1.0, prefixes[8]],
    }
    (tmp_path / "per_split.json").write_text(json.dumps(per_split))
    merge(tmp_path / "per_split.json", tmp_path / "out")
    cache = tmp_path / "cache"
    result = _prepare(tmp_path / "out", cache, "--workers", workers)
    assert result.exit_code == 0, result.output
    before = _listing(cache)
    blend_per_split = [
        (prefixes[:6], weights[:6]),
        (prefixes[6:8], None),
        ([prefixes[8]], [1.0]),
    ]
    config = gpt_config(blend_per_split=blend_per_split, seed=SEED, sequence_length=SEQ)
    config.path_to_cache = os.fspath(cache)
    samples = collect(build(dataset_class(os.fspath(tmp_path / "out")), config, SIZES))
    assert _listing(cache) == before
    config.path_to_cache = os.fspath(tmp_path / "fresh")
    fresh = collect(build(dataset_class(os.fspath(tmp_path / "out")), config, SIZES))
    assert_same_samples(fresh, samples)


def test_prepare_without_megatron_says_so(repack_dir, tmp_path):
    """Where megatron-core cannot be imported: one Error line, exit 3, no traceback."""
    import subprocess
    import sys

    repack, _, _ = repack_dir
    code = (
        "import sys\n"
        "sys.modules['torch'] = sys.modules['megatron'] = None\n"
        "from repack.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    args = _prepare_args(repack, tmp_path / "c")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("Error: repack prepare builds the job's indices with ")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "c").exists()
