#!/usr/bin/env bash
# One node of a multi-node torchrun job; run_master.sh (node 0) and run_worker.sh (others) call
# this. Environment: MASTER_ADDR, MASTER_PORT (29500), NNODES (2), NODE_RANK, NPROC_PER_NODE (4).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${NODE_RANK:?set NODE_RANK}"
MASTER_PORT="${MASTER_PORT:-29500}"
NNODES="${NNODES:-2}"
NPROC_PER_NODE="${NPROC_PER_NODE:-4}"
ensure_environment
if [ "$(gpu_count)" -eq 0 ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
ARGS=("$@")
if [ ${#ARGS[@]} -eq 0 ]; then
    prepare_demo_data
    ARGS=("${DEMO_MODEL_ARGS[@]}" "${DEMO_DATA_ARGS[@]}" --pipeline-model-parallel-size 2)
fi
echo "[node $NODE_RANK/$NNODES] torchrun --nproc-per-node $NPROC_PER_NODE, rendezvous $MASTER_ADDR:$MASTER_PORT"
exec env PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    pretrain_gpt.py "${ARGS[@]}"
