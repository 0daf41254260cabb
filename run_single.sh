#!/usr/bin/env bash
# Train a small GPT on this machine: 4 CPU ranks (TP=1 PP=2 DP=2) over gloo, or the GPUs when
# present. Sets up the environment and the demo corpus on first use.
#   bash run_single.sh                 # the demo
#   bash run_single.sh -- --train-iters 20 --tensor-model-parallel-size 2   # flags pass through
set -euo pipefail
cd "$(dirname "$0")"
# shellcheck source=scripts/common.sh
. scripts/common.sh

PASS_THROUGH=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; PASS_THROUGH=("$@"); break ;;
        *) echo "usage: bash run_single.sh [-- trainer flags]" >&2; exit 2 ;;
    esac
done

ensure_environment
prepare_demo_data
OUT="${OUTPUT_DIR:-outputs}"
mkdir -p "$OUT"

GPUS=$(gpu_count)
if [ "$GPUS" -ge 1 ]; then
    NPROC="${NPROC:-$(( GPUS < 4 ? GPUS : 4 ))}"
    DEVICE=cuda
else
    NPROC="${NPROC:-4}"
    DEVICE=cpu
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
PP=2
[ "$NPROC" -lt 2 ] && PP=1
TB=()
python -c "import tensorboard" 2>/dev/null && TB=(--tensorboard-dir "$OUT/tensorboard")

echo "[train] torchrun --nproc-per-node $NPROC pretrain_gpt.py (device $DEVICE, pp $PP); log: $OUT/train.log"
PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${DEMO_MODEL_ARGS[@]}" "${DEMO_DATA_ARGS[@]}" --device "$DEVICE" \
    --pipeline-model-parallel-size "$PP" --save "$OUT/checkpoints" --save-interval 50 "${TB[@]}" \
    "${PASS_THROUGH[@]}" 2>&1 | tee "$OUT/train.log" | grep --line-buffered -v "warnings.warn\|Unable to save"
status=${PIPESTATUS[0]}
echo
echo "outputs:"
echo "  training log   $OUT/train.log"
echo "  checkpoints    $OUT/checkpoints (resume with -- --load $OUT/checkpoints)"
[ ${#TB[@]} -gt 0 ] && echo "  tensorboard    tensorboard --logdir $OUT/tensorboard"
echo "  demo data      ${DATA_DIR:-data}/"
exit "$status"
