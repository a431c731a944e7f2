"""repack.samples: GPTSamples against megatron-core's own builder, its samplers against
Megatron-LM's ``data_samplers.py``, and the reader in a process without torch or Megatron.

Every sample of every case (a few thousand in all) is compared with what
``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` of the installed release builds from the
same prefixes: same keys, dtypes and values, and the same documents
(``_query_document_sample_shuffle_indices``). CI reruns this file on every release of the
parity matrix; ``GPTSamples`` is given that release's arithmetic.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_support import (
    GPTDataset,
    GPTDatasetConfig,
    Tok,
    build,
    gpt_config,
    init_process_group,
    megatron_samplers,
    weights_for,
    write_flat_blend,
    write_sources,
)

from repack.errors import InputError, UndrawableSplit
from repack.megatron import MEGATRON_VERSION
from repack.merge import merge
from repack.releases import release_of
from repack.samples import GPTSamples, TorchSamples, micro_batches, randperm
from repack.synth import write_prefix

pytestmark = pytest.mark.megatron

RELEASE = release_of(MEGATRON_VERSION)
ROOT = Path(__file__).resolve().parent.parent
SPLITS = ("train", "valid", "test")


class PadTok(Tok):
    """A tokenizer with a pad id, which ``GPTDataset`` then uses instead of -1."""

    def __init__(self, eod: int, pad: int) -> None:
        super().__init__(vocab_size=64)
        self.eod = eod
        self.pad = pad
        self.unique_identifiers = {"class": "PadTok", "eod": eod, "pad": pad}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Sources of the usual sizes, sources with few tokens (many epochs), sources of a small
    vocabulary full of EOD and pad ids, and a repack of all of them."""
    root = tmp_path_factory.mktemp("samples")
    prefixes = write_sources(root, 6, sequences=(20, 40), tokens=(5, 100))
    small = write_sources(root, 3, seed=5, sequences=(20, 24), tokens=(2, 12), folder="small")
    rng = np.random.default_rng(9)
    eods = []
    for i in range(3):
        prefix = str(root / "eod" / f"e-{i}")
        seqs = [rng.integers(0, 12, int(rng.integers(3, 60))) for _ in range(30)]
        write_prefix(prefix, seqs, dtype=np.uint16)
        eods.append(prefix)
    everything = prefixes + small + eods
    merge(write_flat_blend(root / "all.json", everything), str(root / "all.repack"))
    init_process_group()
    return {"root": root, "web": prefixes, "small": small, "eod": eods}


def _stock(config: GPTDatasetConfig, sizes) -> list:
    """Stock's splits, its index cache in a new folder: Megatron's default cache (beside the
    prefix) is keyed without ``add_extra_token_to_sequence``, so another case's indices would
    be loaded."""
    import tempfile

    config.path_to_cache = tempfile.mkdtemp(prefix="repack-samples-stock-")
    atexit.register(shutil.rmtree, config.path_to_cache, ignore_errors=True)
    return build(GPTDataset, config, sizes)


def _check_split(stock, ours: GPTSamples, *, documents: bool = True) -> int:
    """Every sample of one split equal; returns how many."""
    assert len(ours) == len(stock)
    blended = hasattr(stock, "dataset_index")
    for i in range(len(stock)):
        want, got = stock[i], ours[i]
        assert list(got) == list(want), f"sample {i}: keys {list(got)}"
        for key, value in want.items():
            value = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            assert got[key].dtype == value.dtype, f"sample {i} {key}: dtype {got[key].dtype}"
            assert np.array_equal(got[key], value), f"sample {i} {key} differs"
        if documents:
            dataset, sample = stock, i
            if blended:
                dataset = stock.datasets[int(stock.dataset_index[i])]
                sample = int(stock.dataset_sample_index[i])
            found = dataset._query_document_sample_shuffle_indices(sample)[1]
            assert ours.origin(i).documents == tuple(found.tolist()), f"sample {i}: documents"
    return len(stock)


def _compare(config: GPTDatasetConfig, sizes, repack, *, eod: int = 0, pad: int = -1, **given):
    """Build stock's splits from ``config`` and compare each with GPTSamples (made first: a
    split that stock would hang on fails here with UndrawableSplit)."""
    fields = dict(
        random_seed=config.random_seed,
        sequence_length=config.sequence_length,
        split=config.split,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
        add_extra_token_to_sequence=config.add_extra_token_to_sequence,
        drop_last_partial_validation_sequence=config.drop_last_partial_validation_sequence,
        release=RELEASE,
    )
    if config.blend_per_split is not None:
        fields["blend_per_split"] = config.blend_per_split
    elif "blend" not in given:
        fields["blend"] = config.blend
    fields.update(given)
    ours = {}
    for which in SPLITS:
        try:
            ours[which] = GPTSamples(repack, sizes=sizes, which=which, eod=eod, pad=pad, **fields)
        except UndrawableSplit:
            raise
        except InputError:
            ours[which] = None
    stock = _stock(config, sizes)
    compared = 0
    for which, split in zip(SPLITS, stock):
        assert (split is None) == (ours[which] is None), which
        if split is not None:
            compared += _check_split(split, ours[which])
    assert compared > 0
    return compared


@pytest.mark.parametrize("where", ["repack", "prefixes"])
@pytest.mark.parametrize("extra", [True, False], ids=["extra-token", "no-extra-token"])
def test_flat_blend_gives_the_stock_samples(data, where, extra):
    prefixes = data["web"]
    config = gpt_config(prefixes, weights_for(prefixes), sequence_length=32, seed=11)
    config.add_extra_token_to_sequence = extra
    repack = str(data["root"] / "all.repack") if where == "repack" else None
    assert _compare(config, [1200, 120, 40], repack) > 1300


def test_recorded_blend_of_a_repack_is_read_without_a_blend(data, tmp_path):
    prefixes = data["web"][:4]
    weights = weights_for(prefixes, seed=2)
    merge(write_flat_blend(tmp_path / "b.json", prefixes, weights), str(tmp_path / "b.repack"))
    config = gpt_config(prefixes, weights, sequence_length=24, split="80,15,5")
    stock = _stock(config, [300, 60, 20])
    for which, split in zip(SPLITS, stock):
        ours = GPTSamples(
            tmp_path / "b.repack",
            sizes=[300, 60, 20],
            which=which,
            split="80,15,5",
            random_seed=1234,
            sequence_length=24,
            eod=0,
            release=RELEASE,
        )
        _check_split(split, ours)


def test_per_split_blend_lone_and_unweighted_datasets(data):
    web = data["web"]
    per_split = [
        (web[:4], weights_for(web[:4], seed=4)),  # weighted
        ([web[2], web[4]], None),  # unweighted: BlendedDataset weighs by length
        ([web[5]], None),  # one prefix: a GPTDataset, no BlendedDataset
    ]
    config = gpt_config(blend_per_split=per_split, sequence_length=40)
    assert _compare(config, [800, 100, 50], str(data["root"] / "all.repack")) > 900


def test_many_epochs(data):
    """Sources of few tokens drawn many times: several epochs, the last one apart or not."""
    small = data["small"]
    config = gpt_config(small, [1.0, 2.0, 3.0], sequence_length=16, split="80,10,10")
    assert _compare(config, [2000, 100, 30], str(data["root"] / "all.repack")) > 2000


@pytest.mark.parametrize("extra", [True, False], ids=["extra-token", "no-extra-token"])
def test_resets_and_eod_loss_mask_with_a_pad_id(data, extra):
    """EOD and pad ids all through the data: position and attention resets, EOD loss masking,
    pad ids masked and zeroed; validation keeps its last partial sample (padded)."""
    eods = data["eod"]
    config = gpt_config(eods, [1.0, 1.0, 2.0], sequence_length=20, split="70,20,10")
    config.tokenizer = PadTok(eod=3, pad=7)
    config.reset_position_ids = True
    config.reset_attention_mask = True
    config.eod_mask_loss = True
    config.add_extra_token_to_sequence = extra
    config.drop_last_partial_validation_sequence = False
    assert _compare(config, [400, 60, 20], None, eod=3, pad=7) > 450


@pytest.mark.parametrize(
    "resets", [(True, False, False), (False, True, False), (False, False, True)]
)
def test_each_reset_alone(data, resets):
    eods = data["eod"]
    config = gpt_config(eods, None, sequence_length=16, split="90,5,5")
    config.tokenizer = PadTok(eod=3, pad=-1)
    config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss = resets
    repack = str(data["root"] / "all.repack")
    assert _compare(config, [200, 20, 10], repack, eod=3) > 150


@pytest.mark.parametrize("extra", [True, False], ids=["extra-token", "no-extra-token"])
def test_inter_document_masking(data, extra):
    """megatron-core 0.19's cu_seqlens samples: positions per document, the padded last
    validation sample folded into its last document."""
    import dataclasses

    if "inter_document_masking" not in {f.name for f in dataclasses.fields(GPTDatasetConfig)}:
        pytest.skip(f"megatron-core {MEGATRON_VERSION} has no inter_document_masking (0.19+)")
    config = gpt_config(
        data["eod"] + data["small"], [1.0] * 6, sequence_length=24, split="70,20,10"
    )
    config.tokenizer = PadTok(eod=3, pad=-1)
    config.inter_document_masking = True
    config.add_extra_token_to_sequence = extra
    config.drop_last_partial_validation_sequence = False
    repack = str(data["root"] / "all.repack")
    assert _compare(config, [300, 60, 20], repack, eod=3, inter_document_masking=True) > 300
    # one prefix per split: every sample of its GPTDataset, the padded last one included
    lone = [([data["eod"][0]], None), ([data["eod"][1]], None), ([data["small"][0]], None)]
    config = gpt_config(blend_per_split=lone, sequence_length=24)
    config.tokenizer = PadTok(eod=3, pad=-1)
    config.inter_document_masking = True
    config.add_extra_token_to_sequence = extra
    config.drop_last_partial_validation_sequence = False
    assert _compare(config, [50, 30, 10], repack, eod=3, inter_document_masking=True) >= 90


def test_repack_on_s3(data, s3, tmp_path, monkeypatch):
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    prefixes = data["web"]
    weights = weights_for(prefixes, seed=6)
    url = f"s3://{s3.new_bucket()}/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url, shard_size=8192)
    config = gpt_config(prefixes, weights, sequence_length=32, seed=5)
    assert _compare(config, [600, 60, 20], url) > 600


def test_bad_settings_say_why(data):
    repack = str(data["root"] / "all.repack")
    common = dict(random_seed=1, sequence_length=8, eod=0, blend=(data["web"], None))
    with pytest.raises(InputError, match="needs split"):
        GPTSamples(repack, sizes=[10, 0, 0], **common)
    with pytest.raises(InputError, match="which='training'"):
        GPTSamples(repack, sizes=[10, 0, 0], which="training", split="1,0,0", **common)
    with pytest.raises(InputError, match="2 weights for 6 prefixes"):
        GPTSamples(
            repack, sizes=[1, 0, 0], split="1,0,0", **{**common, "blend": (data["web"], [1, 2])}
        )
    with pytest.raises(InputError, match="gives valid nothing"):
        GPTSamples(repack, sizes=[10, 5, 0], which="valid", split="1,0,0", **common)
    with pytest.raises(InputError, match=r"0\.12"):
        GPTSamples(
            repack,
            sizes=[10, 0, 0],
            split="1,0,0",
            release="0.12",
            mid_level_dataset_surplus=0.01,
            **common,
        )
    with pytest.raises(UndrawableSplit, match="no tokens"):
        weighted = {**common, "blend": (data["web"], [1.0] * 6)}
        GPTSamples(repack, sizes=[10, 10, 0], which="valid", split="999,1,0", **weighted)
    with pytest.raises(UndrawableSplit, match="without weights"):
        GPTSamples(repack, sizes=[10, 10, 0], which="valid", split="999,1,0", **common)
    samples = GPTSamples(repack, sizes=[10, 0, 0], split="1,0,0", **common)
    with pytest.raises(IndexError):
        samples[len(samples)]


# --- the samplers --------------------------------------------------------------------------


def test_randperm_is_torchs():
    for n in (0, 1, 2, 7, 100, 4099):
        for seed in (0, 1, 3, 12345):
            g = torch.Generator()
            g.manual_seed(seed)
            assert np.array_equal(randperm(n, seed), torch.randperm(n, generator=g).numpy())


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("mbs", [1, 2, 3, 4])
def test_samplers_are_megatron_lms(dp, mbs):
    samplers = megatron_samplers(required=True)
    total = 203
    unit = mbs * dp
    for consumed in (0, unit * 3):
        for rank in range(dp):
            single = samplers.MegatronPretrainingSampler(total, consumed, mbs, rank, dp)
            ours = list(
                micro_batches(
                    "single",
                    total,
                    micro_batch_size=mbs,
                    data_parallel_rank=rank,
                    data_parallel_size=dp,
                    consumed_samples=consumed,
                )
            )
            assert ours == list(single), (consumed, rank)
            for sharding in (True, False):
                cyclic = samplers.MegatronPretrainingRandomSampler(
                    None, total, consumed, mbs, rank, dp, sharding
                )
                want = []
                for _ in range(3):  # three epochs, as the loader cycles the sampler
                    want += list(cyclic)
                try:
                    it = micro_batches(
                        "cyclic",
                        total,
                        micro_batch_size=mbs,
                        data_parallel_rank=rank,
                        data_parallel_size=dp,
                        consumed_samples=consumed,
                        data_sharding=sharding,
                    )
                    got = [next(it) for _ in range(len(want))]
                except InputError as error:  # ranks out of step: refused, not reproduced
                    assert not sharding and "out of step" in str(error)
                    continue
                assert got == want, (consumed, rank, sharding)


# --- without torch or Megatron ----------------------------------------------------------------

_BLOCKER = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron"):
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, _Block())
"""


def test_reader_imports_neither_torch_nor_megatron(data, tmp_path):
    prefixes = data["web"]
    weights = weights_for(prefixes)
    repack = str(data["root"] / "all.repack")
    child = _BLOCKER + textwrap.dedent(f"""
        import numpy as np
        from repack.samples import GPTSamples, GrainSource, hf_examples, micro_batches
        ds = GPTSamples({repack!r}, blend=({prefixes!r}, {weights!r}), sizes=[300, 30, 10],
                        split="90,5,5", random_seed=11, sequence_length=32, eod=0)
        source = GrainSource(ds, fields=["tokens", "labels"])
        batches = micro_batches("cyclic", len(ds), micro_batch_size=2, data_parallel_rank=1,
                                data_parallel_size=2)
        order = [i for _, batch in zip(range(100), batches) for i in batch]
        np.save({str(tmp_path / "tokens.npy")!r}, np.stack([source[i]["tokens"] for i in order]))
        assert len(list(hf_examples(ds, 0, 5))) == 5
        for name in ("torch", "megatron"):
            assert not any(m.split(".")[0] == name for m in sys.modules), name
        try:
            import torch  # noqa: F401
        except ImportError:
            print("blocked")
    """)
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "blocked"
    config = gpt_config(prefixes, weights, sequence_length=32, seed=11)
    train = _stock(config, [300, 30, 10])[0]
    sampler = megatron_samplers()
    order = [
        i
        for _, b in zip(
            range(100),
            micro_batches(
                "cyclic", len(train), micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2
            ),
        )
        for i in b
    ]
    if sampler is not None:  # the order itself is Megatron-LM's (test_samplers_are_megatron_lms)
        cyclic = sampler.MegatronPretrainingRandomSampler(None, len(train), 0, 2, 1, 2, True)
        theirs: list[int] = []
        while len(theirs) < len(order):  # epoch after epoch, as the loader cycles it
            theirs += [i for batch in cyclic for i in batch]
        assert order == theirs[: len(order)]
    want = np.stack([train[i]["tokens"].numpy() for i in order])
    assert np.array_equal(np.load(tmp_path / "tokens.npy"), want)


def test_torch_adapter_collates_as_megatrons_loader(data):
    prefixes = data["web"]
    config = gpt_config(prefixes, None, sequence_length=16, seed=3)
    train = _stock(config, [100, 10, 10])[0]
    ours = TorchSamples(
        GPTSamples(
            blend=(prefixes, None),
            sizes=[100, 10, 10],
            split="90,5,5",
            random_seed=3,
            sequence_length=16,
            eod=0,
            release=RELEASE,
        )
    )
    batches = [list(range(i, i + 4)) for i in range(0, 96, 4)]
    theirs = torch.utils.data.DataLoader(train, batch_sampler=batches)
    mine = torch.utils.data.DataLoader(ours, batch_sampler=batches, num_workers=1)
    for a, b in zip(theirs, mine, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _web_samples(data, sizes) -> GPTSamples:
    """The train split of the web sources, unweighted, read from the repack."""
    repack = str(data["root"] / "all.repack")
    return GPTSamples(
        repack,
        blend=(data["web"], None),
        sizes=sizes,
        split="90,5,5",
        random_seed=1,
        sequence_length=16,
        eod=0,
        release=RELEASE,
    )


def test_hugging_face_generator(data, tmp_path):
    datasets = pytest.importorskip("datasets")  # in the Python 3.12 environment
    ds = _web_samples(data, [50, 5, 5])
    from repack.samples import hf_examples

    hf = datasets.Dataset.from_generator(
        hf_examples,
        gen_kwargs={"samples": ds, "fields": ("tokens", "labels")},
        cache_dir=str(tmp_path / "hf"),
    )
    assert len(hf) == len(ds)
    for i in (0, 7, len(ds) - 1):
        assert hf[i]["tokens"] == ds[i]["tokens"].tolist()


# --- the docs' examples -------------------------------------------------------------------------


def _doc_blocks(path: Path) -> list[tuple[str, str]]:
    """``(needs, code)`` of each Python block marked ``<!-- test: run -->`` (or
    ``<!-- test: run needs=MODULE -->``)."""
    text = path.read_text(encoding="utf-8")
    found = re.findall(
        r"<!-- test: run(?: needs=(\w+))? -->\n```python\n(.*?)^```", text, re.M | re.S
    )
    return found


def _run_doc_blocks(doc: str, folder: Path, *, needing: bool) -> int:
    """Run ``doc``'s repack.samples examples in ``folder``: those that need an optional
    module (``needing``) or the others. Returns how many ran."""
    import importlib.util

    blocks = [(needs, code) for needs, code in _doc_blocks(ROOT / doc) if "samples" in code]
    assert blocks, f"{doc}: no repack.samples example marked to run"
    ran = 0
    for needs, code in blocks:
        if bool(needs) != needing or (needs and importlib.util.find_spec(needs) is None):
            continue
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert out.returncode == 0, f"{doc}:\n{code}\n{out.stderr[-3000:]}"
        ran += 1
    return ran


def _doc_folder(data, folder: Path, demo: bool) -> Path:
    """What the examples assume: ``data_args.txt`` and ``blend.repack`` (and the README's demo
    folder, ``demo/out``)."""
    prefixes = data["web"]
    args = " ".join(f"{w} {p}" for w, p in zip(weights_for(prefixes), prefixes))
    (folder / "data_args.txt").write_text(args + "\n")
    merge(folder / "data_args.txt", str(folder / "blend.repack"))
    if demo:  # the README's examples run after its demo, in the same folder
        from readme_support import DEMO

        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        subprocess.run(
            ["bash", "-c", DEMO],
            cwd=folder,
            env={**os.environ, "PATH": path},
            check=True,
            capture_output=True,
            timeout=300,
        )
    return folder


@pytest.mark.once
@pytest.mark.parametrize("doc", ["docs/samples.md", "README.md"])
def test_doc_examples_run(doc, data, tmp_path):
    folder = _doc_folder(data, tmp_path, demo=doc == "README.md")
    assert _run_doc_blocks(doc, folder, needing=False)


def test_doc_examples_of_optional_modules_run(data, tmp_path):
    """The examples that need an optional module, each where CI has it: ``datasets`` in the
    Python 3.12 environment, Grain in the main one (not ``once``: ``once`` tests run on 3.11
    only)."""
    import importlib.util

    needed = {needs for needs, _ in _doc_blocks(ROOT / "docs/samples.md") if needs}
    assert needed >= {"datasets", "grain"}  # premise: both have an example
    present = sorted(name for name in needed if importlib.util.find_spec(name) is not None)
    if not present:
        pytest.skip(f"none of {sorted(needed)} is installed")
    folder = _doc_folder(data, tmp_path, False)
    assert _run_doc_blocks("docs/samples.md", folder, needing=True) == sum(
        needs in present for needs, _ in _doc_blocks(ROOT / "docs/samples.md")
    )


def test_results_are_json_friendly(data):
    """origin() names the prefix as the blend does, and its fields serialize."""
    ds = _web_samples(data, [20, 5, 5])
    origin = ds.origin(3)
    assert origin.prefix in data["web"] and ds.datasets()[origin.dataset_id] == origin.prefix
    json.dumps(origin.__dict__)


def test_trace_and_samples_agree_on_documents(data):
    """``repack trace`` (Megatron's own build) and GPTSamples give each trained sample the same
    split index (through the same sampler) and the same documents."""
    from repack.trace.run import trace
    from repack.trace.settings import TraceSettings

    repack = str(data["root"] / "all.repack")
    values = {
        "seq_length": 32,
        "split": "90,5,5",
        "seed": 11,
        "train_iters": 20,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "data_parallel_size": 2,
        "dataloader_type": "cyclic",
        "eval_interval": 10,
        "eval_iters": 1,
    }
    settings = TraceSettings.from_values(values, RELEASE)
    answer = trace(repack, values, blend_file=None, iterations=(1, 20), tokens=True)
    ours = GPTSamples(
        repack,
        sizes=settings.sizes,
        split="90,5,5",
        random_seed=11,
        sequence_length=32,
        eod=0,
        release=RELEASE,
    )
    assert len(answer.train) == 20 * 8
    for record in answer.train:
        origin = ours.origin(record["index"])
        documents = [d["document"] for d in record["documents"]]
        assert origin.prefix == record["source"] or record["source"] in origin.prefix
        assert documents == [d for d in origin.documents if d in documents], record["index"]
        # GPTDataset's list may also name a document that gives the window only its extra
        # token, or none (a window starting right at its end): trace names the trained ones
        ends = {origin.documents[0], origin.documents[-1]}
        assert set(origin.documents) - set(documents) <= ends, record["index"]
        full = ours[record["index"]]
        assert record["tokens"] == [*full["tokens"].tolist(), int(full["labels"][-1])]
    consumed = 8 * 3  # iteration 4, rank 1: the second micro-batch of 2
    batches = micro_batches(
        "cyclic",
        len(ours),
        micro_batch_size=2,
        data_parallel_rank=1,
        data_parallel_size=2,
        consumed_samples=consumed,
    )
    first, second = next(batches), next(batches)
    found = sorted(
        (r for r in answer.train if r["iteration"] == 4 and r["rank"] == 1),
        key=lambda r: (r["microbatch"], r["row"]),
    )
    assert [r["index"] for r in found] == first + second


def test_samples_pickle_by_their_settings(data):
    """What Grain's and DataLoader's spawned workers get: a copy that reopens the data."""
    import pickle

    ds = _web_samples(data, [30, 5, 5])
    copy = pickle.loads(pickle.dumps(ds))
    assert len(copy) == len(ds)
    for i in (0, len(ds) // 2, len(ds) - 1):
        assert all(np.array_equal(copy[i][k], ds[i][k]) for k in ds[i])
    assert copy.fma is ds.fma


def test_a_pickled_copy_keeps_its_rounding(data, monkeypatch):
    """The rounding is resolved where the copy is made: a worker on another kind of machine
    (whose default would be the other rounding) keeps the same order."""
    import pickle

    from repack.model import rounding

    ds = _web_samples(data, [30, 5, 5])
    assert f"fma={ds.fma})" in repr(ds)
    monkeypatch.setattr(rounding, "default_fma", lambda: not ds.fma)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.fma is ds.fma


def test_more_prefixes_than_megatrons_int16_index_is_one_error(tmp_path):
    """32,767 prefixes in one split's blend: Megatron's BlendedDataset asserts fewer (its
    dataset index is int16; under python -O it wraps). Refused before any prefix is opened
    (none of these exists); 32,766 go on to open them."""
    from repack.errors import SourceError, TooManyDatasets

    common = dict(sizes=[10, 0, 0], split="1,0,0", random_seed=1, sequence_length=8, eod=0)
    names = [str(tmp_path / f"missing-{i}") for i in range(32_767)]
    with pytest.raises(TooManyDatasets) as caught:
        GPTSamples(blend=(names, None), **common)
    message = str(caught.value)
    assert message.startswith("the train blend names 32,767 prefixes: Megatron's BlendedDataset")
    assert "asserts fewer than 32,767 datasets" in message and "python -O" in message
    with pytest.raises(TooManyDatasets):
        GPTSamples(blend_per_split=[None, (names, [1.0] * 32_767), None], which="valid",
                   **{**common, "split": None})  # fmt: skip
    with pytest.raises(SourceError):
        GPTSamples(blend=(names[:32_766], None), **common)
