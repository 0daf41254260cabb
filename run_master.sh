#!/usr/bin/env bash
# Node 0 of a multi-node job. On each other node run run_worker.sh with its NODE_RANK.
#   MASTER_ADDR=10.0.0.1 NNODES=2 NPROC_PER_NODE=8 bash run_master.sh [trainer flags]
set -euo pipefail
export NODE_RANK=0
exec bash "$(dirname "$0")/scripts/launch_node.sh" "$@"
