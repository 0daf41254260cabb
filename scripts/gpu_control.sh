#!/usr/bin/env bash
# Real GPU slowdowns for validating MegaScan detection on your own cluster (never run by tests).
#   scripts/gpu_control.sh limit GPU MHZ     lock GPU's graphics clock to at most MHZ (needs root)
#   scripts/gpu_control.sh reset GPU         undo: unlock clocks and restore the default power limit
#   scripts/gpu_control.sh monitor [SECS]    print clocks, power, utilization of every GPU every SECS (default 1)
# GPU is the nvidia-smi index on this node. Down-clocking one GPU of a training job makes its
# rank the slow one; `python -m megatron.scan detect TRACE_DIR` should name it.
set -euo pipefail

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
command -v nvidia-smi >/dev/null || { echo "error: nvidia-smi not found (no NVIDIA driver on this node)" >&2; exit 1; }

action=${1:-}; shift || true
case "$action" in
  limit)
    [[ $# -eq 2 ]] || usage
    gpu=$1; mhz=$2
    # Locked clocks (not a power cap) give a steady, reproducible slowdown factor.
    nvidia-smi -i "$gpu" -pm 1 >/dev/null
    nvidia-smi -i "$gpu" --lock-gpu-clocks=0,"$mhz"
    echo "GPU $gpu: graphics clock locked to <= $mhz MHz; undo with: $0 reset $gpu"
    ;;
  reset)
    [[ $# -eq 1 ]] || usage
    gpu=$1
    nvidia-smi -i "$gpu" --reset-gpu-clocks
    default=$(nvidia-smi -i "$gpu" --query-gpu=power.default_limit --format=csv,noheader,nounits | tr -d ' ')
    nvidia-smi -i "$gpu" -pl "$default" >/dev/null || true
    echo "GPU $gpu: clocks unlocked, power limit back to $default W"
    ;;
  monitor)
    interval=${1:-1}
    nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,power.draw,power.limit,utilization.gpu,temperature.gpu \
      --format=csv -l "$interval"
    ;;
  *) usage ;;
esac
