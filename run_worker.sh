#!/usr/bin/env bash
# Node NODE_RANK (>= 1) of a multi-node job started by run_master.sh on MASTER_ADDR.
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 NPROC_PER_NODE=8 bash run_worker.sh [trainer flags]
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK to the index of this node, 1 .. NNODES-1}"
if [ "$NODE_RANK" -lt 1 ]; then echo "run_worker.sh: NODE_RANK must be >= 1 (node 0 runs run_master.sh)" >&2; exit 2; fi
exec bash "$(dirname "$0")/scripts/launch_node.sh" "$@"
