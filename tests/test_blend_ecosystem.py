"""Blends as NeMo and Megatron-Bridge write them: the user's own file merges unchanged, and the
repack gives, bit for bit, the samples stock ``GPTDataset`` gives over the original prefixes
when the blend reaches Megatron-Core the way that tool hands it over.

Each tool's conversion of its blend is replicated here from its code, with Megatron-Core's own
``get_blend_from_list`` (the real function of the installed megatron-core):

* NeMo 2: ``PreTrainingDataModule.__init__``, ``nemo/collections/llm/gpt/data/pre_training.py``
  (NVIDIA/NeMo at 8cfedd7203462cb251a914e700e5605444277561).
* Megatron-Bridge: ``GPTDatasetConfig.finalize``, ``src/megatron/bridge/training/config.py``,
  and ``run_config.yaml`` as ``ConfigContainer`` writes it with ``yaml.safe_dump``
  (``src/megatron/bridge/models/config.py``) (NVIDIA-NeMo/Megatron-Bridge at
  067f987df03b8355b03192d88d70f1709fedf51a).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
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
from repack.format.blend import SPLITS
from repack.format.manifest import load_manifest
from repack.megatron import dataset_class

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.utils import get_blend_from_list


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


def nemo_build_kwargs(paths: Any, split: str = "900,50,50") -> dict[str, Any]:
    """The blend NeMo 2's ``PreTrainingDataModule(paths=paths)`` hands to Megatron-Core.

    Replicates ``PreTrainingDataModule.__init__`` (see the module docstring), line for line
    but for the asset check and the ``mmap_bin_files`` / object-storage arguments.
    """
    if not isinstance(paths, (list, tuple, dict)):
        paths = [paths]
    build_kwargs: dict[str, Any] = {}
    if isinstance(paths, dict):
        build_kwargs["blend_per_split"] = [
            get_blend_from_list(paths["train"]),
            get_blend_from_list(paths["validation"]),
            get_blend_from_list(paths["test"]),
        ]
    else:
        paths, weights = get_blend_from_list(paths)
        if len(paths) == 1:
            weights = None
        build_kwargs["blend"] = [paths, weights]
        build_kwargs["split"] = split
    return build_kwargs


def bridge_blend(dataset: dict[str, Any]) -> Any:
    """The ``blend`` Megatron-Bridge's ``GPTDatasetConfig.finalize`` leaves in a config."""
    blend = dataset.get("blend")
    if blend is None and dataset.get("data_path") is not None:
        data_path = dataset["data_path"]
        paths = data_path.split() if isinstance(data_path, str) else list(data_path)
        blend = get_blend_from_list(paths)
    return blend


def repack(*args: str | Path) -> Result:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def assert_recorded_as(out: Path, form: str, blend_per_split: list) -> None:
    """The manifest holds, split by split, the prefixes and weights Megatron-Core is given."""
    recorded = load_manifest(out).blend
    assert recorded.form == form
    for name, expected in zip(SPLITS, blend_per_split, strict=True):
        entries = recorded.splits[name]
        if expected is None:
            assert entries is None
            continue
        prefixes, weights = expected
        assert [os.path.abspath(p) for p in prefixes] == [e.path for e in entries]
        assert (None if weights is None else list(weights)) == (
            None if entries[0].weight is None else [e.weight for e in entries]
        )


def test_nemo_paths_dict_merges_and_loads_with_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NeMo 2 ``paths`` dict, relative prefixes as a run from the data folder writes them,
    weights as strings as NeMo's documentation writes them, no weights for validation (as NeMo
    advises)."""
    prefixes = [os.path.relpath(p, tmp_path) for p in write_sources(tmp_path, 14, seed=21)]
    weights = weights_for(prefixes, seed=21)

    def zipped(lo: int, hi: int) -> list[str]:
        return [x for i in range(lo, hi) for x in (str(weights[i]), prefixes[i])]

    paths = {"train": zipped(0, 8), "validation": prefixes[8:11], "test": zipped(11, 14)}
    blend_file = tmp_path / "nemo_paths.json"
    blend_file.write_text(json.dumps(paths, indent=2))
    monkeypatch.chdir(tmp_path)  # NeMo reads relative prefixes from its working directory

    result = repack("merge", "-q", blend_file, tmp_path / "out")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    build_kwargs = nemo_build_kwargs(paths)
    assert_recorded_as(out, "nemo-paths", build_kwargs["blend_per_split"])

    sizes = [900, 60, 60]
    config = dict(blend_per_split=build_kwargs["blend_per_split"], sequence_length=72)
    stock = collect(build(GPTDataset, gpt_config(**config, cache=tmp_path / "a"), sizes))
    ours = collect(build(dataset_class(out), gpt_config(**config, cache=tmp_path / "b"), sizes))
    assert_same_samples(stock, ours)
    assert all(len(split) > 0 for split in ours)
    # premise: NeMo's "validation" sources (ids 0-2 of the split's blend) feed Megatron's valid
    valid_ids = {int(s["dataset_id"]) for s in ours[1]}
    assert valid_ids == {0, 1, 2}


def test_nemo_flat_paths_in_a_config_merge_and_load_with_parity(tmp_path: Path) -> None:
    """NeMo 2's flat ``paths`` list inside a data-module config, as YAML."""
    prefixes = write_sources(tmp_path, 6, seed=22)
    weights = weights_for(prefixes, seed=22)
    paths = [x for w, p in zip(weights, prefixes) for x in (w, p)]
    target = "nemo.collections.llm.gpt.data.pre_training.PreTrainingDataModule"
    config = {"data": {"_target_": target, "paths": paths, "split": "90,5,5", "seed": 1234}}
    blend_file = tmp_path / "pretrain.yaml"
    blend_file.write_text(yaml.safe_dump(config, sort_keys=False))

    assert repack("merge", "-q", blend_file, tmp_path / "out").exit_code == 0
    build_kwargs = nemo_build_kwargs(config["data"]["paths"], config["data"]["split"])
    assert load_manifest(tmp_path / "out").blend.form == "data-path"

    prefixes, weights = build_kwargs["blend"]
    kwargs = dict(prefixes=prefixes, weights=weights, split=build_kwargs["split"])
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "a"), [700, 40, 40]))
    ours = collect(
        build(
            dataset_class(tmp_path / "out"),
            gpt_config(**kwargs, cache=tmp_path / "b"),
            [700, 40, 40],
        )
    )
    assert_same_samples(stock, ours)


@pytest.mark.parametrize("field", ["blend", "data_path"])
def test_bridge_run_config_merges_and_loads_with_parity(tmp_path: Path, field: str) -> None:
    """Megatron-Bridge's ``run_config.yaml``: the ``dataset`` section holds ``blend`` (and the
    ``data_path`` it was made from) or only a ``data_path`` string, next to sections named
    ``train`` and ``validation``."""
    prefixes = write_sources(tmp_path, 8, seed=23)
    weights = weights_for(prefixes, seed=23)
    zipped = [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    dataset: dict[str, Any] = {
        "_target_": "megatron.bridge.training.config.GPTDatasetConfig",
        "random_seed": 1234,
        "blend": [prefixes, weights] if field == "blend" else None,
        "blend_per_split": None,
        "split": "90,5,5",
        "data_path": zipped if field == "blend" else " ".join(zipped),
    }
    config = {
        "train": {"train_iters": 100, "global_batch_size": 8},
        "validation": {"eval_interval": 50, "eval_iters": 4},
        "dataset": dataset,
    }
    blend_file = tmp_path / "run_config.yaml"
    blend_file.write_text(yaml.safe_dump(config, default_flow_style=False, sort_keys=False))

    assert repack("merge", "-q", blend_file, tmp_path / "out").exit_code == 0
    loaded = yaml.safe_load(blend_file.read_text())["dataset"]
    blend = bridge_blend(loaded)
    recorded = load_manifest(tmp_path / "out").blend
    assert recorded.form == ("mcore-blend" if field == "blend" else "data-path")
    assert [e.path for e in recorded.splits["all"]] == list(blend[0])
    assert [e.weight for e in recorded.splits["all"]] == [float(w) for w in blend[1]]

    kwargs = dict(prefixes=blend[0], weights=blend[1], split=loaded["split"])
    sizes = [800, 40, 40]
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "a"), sizes))
    ours = collect(
        build(dataset_class(tmp_path / "out"), gpt_config(**kwargs, cache=tmp_path / "b"), sizes)
    )
    assert_same_samples(stock, ours)


def test_nemo_string_split_is_one_clear_error(tmp_path: Path) -> None:
    """NeMo would read a string split letter by letter; ``repack merge`` says so and writes
    nothing."""
    blend_file = tmp_path / "paths.json"
    blend_file.write_text(json.dumps({"train": ["a"], "validation": "data/v", "test": ["t"]}))
    result = repack("merge", blend_file, tmp_path / "out")
    assert result.exit_code != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"Error: {blend_file}: split 'validation' is \"data/v\", a string")
    assert not (tmp_path / "out").exists()
