#!/usr/bin/env bash
# Real GPU slowdowns for validating MegaScan detection on your own cluster (never run on a GPU by tests).
#   scripts/gpu_control.sh limit GPU MHZ     lock GPU's graphics clock to at most MHZ (needs root)
#   scripts/gpu_control.sh reset [GPU|all]   undo: unlock clocks and restore the default power limit of
#                                            GPU, of every GPU this script changed (no argument), or of all
#   scripts/gpu_control.sh monitor [SECS]    print clocks, power, utilization of every GPU every SECS (default 1)
# GPU is the nvidia-smi index on this node. Down-clocking one GPU of a training job makes its
# rank the slow one; `python -m megatron.scan detect TRACE_DIR` should name it. The GPUs changed
# are recorded in $MEGASCAN_GPU_STATE_DIR (default /run/megascan-gpu-control) until reset.
set -euo pipefail

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
command -v nvidia-smi >/dev/null || { echo "error: nvidia-smi not found (no NVIDIA driver on this node)" >&2; exit 1; }
state_dir=${MEGASCAN_GPU_STATE_DIR:-/run/megascan-gpu-control}
record=$state_dir/changed

is_index() { [[ $1 =~ ^[0-9]+$ ]] || { echo "error: GPU must be an nvidia-smi index (0, 1, ...), got '$1'" >&2; exit 2; }; }

remember() {
  mkdir -p "$state_dir"
  { [[ -f $record ]] && cat "$record"; echo "$1"; } | sort -un > "$record.tmp"
  mv "$record.tmp" "$record"
}

forget() {
  [[ -f $record ]] || return 0
  grep -vx "$1" "$record" > "$record.tmp" || true
  if [[ -s $record.tmp ]]; then mv "$record.tmp" "$record"; else rm -f "$record.tmp" "$record"; fi
}

reset_one() {
  local gpu=$1 default
  nvidia-smi -i "$gpu" --reset-gpu-clocks >/dev/null
  default=$(nvidia-smi -i "$gpu" --query-gpu=power.default_limit --format=csv,noheader,nounits | tr -d ' ')
  nvidia-smi -i "$gpu" -pl "$default" >/dev/null || true
  forget "$gpu"
  echo "GPU $gpu: clocks unlocked, power limit back to $default W"
}

action=${1:-}; shift || true
case "$action" in
  limit)
    [[ $# -eq 2 ]] || usage
    gpu=$1; mhz=$2
    is_index "$gpu"
    [[ $mhz =~ ^[0-9]+$ ]] || { echo "error: MHZ must be a whole number of MHz, got '$mhz'" >&2; exit 2; }
    # Locked clocks (not a power cap) give a steady, reproducible slowdown factor.
    nvidia-smi -i "$gpu" -pm 1 >/dev/null
    nvidia-smi -i "$gpu" --lock-gpu-clocks=0,"$mhz" >/dev/null
    remember "$gpu"
    echo "GPU $gpu: graphics clock locked to <= $mhz MHz; undo with: $0 reset $gpu (or $0 reset for every GPU changed)"
    ;;
  reset)
    [[ $# -le 1 ]] || usage
    case "${1:-}" in
      "")
        if [[ ! -s $record ]]; then
          echo "nothing to reset: no GPU on this node was changed by $0 (record: $record); '$0 reset all' resets every GPU"
          exit 0
        fi
        for gpu in $(cat "$record"); do reset_one "$gpu"; done
        ;;
      all)
        for gpu in $(nvidia-smi --query-gpu=index --format=csv,noheader); do reset_one "$gpu"; done
        ;;
      *)
        is_index "$1"
        reset_one "$1"
        ;;
    esac
    ;;
  monitor)
    interval=${1:-1}
    nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,power.draw,power.limit,utilization.gpu,temperature.gpu \
      --format=csv -l "$interval"
    ;;
  *) usage ;;
esac
