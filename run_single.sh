#!/usr/bin/env bash
# Train a small GPT on this machine: 4 CPU ranks (TP=1 PP=2 DP=2) over gloo, or the GPUs when
# present, with MegaScan tracing on; then merge the per-rank traces into one Chrome trace, run
# slow-rank detection (report.html) and print where everything is and what to try next.
# Sets up the environment and the demo corpus on first use.
#   bash run_single.sh                 # the demo
#   bash run_single.sh -- --train-iters 20 --tensor-model-parallel-size 2   # flags pass through
#   bash run_single.sh -- --trace-dir DIR --trace-interval 5                # trace elsewhere / more often
#   TRACE=0 bash run_single.sh         # no tracing, no aggregation
# Environment: OUTPUT_DIR (default outputs), DATA_DIR (default data), NPROC, VENV, TRACE.
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

# MegaScan: trace 2 iterations every 20 into $OUT/trace, unless TRACE=0. Flags given after `--`
# come later on the command line and so win (--trace-dir DIR, --trace-interval N, ...).
TRACE_ARGS=() TRACE_DIR="" USER_TRACE="" WINDOW=(--trace-interval 20 --continuous-trace-iterations 2)
for ((i = 0; i < ${#PASS_THROUGH[@]}; i++)); do
    case "${PASS_THROUGH[i]}" in
        --trace) USER_TRACE=1 ;;
        --trace-dir) USER_TRACE=1; TRACE_DIR="${PASS_THROUGH[i + 1]:-}" ;;
        --trace-dir=*) USER_TRACE=1; TRACE_DIR="${PASS_THROUGH[i]#--trace-dir=}" ;;
        --trace-interval* | --continuous-trace-iterations*) WINDOW=() ;;  # the user's window, with the trainer's defaults
    esac
done
if [ "${TRACE:-1}" != 0 ] || [ -n "$USER_TRACE" ]; then
    if [ -z "$TRACE_DIR" ]; then
        TRACE_DIR="$OUT/trace"
        # our own directory: drop the previous demo's files so that only this run is aggregated
        rm -f "$TRACE_DIR"/benchmark-data-*.json "$TRACE_DIR"/{merged_trace.json,report.html,abnormal.json,abnormal.txt,detection.txt}
    fi
    TRACE_ARGS=(--trace --trace-dir "$TRACE_DIR" "${WINDOW[@]}")
fi

set +e  # a failed run still gets its summary
echo "[train] torchrun --nproc-per-node $NPROC pretrain_gpt.py (device $DEVICE, pp $PP); log: $OUT/train.log"
PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
    "${DEMO_MODEL_ARGS[@]}" "${DEMO_DATA_ARGS[@]}" --device "$DEVICE" \
    --pipeline-model-parallel-size "$PP" --save "$OUT/checkpoints" --save-interval 50 "${TB[@]}" \
    "${TRACE_ARGS[@]}" "${PASS_THROUGH[@]}" 2>&1 | tee "$OUT/train.log" | grep --line-buffered -v "warnings.warn\|Unable to save"
status=${PIPESTATUS[0]}
set -e

failed="training"
[ "$status" -eq 0 ] && failed=""
if [ -n "$TRACE_DIR" ] && [ "$status" -eq 0 ]; then
    # The newest file's run: a --trace-dir of the user's may also hold files of earlier runs.
    newest=$(ls -t "$TRACE_DIR"/benchmark-data-*.json 2>/dev/null | head -n 1 || true)
    run_id=$(python -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["run_id"])' "$newest" 2>/dev/null || true)
    echo "[trace] python scripts/aggregate.py -b $TRACE_DIR -d ${run_id:+--run-id $run_id}"
    if ! python scripts/aggregate.py -b "$TRACE_DIR" -d ${run_id:+--run-id "$run_id"} 2>&1 | tee "$OUT/aggregate.log" \
            || [ ! -f "$TRACE_DIR/merged_trace.json" ]; then
        status=1 failed="aggregation (log: $OUT/aggregate.log)"
    fi
fi

# ---- summary ----
echo
if [ "$status" -ne 0 ]; then
    echo "run_single.sh: $failed FAILED (exit status $status); training log $OUT/train.log"
    ! compgen -G "${TRACE_DIR:-/nonexistent}/benchmark-data-*.json" >/dev/null || echo "  trace files in $TRACE_DIR; aggregate them with: python scripts/aggregate.py -b $TRACE_DIR -d"
    exit "$status"
fi
echo "outputs:"
echo "  training log   $OUT/train.log"
if [ -z "$TRACE_DIR" ]; then
    echo "  trace          none (TRACE=0); run without TRACE=0 to trace"
else
    echo "  merged trace   $TRACE_DIR/merged_trace.json  (open in https://ui.perfetto.dev or chrome://tracing)"
    verdict=$(grep -o -m 1 "verdict: [a-z]*" "$TRACE_DIR/detection.txt" 2>/dev/null || echo "verdict in")
    echo "  detection      $TRACE_DIR/report.html  ($verdict; $TRACE_DIR/detection.txt)"
fi
echo "  checkpoints    $OUT/checkpoints  (resume with: bash run_single.sh -- --load $OUT/checkpoints)"
[ ${#TB[@]} -gt 0 ] && echo "  tensorboard    tensorboard --logdir $OUT/tensorboard"
echo "  demo data      ${DATA_DIR:-data}/"
echo "next:"
echo "  bash run_single.sh -- --use-dpp                             # MegaDPP: dynamic pipeline order over shm_tensor_rdma"
echo "  bash run_single.sh -- --forward-backward-disaggregating     # MegaFBD: separate forward and backward ranks"
echo "  python -m megatron.scope serve --load $OUT/checkpoints   # MegaScope: watch the trained model generate"
exit "$status"
