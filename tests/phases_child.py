"""Run a training run in blend phases through Megatron-LM's own data code, one launch per phase
(a child process of tests/test_trace_phases.py: Megatron's global arguments stay out of the test
process).

``python phases_child.py CASES.json OUT.json``. CASES is a list of runs, each with ``schedule``
(the phase schedule file), ``repack`` (or null: stock ``GPTDataset`` over each blend's prefixes),
``flags`` (Megatron-LM flags: sizes, batch sizes, evaluation, seed, split), ``ranks`` (the
data-parallel size simulated). For every phase, the launch resumed at its start iteration:

* Megatron-LM's ``parse_args`` and ``validate_args`` with ``--phase-transition-iterations`` (the
  schedule's start iterations) and ``--train-samples``, the phase's blend as ``--data-path`` (or
  ``--train-data-path`` ...), its seed; ``update_train_iters``; ``args.iteration`` the phase's
  start, ``args.consumed_train_samples`` and ``args.consumed_valid_samples`` what the previous
  launches consumed (what its checkpoint holds);
* Megatron-LM's ``build_train_valid_test_data_loaders(provider)``, once per simulated rank, the
  provider building the splits as pretrain_gpt.py's does (``BlendedMegatronDatasetBuilder`` of
  ``GPTDataset``, or of ``repack.megatron.dataset_class(repack)`` as a run reading a repack);
* the loop of ``train()``: per iteration, global batch / (micro batch x ranks) micro-batches
  from each rank's train loader; an evaluation (``eval_iters`` x eval global batch / (eval micro
  batch x ranks) micro-batches from each rank's valid loader) every ``--eval-interval``
  iterations, before the transition's exit; after the last phase's loop, the final one.

OUT gets, per iteration (and per evaluation), every rank's micro-batches: each row's index in
the split (from the loader's own batch sampler) and its tokens + the last label (the sample's
``seq-length + 1`` ids, as ``repack trace --tokens`` gives them). What was patched, because it
cannot run here, is recorded in OUT's ``patched``:

* ``torch.tensor(..., device="cuda")``: the flags tensor the loaders' builder broadcasts, made
  on the CPU (one gloo process);
* ``mpu.get_data_parallel_rank`` / ``get_data_parallel_world_size``: the simulated rank and
  data-parallel size (one process plays every rank in turn).

With ``save`` (a folder) in a run, each launch ends as its exit at the transition does: with
Megatron-LM's ``save_checkpoint`` (torch format, tests/checkpoint_child.py's model and CUDA
stand-ins ``get_rng_state``, ``synchronize``, ``current_device``, recorded in ``patched`` too),
its arguments and counters those the launch has at its exit. The cyclic loader is read as
``build_train_valid_test_data_iterators`` reads it (``cyclic_iter``). It also records what
Megatron-LM's ``get_train_valid_test_num_samples`` does for a phased run given ``--train-iters``
(``train_iters_error``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

PATCHED: set[str] = set()


def _argv(case: dict, phase: dict, seed: int, transitions: list[int]) -> list[str]:
    blend = json.load(open(phase["blend"]))
    if isinstance(blend, dict):  # per split
        data = []
        for split in ("train", "valid", "test"):
            items = blend.get(split)
            if items:
                data += [f"--{split}-data-path", *(str(x) for x in items)]
    else:
        data = ["--data-path", *(str(x) for x in blend)]
    return [
        "pretrain_gpt.py",
        *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"),
        *("--max-position-embeddings", "512"),
        *case["flags"],
        *data,
        *("--seed", str(seed)),
        *("--phase-transition-iterations", ",".join(map(str, transitions))),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-workers", "0"),
        *("--lr", "1e-4", "--distributed-backend", "gloo", "--use-cpu-initialization"),
        *("--transformer-impl", "local"),
        *(
            ("--save", case["save"], "--save-interval", "1000", "--ckpt-format", "torch")
            if case.get("save")
            else ()
        ),
    ]


def _stream(loader, args):
    """``(indices, batch)`` per micro-batch: the loader as Megatron-LM iterates it
    (``build_train_valid_test_data_iterators``: ``cyclic_iter`` for the cyclic loader), beside a
    copy of its batch sampler taken before it is read (the cyclic sampler counts what it hands
    out: one object read twice would skip)."""
    import copy

    from megatron.training.training import cyclic_iter

    if loader is None:
        return None
    sampler = copy.deepcopy(loader.batch_sampler)
    if args.dataloader_type == "cyclic":
        return zip(cyclic_iter(sampler), cyclic_iter(loader))
    return zip(iter(sampler), iter(loader))


_MODEL: list = []
SAVING: list = []


def save(args, iteration: int, consumed_valid: int) -> None:
    """Megatron-LM's save_checkpoint at the launch's last iteration, torch format, with the
    counters its training loop keeps in args (a 1-layer model: tests/checkpoint_child.py's)."""
    import torch
    from checkpoint_child import CUDA_CALLS, cpu_for_cuda, model
    from megatron.training import checkpointing

    if not _MODEL:
        cpu_for_cuda(torch)
        _MODEL.append(model(torch))
    args.consumed_train_samples = iteration * args.global_batch_size
    args.consumed_valid_samples = consumed_valid
    SAVING.append(True)
    try:
        checkpointing.save_checkpoint(iteration, _MODEL, None, None, 0)
    finally:
        SAVING.clear()
    PATCHED.update(f"torch.cuda.{name}" for name in CUDA_CALLS)


def main() -> None:
    case_file, out_file = sys.argv[1:3]  # sys.argv is each launch's command line below
    with open(case_file) as file:
        cases = json.load(file)
    warnings.simplefilter("ignore")
    import torch

    store = tempfile.mktemp(prefix="repack-gloo-")
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + store, rank=0, world_size=1
    )
    tensor = torch.tensor

    def cpu_tensor(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            PATCHED.add("torch.tensor(device='cuda')")
            kwargs["device"] = "cpu"
        return tensor(*args, **kwargs)

    if not torch.cuda.is_available():
        torch.tensor = cpu_tensor

    from megatron.core import mpu, parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training.global_vars import get_args, get_tokenizer

    try:
        from megatron.training.utils import get_blend_and_blend_per_split
    except ImportError:
        from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    parallel_state.initialize_model_parallel()
    simulated = {"rank": 0, "ranks": 1, "class": GPTDataset}

    real = (mpu.get_data_parallel_rank, mpu.get_data_parallel_world_size)

    def rank(*args, **kwargs) -> int:
        if SAVING:  # the checkpoint's save: the one real process
            return real[0](*args, **kwargs)
        PATCHED.add("mpu.get_data_parallel_rank")
        return simulated["rank"]

    def world(*args, **kwargs) -> int:
        if SAVING:
            return real[1](*args, **kwargs)
        PATCHED.add("mpu.get_data_parallel_world_size")
        return simulated["ranks"]

    mpu.get_data_parallel_rank = rank
    mpu.get_data_parallel_world_size = world

    def provider(num_samples):
        """pretrain_gpt.py's train_valid_test_datasets_provider, its config's fields."""
        args = get_args()
        blend, blend_per_split = get_blend_and_blend_per_split(args)
        config = GPTDatasetConfig(
            random_seed=args.seed,
            sequence_length=args.seq_length,
            blend=blend,
            blend_per_split=blend_per_split,
            split=args.split,
            path_to_cache=args.data_cache_path,
            tokenizer=get_tokenizer(),
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask,
            eod_mask_loss=args.eod_mask_loss,
            mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        )
        return BlendedMegatronDatasetBuilder(
            simulated["class"], num_samples, lambda: True, config
        ).build()

    results = []
    for case in cases:
        simulated["ranks"] = int(case["ranks"])
        simulated["class"] = GPTDataset
        if case.get("repack"):
            from repack.megatron import dataset_class

            simulated["class"] = dataset_class(case["repack"])
        results.append(run(case, simulated, provider, len(results) == 0))
    with open(out_file, "w") as file:
        json.dump({"runs": results, "patched": sorted(PATCHED)}, file)


def run(case: dict, simulated: dict, provider, first: bool) -> dict:
    """One run, launch by launch."""
    import torch
    from megatron.training import global_vars, training
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    ranks = simulated["ranks"]
    with open(case["schedule"]) as file:
        schedule = json.load(file)
    folder = os.path.dirname(os.path.abspath(case["schedule"]))
    starts = [p["start_iteration"] for p in schedule["phases"]]
    transitions = starts[1:]
    out: dict = {"train": {}, "valid": {}, "launches": []}
    consumed_valid = 0
    for number, phase in enumerate(schedule["phases"]):
        phase = {**phase, "blend": os.path.join(folder, phase["blend"])}
        seed = phase.get("seed", schedule.get("seed", case["seed"]))
        sys.argv = _argv(case, phase, seed, transitions)
        os.environ["WORLD_SIZE"] = str(ranks)  # validate_args: data-parallel size = world size
        args = parse_args()
        validate_args(args)
        if number == 0 and first:
            set_global_variables(args, build_tokenizer=True)
        else:  # a new launch: its own args (tokenizer and batch calculator are the same)
            global_vars.set_args(args)
        training.update_train_iters(args)
        start = starts[number]
        end = starts[number + 1] if number + 1 < len(starts) else args.train_iters
        gbs, mbs = args.global_batch_size, args.micro_batch_size
        emb = getattr(args, "eval_micro_batch_size", None) or mbs
        egbs = getattr(args, "eval_global_batch_size", None) or gbs
        # what the checkpoint the launch resumes from holds
        args.iteration = start
        args.consumed_train_samples = start * gbs
        args.consumed_valid_samples = consumed_valid
        sizes = training.get_train_valid_test_num_samples()
        out["launches"].append(
            {"phase": number, "iteration": start, "sizes": list(sizes), "iters": args.train_iters}
        )
        loaders = []
        for r in range(ranks):
            simulated["rank"] = r
            train, valid, _ = training.build_train_valid_test_data_loaders(provider)
            valid = valid[0] if isinstance(valid, list) else valid
            loaders.append({"train": _stream(train, args), "valid": _stream(valid, args)})

        def read(split: str, micro: int, loaders=loaders) -> list:
            found = []
            for r in range(ranks):
                batches = []
                for _ in range(micro):
                    indices, batch = next(loaders[r][split])
                    tokens = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)
                    batches.append([[int(i), t.tolist()] for i, t in zip(indices, tokens)])
                found.append(batches)
            return found

        evaluations = 0
        for iteration in range(start + 1, end + 1):
            out["train"][iteration] = read("train", gbs // (mbs * ranks))
            if args.eval_interval and iteration % args.eval_interval == 0 and args.eval_iters:
                out["valid"].setdefault(iteration, []).append(
                    read("valid", args.eval_iters * (egbs // (emb * ranks)))
                )
                evaluations += 1
        consumed_valid += evaluations * args.eval_iters * egbs
        if case.get("save"):  # the checkpoint the launch saves at its exit (the transition)
            save(args, end, consumed_valid)
        if number + 1 == len(starts) and args.eval_iters:  # after the loop: the last launch
            out["valid"].setdefault(end, []).append(
                read("valid", args.eval_iters * (egbs // (emb * ranks)))
            )
    # a phased run given --train-iters: what get_train_valid_test_num_samples does with it
    args.train_samples = None
    try:
        training.get_train_valid_test_num_samples()
        out["train_iters_error"] = None
    except Exception as err:
        out["train_iters_error"] = f"{type(err).__name__}: {err}"
    return out


if __name__ == "__main__":
    main()
