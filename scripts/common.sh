# Shared by run_single.sh / run_master.sh / run_worker.sh (and scripts/run_tests.sh): environment
# set-up and the demo training arguments. Sourced, not executed.

# $VENV (default .venv) created and activated unless a virtual environment is active, with torch
# installed first so that no later resolver pulls a different build.
activate_environment() {
    local venv="${VENV:-.venv}"
    if [ -z "${VIRTUAL_ENV:-}" ]; then
        [ -x "$venv/bin/python" ] || { echo "[setup] creating virtual environment $venv"; python3 -m venv "$venv"; }
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
    fi
    # Checks by metadata, not by import: importing torch and megatron-core costs seconds.
    if ! python -c "import importlib.util as u; assert u.find_spec('torch')" 2>/dev/null; then
        echo "[setup] installing torch==${TORCH_VERSION:-2.13.0}"
        python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
    fi
}

# Install what the trainer needs into $VENV unless it is already there (REBUILD=1: reinstall).
ensure_environment() {
    activate_environment
    if [ -n "${REBUILD:-}" ] || ! python -c "import importlib.metadata as m; m.version('megatron-app'); m.version('megatron-core')" 2>/dev/null; then
        echo "[setup] installing megatron-app (and megatron-core) from $(pwd)"
        python -m pip install -q -e .
    fi
}

# The embedded demo corpus: Python standard-library docstrings, a BPE trained on them, and the
# Megatron indexed dataset; made once under $DATA_DIR (default data/).
prepare_demo_data() {
    local data="${DATA_DIR:-data}"
    if [ ! -f "$data/corpus_text_document.idx" ]; then
        echo "[data] building the demo corpus in $data/"
        python -m megatron.app.corpus --output "$data/corpus.jsonl" --train-tokenizer "$data/tokenizer" --vocab-size 4096
        python tools/preprocess_data.py --input "$data/corpus.jsonl" --output-prefix "$data/corpus" \
            --tokenizer-type GPT2BPETokenizer --vocab-file "$data/tokenizer/vocab.json" \
            --merge-file "$data/tokenizer/merges.txt" --append-eod --workers 2
    fi
    DEMO_DATA_ARGS=(--data-path "$data/corpus_text_document" --tokenizer-type GPT2BPETokenizer
        --vocab-file "$data/tokenizer/vocab.json" --merge-file "$data/tokenizer/merges.txt"
        --data-cache-path "$data/cache" --split 98,2,0)
}

DEMO_MODEL_ARGS=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
    --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 32 --train-iters 100
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.01 --clip-grad 1.0
    --log-interval 10 --eval-interval 50 --eval-iters 2)

gpu_count() {
    python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
}
