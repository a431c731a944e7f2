"""The ``repack`` command group: its help, ``--version``, and the commands it holds.

This module owns the group :func:`main` (the console entry point ``repack.cli:main``) and the
list of its commands, each defined in the module of its family: :mod:`repack.cli.merging`,
:mod:`repack.cli.editing`, :mod:`repack.cli.reading`, :mod:`repack.cli.diagnosis`,
:mod:`repack.cli.tracing`,
:mod:`repack.cli.preparing`.
"""

from __future__ import annotations

from importlib.util import find_spec

import click

from repack import __version__
from repack.cli.benching import bench
from repack.cli.diagnosis import doctor
from repack.cli.editing import add, fingerprint, gc, remove
from repack.cli.exits import ErrorGroup
from repack.cli.merging import merge
from repack.cli.preparing import prepare
from repack.cli.reading import extract, inspect, verify
from repack.cli.tracing import trace

__all__ = ["main"]


@click.group(
    cls=ErrorGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(
    __version__,
    prog_name="repack",
    # whether repack/read/_hashes.c and repack/model/_blending.c were built (setup.py): document
    # fingerprints 10-20x faster, Megatron's blending index in O(log sources) a sample
    message="%(prog)s, version %(version)s; document hashing: "
    + ("compiled" if find_spec("repack.read._hashes") else "Python (repack.read._hashes not built)")
    + "; blending index: "
    + (
        "compiled"
        if find_spec("repack.model._blending")
        else "Python (repack.model._blending not built)"
    ),
)
def main() -> None:
    """Consolidate a Megatron-LM training blend into a few shards, losslessly.

    A blend of hundreds of tokenized Megatron prefixes (X.bin + X.idx) makes every training
    process open hundreds of files and mmaps. `repack merge` copies them once into a few large
    shards with one combined index and a per-source table; training then opens only those.

    \b
    Typical use:
      repack merge blend.json /lustre/me/blend.repack     # consolidate
      repack verify /lustre/me/blend.repack               # prove it intact
      repack inspect /lustre/me/blend.repack              # what is in it
      repack extract /lustre/me/blend.repack data/web/cc-00017 /tmp/cc-00017
      repack prepare /lustre/me/blend.repack --seq-length 4096 --train-iters 100000 \\
        --global-batch-size 512                           # a run's cache, before the job
      repack bench /lustre/me/blend.repack --checkpoint ckpts/ --step-time 1.5
                                                          # can this storage feed the run?

    A repack may also live in object storage: OUT as s3://BUCKET/KEY or msc://PROFILE/PATH
    (pip install 'megatron-repack[s3]'; docs/objstore.md).

    Run `repack COMMAND --help` for details of each command.
    """


for _command in (
    merge,
    add,
    remove,
    verify,
    fingerprint,
    gc,
    inspect,
    extract,
    doctor,
    trace,
    prepare,
    bench,
):
    main.add_command(_command)
