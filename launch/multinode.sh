#!/usr/bin/env bash
# Multi-node launch with torchrun's c10d rendezvous, driven by the environment. Run it once on
# every node (Slurm's srun does that for launch/slurm.sbatch):
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/multinode.sh --config configs/debug.yaml   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/multinode.sh --config configs/debug.yaml   # on node1
#
# NNODES, NODE_RANK and MASTER_ADDR are required; MASTER_PORT (29500), NPROC_PER_NODE (the GPUs
# this node has, else 1) and RDZV_ID (a job id shared by the nodes, default meshtrain) are optional.
# Collectives time out after --parallel.timeout-s (600 s by default): a dead or hung rank then
# ends every other rank with a message naming the timeout, instead of hanging the job.
set -euo pipefail
: "${NNODES:?set NNODES, the number of nodes}" "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}" \
  "${MASTER_ADDR:?set MASTER_ADDR, the address of node 0}"
root=$(cd "$(dirname "$0")/.." && pwd)
python=${MESHTRAIN_PYTHON:-$root/.venv/bin/python}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$("$python" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
world=$(( NNODES * NPROC_PER_NODE ))
# Validate on every node before the rendezvous: a bad layout is one message, not a hung rendezvous.
WORLD_SIZE=$world LOCAL_WORLD_SIZE=$NPROC_PER_NODE "$python" -W ignore -m meshtrain train "$@" \
  --train.dry-run True >/dev/null
if [ "$(uname)" = Linux ] && [ "$NPROC_PER_NODE" -ge 1 ]; then
  threads=$(( $(nproc) / NPROC_PER_NODE )); [ "$threads" -ge 1 ] || threads=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
fi
exec "$python" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  --rdzv-id "${RDZV_ID:-meshtrain}" -m meshtrain train "$@"
