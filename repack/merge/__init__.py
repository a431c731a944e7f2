"""Writing and editing a repack: ``merge`` (validate the blend's sources, plan shards, copy
data, write the index, and write the manifest last, atomically), and the edits ``add``,
``remove`` and ``fingerprint`` of a complete one.

The write path, one module per step, read in this order:

* :mod:`repack.merge.prepare` — parse the blend, validate every source, plan the shards
  (writes nothing); :class:`Prepared` is the plan every later step works from;
* :mod:`repack.merge.workdir` — the output while it is written: the work folder
  ``OUT/.work`` (saved plan, shard :class:`Receipt`\\ s), temp files and leftovers;
* :mod:`repack.merge.shards` — the tasks: write (and compress) shards, then receipt them;
* :mod:`repack.merge.index` — write a combined index;
* :mod:`repack.merge.entries` — the manifest entries of new shards and sources;
* :mod:`repack.merge.steps` — the three steps, plan, tasks, finalize, and :func:`merge`;
* :mod:`repack.merge.edit` — one edit of a complete repack, the steps ``repack add``
  (:mod:`repack.merge.append`), ``repack remove`` (:mod:`repack.merge.remove`) and ``repack
  fingerprint`` share.

Every step is written once against a :class:`~repack.store.Store`: a local folder and object
storage (``s3://``, ``msc://``) run the same code, each store doing what it guarantees in its
own way (docs/objstore.md). Until the manifest exists the output is not a repack: an
interrupted merge never leaves a folder that looks complete. Run again, the same merge finds
its plan and skips every shard that has a receipt, and ends with the same bytes as an
uninterrupted run.
"""

from __future__ import annotations

from repack.merge.prepare import DEFAULT_SHARD_SIZE, MergeResult, Prepared, prepare
from repack.merge.steps import (
    PlanState,
    execute,
    finalize,
    merge,
    plan_merge,
    resume,
    run_task,
    write_index,
)
from repack.merge.workdir import PLAN_FILE, WORK_DIR, Receipt, load_plan

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "PLAN_FILE",
    "WORK_DIR",
    "MergeResult",
    "PlanState",
    "Prepared",
    "Receipt",
    "execute",
    "finalize",
    "load_plan",
    "merge",
    "plan_merge",
    "prepare",
    "resume",
    "run_task",
    "write_index",
]
