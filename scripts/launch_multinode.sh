#!/usr/bin/env bash
# Multi-node launcher: run this once on every node; the nodes meet at a c10d rendezvous hosted on
# MASTER_ADDR and start NPROC_PER_NODE training processes each. Arguments go to
# scalevec_train.train.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/launch_multinode.sh model=dense-1b   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 scripts/launch_multinode.sh model=dense-1b   # on node1
#
# Environment (defaults in brackets):
#   NNODES          nodes in the job [1]
#   NODE_RANK       this node's index, 0..NNODES-1; node 0 hosts the rendezvous store (required
#                   when NNODES > 1; global ranks are then assigned by the rendezvous)
#   MASTER_ADDR     address of node 0, reachable from every node [127.0.0.1]
#   MASTER_PORT     its TCP port [29500]
#   NPROC_PER_NODE  processes per node, one per GPU [the visible GPUs, or 1 without GPUs]
#   RDZV_ID         job id shared by all nodes; keeps concurrent jobs apart [scalevec]
#   PYTHON          interpreter with scalevec installed [python]
# With the default distributed.replicate=0, parameters are sharded within a node and replicated
# across nodes (HSDP); every rank agrees on run_dir, and only global rank 0 writes logs and metrics.
set -euo pipefail

NNODES=${NNODES:-1}
if [[ "$NNODES" -gt 1 && -z "${NODE_RANK:-}" ]]; then
  echo "launch_multinode.sh: NNODES=$NNODES needs NODE_RANK (0..$((NNODES - 1))) on every node." >&2
  exit 2
fi
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-scalevec}
PYTHON=${PYTHON:-python}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi

exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" \
  --nproc_per_node="$NPROC_PER_NODE" \
  --rdzv_backend=c10d \
  --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" \
  --rdzv_id="$RDZV_ID" \
  --rdzv_conf="is_host=$([[ "$NODE_RANK" == 0 ]] && echo 1 || echo 0)" \
  -m scalevec_train.train "$@"
