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


def serve() -> None:
    """``python loader_child.py --serve``: import torch and megatron-core once, then run each
    job whose path comes on stdin (one a line) in a child forked from this process, printing
    the child's pid. What the child opens is its own, as in a fresh process: this one has
    imported modules and opened no data. (An import of both costs 5-7 s of CPU on a busy CI
    machine, which every fresh process paid again: tests/test_resources.py's 8 jobs took 87 s
    of CPU with a process each, 42 s so.) Each child writes ``BASE.out``, ``BASE.err``
    (``BASE.json`` being the job) and, when it ends by itself, its exit status to
    ``BASE.status``."""
    import os
    import signal
    import traceback

    import megatron_support  # noqa: F401 (torch and megatron-core, for every job)

    def reap(signum, frame) -> None:  # each child waited for as it ends (its CPU time
        # is then counted in this process's children, and so in the test's)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass

    signal.signal(signal.SIGCHLD, reap)
    for line in sys.stdin:
        job_path = line.strip()
        base = job_path.removesuffix(".json")
        pid = os.fork()
        if pid == 0:  # pragma: no cover (child)
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the job waits for its own
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                for fd, suffix in ((1, ".out"), (2, ".err")):
                    target = os.open(base + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(target, fd)
                    os.close(target)
                os.close(null)
                main(job_path)
                code = 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                with open(base + ".status", "w") as status:
                    status.write(str(code))
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        main(sys.argv[1])
