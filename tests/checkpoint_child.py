"""Write training checkpoints with Megatron-LM's and Megatron-Bridge's own save code (a child
process of tests/test_checkpoints.py: Megatron's global arguments, parallel state and Bridge's
GlobalState stay out of the test process).

``python checkpoint_child.py OUT [--bridge]`` writes, on CPU (one gloo process), a 1-layer GPT of
hidden size 16:

``OUT/megatron-torch``
    ``megatron.training.checkpointing.save_checkpoint`` at iteration 20, ``--ckpt-format torch``,
    arguments from Megatron-LM's own ``parse_args`` and ``validate_args`` (no ``--load``).
``OUT/megatron-dcp``
    the same arguments with ``ckpt_format`` ``torch_dcp`` (set on the parsed arguments:
    ``validate_args`` allows it only with ``--use-torch-fsdp2``, which needs a GPU; the save's
    ``torch_dcp`` path, ``generate_state_dict`` and ``torch.distributed.checkpoint.save``, is
    the same for a model not wrapped in FSDP), at iteration 20.
``OUT/megatron-dist``
    the same launch's arguments with ``--ckpt-format torch_dist`` and ``--load`` set to that
    folder (what a resumed launch has; ``ckpt_format``, ``use_dist_ckpt``, ``save`` and ``load``
    set on the parsed arguments, as ``validate_args`` derives ``use_dist_ckpt``), saved at
    iterations 20 and 30, with counters for 20 iterations of 16 samples and 10 of 8: an earlier
    launch with another batch size.
``OUT/bridge`` (``--bridge``)
    ``megatron.bridge.training.checkpointing.save_checkpoint`` at step 20 of a validated
    ``ConfigContainer`` (a ``blend``, ``dataloader_type`` cyclic, ``torch_dist``).

``CHECKPOINT_DATA`` (a JSON object, optional) replaces the launches' blend and cache folder
(Bridge's too): ``{"data_path": [...], "data_cache_path": "..."}``
(tests/test_trace_checkpoint.py traces the checkpoints over real data).

and ``OUT/expected.json``: per folder and iteration, the values of Megatron's own ``args`` (or,
for Bridge, its ``ConfigContainer`` and ``TrainState``) at the save; and which stand-ins were used.

The CUDA calls the save path makes on a machine without a GPU, replaced when
``torch.cuda.is_available()`` is false: ``torch.cuda.get_rng_state`` (the CPU generator's state,
saved as the CUDA one), ``torch.cuda.synchronize`` (nothing to wait for) and
``torch.cuda.current_device`` (``"cpu"``, where the save's flag tensors go). Each call is
recorded in ``expected.json``. Bridge's stand-ins: tests/bridge_support.py.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

SEQUENCE, GLOBAL_BATCH, MICRO_BATCH = 32, 8, 2
BLEND = ["0.3", "/data/a", "0.7", "/data/b"]

#: Megatron-LM's flags for the launch (a tiny GPT on CPU; the data flags are what is read).
ARGV = [
    "pretrain_gpt.py",
    *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"),
    *("--seq-length", str(SEQUENCE), "--max-position-embeddings", str(SEQUENCE)),
    *("--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH)),
    *("--train-iters", "100", "--eval-interval", "10", "--eval-iters", "2"),
    *("--data-path", *BLEND, "--split", "90,5,5", "--seed", "4321"),
    *("--data-cache-path", "/cache/indices", "--dataloader-type", "cyclic"),
    *("--iterations-to-skip", "3", "7", "--mid-level-dataset-surplus", "0.01"),
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "64"),
    *("--lr", "1e-4", "--save-interval", "10", "--no-save-optim"),
    *("--distributed-backend", "gloo", "--use-cpu-initialization", "--transformer-impl", "local"),
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
]


def _blend() -> tuple[list[str], list[float]]:
    """Bridge's ``blend``: ``CHECKPOINT_DATA``'s, if set."""
    data = json.loads(os.environ.get("CHECKPOINT_DATA") or "{}")
    items = data.get("data_path", BLEND)
    return list(items[1::2]), [float(w) for w in items[0::2]]


def _cache() -> str:
    return json.loads(os.environ.get("CHECKPOINT_DATA") or "{}").get(
        "data_cache_path", "/cache/indices"
    )


def _data(argv: list[str]) -> list[str]:
    """``argv`` with ``CHECKPOINT_DATA``'s blend and cache folder, if set."""
    data = json.loads(os.environ.get("CHECKPOINT_DATA") or "{}")
    if not data:
        return argv
    start, end = argv.index("--data-path") + 1, argv.index("--split")
    argv = [*argv[:start], *data["data_path"], *argv[end:]]
    argv[argv.index("--data-cache-path") + 1] = data["data_cache_path"]
    return argv


CUDA_CALLS: list[str] = []


def cpu_for_cuda(torch) -> None:
    """The three CUDA calls of the save path, on a machine without a GPU (recorded)."""
    if torch.cuda.is_available():
        return

    def rng_state(device="cuda"):
        CUDA_CALLS.append("get_rng_state")
        return torch.get_rng_state()

    def synchronize(device=None):
        CUDA_CALLS.append("synchronize")

    def current_device():
        CUDA_CALLS.append("current_device")
        return "cpu"

    torch.cuda.get_rng_state = rng_state
    torch.cuda.synchronize = synchronize
    torch.cuda.current_device = current_device


def model(torch):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=SEQUENCE,
    )


def megatron_lm(out: Path, keys: tuple[str, ...], expected: dict) -> None:
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    sys.argv = [*_data(ARGV), "--save", str(out / "megatron-torch"), "--ckpt-format", "torch"]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    gpt = model(__import__("torch"))

    def save(iteration: int, consumed: int, skipped: int) -> None:
        # what the training loop keeps in args (megatron/training/training.py)
        args.consumed_train_samples = consumed
        args.skipped_train_samples = skipped
        args.consumed_valid_samples = 4 * GLOBAL_BATCH
        checkpointing.save_checkpoint(iteration, [gpt], None, None, 0)
        name = f"{Path(args.save).name}/{iteration}"
        expected[name] = {k: getattr(args, k) for k in keys if hasattr(args, k)}

    save(20, 20 * GLOBAL_BATCH, 2 * GLOBAL_BATCH)
    # torch_dcp: validate_args allows it only with --use-torch-fsdp2 (FSDP2 wants a GPU);
    # save_checkpoint's torch_dcp path (generate_state_dict, torch.distributed.checkpoint.save)
    # is the same for a model not wrapped in FSDP
    args.ckpt_format, args.use_dist_ckpt = "torch_dcp", True
    args.save = str(out / "megatron-dcp")
    save(20, 20 * GLOBAL_BATCH, 2 * GLOBAL_BATCH)
    # the torch_dist launch: resumes from its own folder
    args.ckpt_format, args.use_dist_ckpt = "torch_dist", True
    args.save = args.load = str(out / "megatron-dist")
    save(20, 20 * 16, 2 * 16)
    save(30, 20 * 16 + 10 * GLOBAL_BATCH, 2 * 16)


def bridge(out: Path, expected: dict) -> None:
    import bridge_support

    bridge_support.install()
    from megatron.bridge.models import GPTModelProvider
    from megatron.bridge.training import checkpointing
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        GPTDatasetConfig,
        LoggerConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    dataset = GPTDatasetConfig(
        random_seed=4321,
        seq_length=SEQUENCE,
        split="90,5,5",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        blend=_blend(),
        path_to_cache=_cache(),
        mid_level_dataset_surplus=0.01,
        dataloader_type="cyclic",
        num_workers=0,
    )
    cfg = ConfigContainer(
        train=TrainingConfig(
            train_iters=100,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH,
            iterations_to_skip=[3, 7],
        ),
        validation=ValidationConfig(eval_iters=2, eval_interval=10),
        model=GPTModelProvider(
            num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=SEQUENCE
        ),
        optimizer=OptimizerConfig(),
        scheduler=SchedulerConfig(),
        dataset=dataset,
        logger=LoggerConfig(),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=64),
        checkpoint=CheckpointConfig(
            save=str(out / "bridge"), ckpt_format="torch_dist", save_optim=False, save_rng=False
        ),
        rng=RNGConfig(seed=99),
    )
    cfg.validate()  # what pretrain's setup does: finalizes every section
    state = GlobalState()
    state.cfg = cfg
    state.train_state.step = 20
    state.train_state.consumed_train_samples = 20 * GLOBAL_BATCH
    state.train_state.skipped_train_samples = 2 * GLOBAL_BATCH
    state.train_state.consumed_valid_samples = 4 * GLOBAL_BATCH
    checkpointing.save_checkpoint(
        state,
        [model(__import__("torch"))],
        None,
        None,
        0,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    d, t, v = cfg.dataset, cfg.train, cfg.validation
    expected["bridge/20"] = {
        "blend": [list(d.blend[0]), list(d.blend[1])],
        "split": d.split,
        "seq_length": d.seq_length,
        "random_seed": d.random_seed,
        "path_to_cache": d.path_to_cache,
        "dataloader_type": d.dataloader_type,
        "data_sharding": d.data_sharding,
        "mid_level_dataset_surplus": d.mid_level_dataset_surplus,
        "data_parallel_size": cfg.data_parallel_size,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "train_iters": t.train_iters,
        "iterations_to_skip": list(t.iterations_to_skip),
        "eval_interval": v.eval_interval,
        "eval_iters": v.eval_iters,
        "rng_seed": cfg.rng.seed,
        "step": state.train_state.step,
        "consumed_train_samples": state.train_state.consumed_train_samples,
        "skipped_train_samples": state.train_state.skipped_train_samples,
        "consumed_valid_samples": state.train_state.consumed_valid_samples,
    }
    expected["modelopt_called"] = [name for name, _ in bridge_support.CALLED]
    expected["transformer_engine_looked_up"] = len(bridge_support.LOOKED_UP)


def main() -> None:
    out = Path(sys.argv[1])
    with_bridge = "--bridge" in sys.argv[2:]
    keys = tuple(json.loads(os.environ["CHECKPOINT_KEYS"]))
    warnings.simplefilter("ignore")
    import torch

    cpu_for_cuda(torch)
    store = tempfile.mktemp(prefix="repack-gloo-")
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + store, rank=0, world_size=1
    )
    expected: dict = {}
    megatron_lm(out, keys, expected)
    if with_bridge:
        bridge(out, expected)
    expected["cuda_calls"] = sorted(set(CUDA_CALLS))
    (out / "expected.json").write_text(json.dumps(expected, indent=1, default=repr))


if __name__ == "__main__":  # the save's worker processes import this module again
    main()
