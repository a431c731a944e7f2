#!/usr/bin/env bash
# Merge a blend on a SLURM cluster: plan here, copy the shards in an array job of N tasks,
# then finalize in a job that starts when every task has succeeded.
#
#   scripts/slurm/submit.sh BLEND OUT [N] [PLAN OPTIONS]
#
# N (default 8) is the number of array tasks; it is lowered to the number of shards. PLAN
# OPTIONS go to `repack merge --plan-only` (--shard-size, --checksum, --force). Options of
# sbatch come from its environment variables (SBATCH_PARTITION, SBATCH_ACCOUNT,
# SBATCH_TIMELIMIT, ...) and override the #SBATCH lines of merge.sbatch.
#
# The plan step runs here, at once: it validates every source of the blend, so a bad source
# stops everything before a job is queued. Prints the ids of the array job and of the
# finalize job, then, on its last line, the finalize job id alone (for --dependency).
#
# Run it again after a failure (a task out of time, a node lost): the plan is found again,
# the new array skips every shard already done, and the finalize job finishes the merge.
# Or finish on one machine with `repack merge OUT --resume`.
set -euo pipefail

if (($# < 2)); then
    echo "usage: $0 BLEND OUT [N] [PLAN OPTIONS]" >&2
    exit 2
fi
blend=$1
out=$2
shift 2
tasks=8
if (($#)) && [[ $1 =~ ^[0-9]+$ ]]; then
    tasks=$1
    shift
fi
if ((tasks < 1)); then
    echo "$0: N must be at least 1, got $tasks" >&2
    exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# word-split on purpose: REPACK="python -m repack" works
read -r -a repack <<<"${REPACK:-repack}"

# 1. plan (here, now): validate every source, plan the shards, write the index
plan=$("${repack[@]}" merge -q --plan-only --json "$@" "$blend" "$out")
state=$(sed -n 's/^ *"state": "\([a-z]*\)".*/\1/p' <<<"$plan")
shards=$(sed -n 's/^ *"shards": \([0-9]*\).*/\1/p' <<<"$plan")
if [[ $state == complete ]]; then
    echo "$out already holds this merge, finished; nothing to submit"
    exit 0
fi
if ((tasks > shards)); then
    tasks=$shards
fi
if [[ $state == new ]]; then verb="planned"; else verb="plan already in"; fi
echo "$verb $out: $shards shard(s), $tasks task(s)"

# 2. the tasks, as one array job; 3. finalize, once every task has succeeded
array=$(sbatch --parsable --array="0-$((tasks - 1))" "$here/merge.sbatch" "$out")
array=${array%%;*} # "jobid;cluster" on a federation
final=$(sbatch --parsable --job-name=repack-finalize --dependency="afterok:$array" \
    --kill-on-invalid-dep=yes --output="repack-finalize-%j.log" \
    "$here/merge.sbatch" "$out" --finalize)
final=${final%%;*}
echo "array job $array: repack merge $out --task I --tasks $tasks, I = 0..$((tasks - 1))"
echo "finalize job $final: repack merge $out --finalize, after all of $array succeed"
echo "$final"
