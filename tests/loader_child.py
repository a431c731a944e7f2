"""Child process of the loader tests: build a blend's splits, read every sample, report.

``python tests/loader_child.py JOB.json``. The job holds ``prefixes``, ``weights``, ``sizes``,
``cache`` (``path_to_cache``), ``mmap`` (``mmap_bin_files``), ``repack`` (a repack folder, or
null for stock ``GPTDataset``) and ``watch`` (``{name: folder}`` to count mmaps and fds under);
optionally ``sequence_length``, ``seed``, ``split``, ``attention_mask`` (default off: thousands
of masks are slow to build and say nothing about files), ``gloo_folder``, ``nofile`` (a soft
``RLIMIT_NOFILE``, set before anything else runs), and ``rank``, ``world_size`` and ``store`` (a
gloo file store) to run as one rank of a group of processes.

Prints one line ``RESULT {json}``: the per-split sample counts and digests, and the counts of
``megatron_support.open_files`` taken after reading, while the datasets are alive. Errors are
not caught: they end the process with their traceback on stderr, which is what the
file-system-limit tests look for.
"""

from __future__ import annotations

import json
import resource
import sys


def main(job_path: str) -> None:
    with open(job_path) as stream:
        job = json.load(stream)
    if job.get("nofile"):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (job["nofile"], hard))

    import megatron_support as ms

    if job.get("world_size"):  # one rank of a real multi-process group
        import torch

        torch.distributed.init_process_group(
            "gloo",
            init_method="file://" + job["store"],
            rank=job["rank"],
            world_size=job["world_size"],
        )
    else:
        ms.init_process_group(job.get("gloo_folder"))
    if job["repack"] is None:
        cls = ms.GPTDataset
    else:
        from repack.megatron import dataset_class

        cls = dataset_class(job["repack"])
    config = ms.gpt_config(
        job["prefixes"],
        job["weights"],
        seed=job.get("seed", 1234),
        sequence_length=job.get("sequence_length", 16),
        split=job.get("split", "90,5,5"),
        cache=job["cache"],
        mmap=job["mmap"],
        attention_mask=job.get("attention_mask", False),
    )
    datasets = ms.build(cls, config, job["sizes"])
    samples = ms.collect(datasets)
    result = {
        "lengths": [None if s is None else len(s) for s in samples],
        "digest": ms.digest(samples),
        "open": ms.open_files(job["watch"]),
        "shard_maps": None if job["repack"] is None else ms.shard_maps(job["repack"]),
    }
    print("RESULT " + json.dumps(result), flush=True)
    del datasets


if __name__ == "__main__":
    main(sys.argv[1])
