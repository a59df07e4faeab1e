#!/usr/bin/env bash
# Single-node launch: launch/torchrun.sh NPROC [meshtrain train options ...]
# e.g. launch/torchrun.sh 4 --config configs/debug.yaml --train.steps 20
set -euo pipefail
nproc=$1; shift
root=$(cd "$(dirname "$0")/.." && pwd)
python=${MESHTRAIN_PYTHON:-$root/.venv/bin/python}
# Validate once, in one process, with the job's world size: a bad layout then prints one message
# instead of one per rank plus torchrun's failure report. Its warnings are left to the job's rank 0.
WORLD_SIZE=$nproc LOCAL_WORLD_SIZE=$nproc "$python" -W ignore -m meshtrain train "$@" --train.dry-run True >/dev/null
# Share the cores between ranks; oversubscribed OpenMP threads make CPU runs crawl.
threads=$(( $(nproc) / nproc )); [ "$threads" -ge 1 ] || threads=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m meshtrain train "$@"
