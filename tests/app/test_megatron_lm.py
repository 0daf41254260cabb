"""Megatron-LM command lines run here as its example scripts write them, with only the sizes shrunk
(layers, hidden size, batch, iterations, vocabulary, paths): the GPT one (examples/gpt3's 857M
script's flags, plus the recompute, throughput, backend and checkpoint-format flags of its other
GPT scripts) with --fp16 from its default loss scale of 2^32, saved and resumed through the same
--save/--load directory; the Llama-3 8B bf16 one (its mock-data branch), whose TP=2 x PP=2 loss
curve equals one rank's. The FP8 Llama script is refused before any work, naming each flag. Every
Megatron-LM flag this trainer knows of is in docs/trainer.md's table."""
from __future__ import annotations

import re

import pytest

from launch import ROOT as ROOT_DIR
from launch import python, torchrun
from logparse import losses, validation_losses

SKIPPED = re.compile(r"iteration\s+(\d+)/.*?loss scale: ([0-9.]+) \|.*?number of skipped iterations:\s+(\d) \|")


def gpt_command(corpus: dict, checkpoints, tensorboard, iterations: int) -> list[str]:
    return [
        # GPT_MODEL_ARGS
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iterations),
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
        "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-4", "--lr-decay-style", "cosine", "--min-lr", "6.0e-5",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        # DATA_ARGS (no --tokenizer-type: the vocab and merge files mean GPT-2 BPE)
        "--data-path", corpus["data_path"], "--vocab-file", corpus["vocab_file"], "--merge-file", corpus["merge_file"],
        "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "12", "--eval-interval", "12", "--save", str(checkpoints),
        "--load", str(checkpoints), "--eval-iters", "2", "--tensorboard-dir", str(tensorboard),
        # from Megatron-LM's other GPT scripts
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--log-throughput", "--distributed-backend", "nccl", "--ckpt-format", "torch", "--no-ckpt-fully-parallel-save",
        "--transformer-impl", "local", "--device", "cpu",
    ]


@pytest.mark.slow  # 25-56 s on 2 cores
def test_gpt_command_line_fp16_save_and_resume(demo_corpus, tmp_path):
    checkpoints, tensorboard = tmp_path / "checkpoints", tmp_path / "tensorboard"
    proc = torchrun("pretrain_gpt.py", gpt_command(demo_corpus, checkpoints, tensorboard, 24), nproc=4, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "warning: no checkpoint to load in --load" in out  # the first run of a save/load script
    assert "--no-ckpt-fully-parallel-save (distributed checkpoint" in out and "--distributed-backend" in out
    steps = [(int(i), float(scale), int(skipped)) for i, scale, skipped in SKIPPED.findall(out)]
    assert [i for i, _, _ in steps] == list(range(1, 25))
    # Dynamic loss scaling from 2^32: overflowing steps are skipped and halve the scale (the first
    # after --hysteresis 2 of them), until steps succeed at a scale fp16 can hold.
    assert steps[0] == (1, 2.0 ** 32, 1)
    updated = [i for i, _, skipped in steps if not skipped]
    assert updated and updated[-1] == 24 and 5 < updated[0] < 24, steps
    assert all(scale < 2.0 ** 24 for i, scale, _ in steps if i >= updated[0])
    assert "throughput per GPU (TFLOP/s/GPU):" in out
    assert set(validation_losses(out)) == {12, 24}
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "24"
    assert any(tensorboard.iterdir())

    # The same script again with more iterations: it resumes where the checkpoint left off.
    resumed = torchrun("pretrain_gpt.py", gpt_command(demo_corpus, checkpoints, tensorboard, 28), nproc=4,
                       timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"loaded checkpoint from {checkpoints} at iteration 24" in resumed.stdout
    assert sorted(losses(resumed.stdout)) == [25, 26, 27, 28]


def llama_command(tmp_path, layout: list[str]) -> list[str]:
    """examples/llama/train_llama3_8b_h200_bf16.sh with MOCK data, sizes shrunk."""
    return [
        # MODEL_ARGS
        "--use-mcore-models", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "48", "--lr-decay-samples", "40",
        "--lr-warmup-samples", "8", "--lr", "0.0015", "--min-lr", "0.0001", "--decoupled-lr", "5.0e-3",
        "--decoupled-min-lr", "4.5e-4", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        # MODEL_PARALLEL_ARGS (sizes: the script's TP=1, CP=1 on 8 GPUs)
        *layout, "--context-parallel-size", "1", "--sequence-parallel",
        # DDP_ARGS
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # DATA_ARGS_LIST (MOCK)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
        "--data-cache-path", str(tmp_path / "cache"), "--tiktoken-pattern", "v2", "--split", "99,1,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
        "--profile-step-end", "6", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
        "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb"),
        "--wandb-project", "megatron-lm-training", "--wandb-exp-name", "llama3x-8b-bf16-tp1",
        "--wandb-save-dir", str(tmp_path / "wandb"), "--log-params-norm", "--log-num-zeros-in-grad",
        "--log-timers-to-tensorboard", "--device", "cpu",
    ]


def test_llama_command_line_tp2_pp2_equals_one_rank(tmp_path):
    one = torchrun("pretrain_gpt.py", llama_command(tmp_path / "one", []), nproc=1, timeout=400)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    four = torchrun("pretrain_gpt.py", llama_command(tmp_path / "four", ["--tensor-model-parallel-size", "2",
                                                                            "--pipeline-model-parallel-size", "2"]),
                    nproc=4, timeout=400)
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]
    for flag in ("--ckpt-format torch_dist", "--sequence-parallel", "--use-distributed-optimizer", "--wandb-project"):
        assert flag in four.stdout, flag  # reported once as not used
    curve_one = {i: float(v) for i, v in losses(one.stdout).items()}
    curve_four = {i: float(v) for i, v in losses(four.stdout).items()}
    assert sorted(curve_one) == list(range(1, 7))  # --train-samples 48 / --global-batch-size 8
    # bf16 activations: the TP all-reduces sum in another order than one rank's matmuls.
    assert curve_four == pytest.approx(curve_one, rel=2e-3), (curve_one, curve_four)
    assert curve_one[6] < curve_one[1]
    assert (tmp_path / "four" / "ckpt" / "latest_checkpointed_iteration.txt").is_file()


def test_fp8_llama_script_is_refused_before_any_work():
    proc = python(["pretrain_gpt.py", "--mock-data", "--vocab-size", "255", "--fp8-format", "hybrid",
                   "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
                   "--num-experts", "8", "--moe-router-topk", "2", "--context-parallel-size", "2",
                   "--rampup-batch-size", "16", "16", "100"], timeout=120)
    assert proc.returncode == 2
    err = proc.stderr
    assert "--fp8-amax-compute-algo, --fp8-amax-history-len, --fp8-format, --fp8-param-gather: FP8 training needs " \
           "Transformer Engine" in err
    assert "--moe-router-topk: mixture-of-experts is not supported" in err
    assert "iteration" not in proc.stdout and "Traceback" not in err
    # Without the prefixed families the rest is refused by name, all at once.
    proc = python(["pretrain_gpt.py", "--mock-data", "--vocab-size", "255", "--num-experts", "8",
                   "--context-parallel-size", "2", "--rampup-batch-size", "16", "16", "100",
                   "--transformer-impl", "transformer_engine"], timeout=120)
    assert proc.returncode == 2
    for text in ("--num-experts: mixture-of-experts", "--context-parallel-size: context parallelism is not supported",
                 "--rampup-batch-size: batch-size ramp-up is not supported",
                 "--transformer-impl transformer_engine needs Transformer Engine"):
        assert text in proc.stderr, text


def test_every_known_megatron_lm_flag_is_in_the_docs_table():
    from megatron.app import megatron_lm
    from megatron.app.arguments import build_parser

    table = (ROOT_DIR / "docs" / "trainer.md").read_text()
    section = table[table.index("## Megatron-LM command lines"):]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[a-z0-9-]+)[^`]*` \| ([a-z, -]+) \|", section, re.M)}
    for flag in megatron_lm.NOT_USED:
        assert rows.get(flag.name) == "accepted, not used", flag.name
    for flag in megatron_lm.REFUSED:
        assert rows.get(flag.name) == "refused", flag.name
    for prefix in megatron_lm.REFUSED_PREFIXES:
        assert any(name.startswith(prefix) and status == "refused" for name, status in rows.items()), prefix
    honoured = {name for name, status in rows.items() if status == "honoured"}
    parser_flags = {option for action in build_parser([])._actions for option in action.option_strings}
    assert honoured and honoured <= parser_flags, sorted(honoured - parser_flags)


GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|")


@pytest.mark.parametrize("variant,rel", [
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], 0.0),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"], 0.0),
    (["--recompute-granularity", "selective"], 0.0),
    (["--fp16", "--initial-loss-scale", "4096"], 5e-3),
], ids=["full-uniform", "full-block", "selective", "fp16"])
def test_recompute_and_fp16_follow_the_plain_run(variant, rel, plain_run):
    proc = torchrun("pretrain_gpt.py", [*PLAIN, *variant], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [(float(loss), float(norm)) for _, loss, norm in GRAD_NORM.findall(proc.stdout)]
    assert len(got) == len(plain_run) == 6
    if rel == 0.0:  # recomputation repeats the same arithmetic: the printed numbers are the same
        assert got == plain_run
    else:
        flat = [value for pair in got for value in pair]
        assert flat == pytest.approx([value for pair in plain_run for value in pair], rel=rel), (got, plain_run)


PLAIN = ["--tensor-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "256",
         "--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--device", "cpu"]


@pytest.fixture(scope="module")
def plain_run():
    proc = torchrun("pretrain_gpt.py", PLAIN, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [(float(loss), float(norm)) for _, loss, norm in GRAD_NORM.findall(proc.stdout)]
