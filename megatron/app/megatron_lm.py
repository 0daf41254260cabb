"""Megatron-LM command lines: the flags this trainer accepts without using, and those it refuses.

A Megatron-LM GPT or Llama script passes many flags that only pick a GPU kernel or tune
communication; they are accepted and reported once at start-up as not used. Flags asking for
something this trainer does not do stop the run before any work, naming the flag and what to use
instead. Flags that change training are honoured by the trainer's own arguments (arguments.py).
docs/trainer.md keeps the table of all three; a test checks that every flag here is in it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Flag:
    name: str
    why: str  # not used: what it would have done; refused: what to use instead
    kwargs: dict = field(default_factory=lambda: {"action": "store_true"})
    # Refused flags: refused when this is true of the parsed value (default: given at all).
    refuse_if: Callable[[Any], bool] | None = None


def _value(**kwargs) -> dict:
    return {"default": None, **kwargs}


# Picks a kernel, a memory/communication optimisation or a logging detail; the result of training
# is the same without it.
NOT_USED: tuple[Flag, ...] = (
    Flag("--use-flash-attn", "selects FlashAttention (Megatron-LM's older flag); here --attention-backend "
         "flash picks torch's scaled_dot_product_attention"),
    Flag("--no-masked-softmax-fusion", "turns off a fused softmax kernel; none is used here"),
    Flag("--no-bias-gelu-fusion", "turns off megatron-core's compiled bias+GeLU fusion; it is off here (on an "
         "H200 it made short runs slower)"),
    Flag("--no-bias-swiglu-fusion", "turns off megatron-core's compiled bias+SwiGLU fusion; it is off here"),
    Flag("--no-bias-dropout-fusion", "turns off megatron-core's compiled bias+dropout+add fusion; it is off here"),
    Flag("--no-rope-fusion", "turns off the fused RoPE kernel; none is used here"),
    Flag("--no-gradient-accumulation-fusion", "turns off fused weight-gradient accumulation; none is used here"),
    Flag("--no-persist-layer-norm", "turns off the persistent LayerNorm kernel; none is used here"),
    Flag("--cross-entropy-loss-fusion", "selects a fused cross-entropy kernel"),
    Flag("--no-async-tensor-model-parallel-allreduce", "overlap of a TP all-reduce with compute"),
    Flag("--overlap-grad-reduce", "overlaps the data-parallel gradient reduction with backward"),
    Flag("--overlap-param-gather", "overlaps the distributed optimizer's parameter all-gather"),
    Flag("--sequence-parallel", "splits LayerNorm/dropout activations over TP ranks to save memory; the local "
         "spec's torch norms do not support it, and the results are the same without it"),
    Flag("--use-mcore-models", "megatron-core's GPTModel is the only model here"),
    Flag("--no-position-embedding", "no learned positions; with --position-embedding-type rope there are none"),
    Flag("--distributed-backend", "the process-group backend; --device picks it (cuda: nccl, cpu: gloo)",
         _value(choices=["nccl", "gloo", "ucc"])),
    Flag("--num-workers", "data-loader worker processes; microbatches are read in the training process",
         _value(type=int)),
    Flag("--dataloader-type", "sampler kind; this trainer's sampler is Megatron's single pass",
         _value(choices=["single", "cyclic", "external"])),
    Flag("--no-create-attention-mask-in-dataloader", "the causal mask is always passed explicitly here"),
    Flag("--no-mmap-bin-files", "how the indexed dataset's .bin is read"),
    Flag("--manual-gc", "Python garbage collection on a schedule"),
    Flag("--manual-gc-interval", "Python garbage collection interval", _value(type=int)),
    Flag("--empty-unused-memory-level", "releases cached CUDA memory", _value(type=int)),
    Flag("--grad-reduce-in-bf16", "reduces gradients in bf16; they are reduced in fp32 here"),
    Flag("--no-ckpt-fully-parallel-save", "distributed checkpoint save strategy; checkpoints here are "
         "per-rank torch files"),
    Flag("--ckpt-fully-parallel-load", "distributed checkpoint load strategy"),
    Flag("--async-save", "asynchronous distributed checkpoint save"),
    Flag("--log-timers-to-tensorboard", "timer scalars in TensorBoard"),
    Flag("--log-validation-ppl-to-tensorboard", "validation perplexity in TensorBoard"),
    Flag("--log-memory-to-tensorboard", "memory scalars in TensorBoard"),
    Flag("--log-params-norm", "parameter norm in the log line"),
    Flag("--log-num-zeros-in-grad", "zero count of the gradient in the log line"),
    Flag("--timing-log-level", "Megatron timers' detail; MegaScan's --trace records the spans",
         _value(type=int)),
    Flag("--profile", "PyTorch/nsys profiling window; use MegaScan's --trace"),
    Flag("--profile-step-start", "profiling window start", _value(type=int)),
    Flag("--profile-step-end", "profiling window end", _value(type=int)),
    Flag("--use-pytorch-profiler", "PyTorch profiler; use MegaScan's --trace"),
    Flag("--tiktoken-pattern", "TikToken split pattern", _value()),
    Flag("--attention-softmax-in-fp32", "the local attention's softmax already runs in float32"),
    Flag("--wandb-project", "Weights & Biases logging is not wired in; use --tensorboard-dir", _value()),
    Flag("--wandb-exp-name", "see --wandb-project", _value()),
    Flag("--wandb-save-dir", "see --wandb-project", _value()),
)

REFUSED: tuple[Flag, ...] = (
    Flag("--rampup-batch-size", "batch-size ramp-up is not supported; train with a fixed --global-batch-size",
         _value(nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))),
    Flag("--context-parallel-size", "context parallelism is not supported; use --context-parallel-size 1 "
         "(or leave it out) and split the sequence with TP/PP instead",
         _value(type=int), refuse_if=lambda v: v is not None and v != 1),
    Flag("--expert-model-parallel-size", "mixture-of-experts is not supported (dense GPT/Llama only); leave "
         "--expert-model-parallel-size at 1", _value(type=int), refuse_if=lambda v: v is not None and v != 1),
    Flag("--num-experts", "mixture-of-experts is not supported (dense GPT/Llama only); drop --num-experts and "
         "the --moe-* flags", _value(type=int)),
    Flag("--use-torch-fsdp2", "FSDP2 is not supported; use data parallelism (the default) with TP/PP"),
    Flag("--use-custom-fsdp", "megatron-core FSDP is not supported; use data parallelism with TP/PP"),
    Flag("--spec", "custom layer specs are not supported; the local spec (with --normalization, --swiglu) is used",
         _value(nargs="+")),
    Flag("--yaml-cfg", "YAML configs are not read; pass the flags on the command line", _value()),
    Flag("--no-load-optim", "a resume here always restores the optimizer; drop --no-load-optim"),
    Flag("--no-load-rng", "a resume here always restores the RNG state; drop --no-load-rng"),
    Flag("--no-save-optim", "checkpoints here always hold the optimizer (resuming must be exact); drop it"),
    Flag("--no-save-rng", "checkpoints here always hold the RNG state (resuming must be exact); drop it"),
    Flag("--use-checkpoint-args", "the model flags are taken from the command line; a checkpoint whose layout "
         "differs is refused with the difference named"),
)

# Whole families of flags, refused by their prefix before argparse sees them.
REFUSED_PREFIXES: dict[str, str] = {
    "--moe-": "mixture-of-experts is not supported (dense GPT/Llama only); drop the --moe-* and --num-experts flags",
    "--fp8": "FP8 training needs Transformer Engine, which this trainer does not use; train with --bf16 or --fp16",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM flags accepted but not used here (reported at start-up)")
    for flag in NOT_USED:
        group.add_argument(flag.name, help=f"not used: {flag.why}", **flag.kwargs)
    group = parser.add_argument_group("Megatron-LM flags refused here (the run stops before any work)")
    for flag in REFUSED:
        group.add_argument(flag.name, help=f"refused: {flag.why}", **flag.kwargs)


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def _given(value: Any) -> bool:
    return value not in (None, False)


def not_used(args: argparse.Namespace) -> list[str]:
    """The accepted-but-unused flags this command line passed, each with why."""
    notes = [f"{f.name} ({f.why})" for f in NOT_USED if _given(getattr(args, _dest(f.name), None))]
    if getattr(args, "ckpt_format", "torch") != "torch":
        notes.append(f"--ckpt-format {args.ckpt_format} (checkpoints are written as per-rank torch files, "
                     "iter_N/mp_rank_TT_PPP/model_optim_rng.pt, i.e. --ckpt-format torch)")
    return notes


def refusals(args: argparse.Namespace) -> list[str]:
    problems = []
    for flag in REFUSED:
        value = getattr(args, _dest(flag.name), None)
        refused = flag.refuse_if(value) if flag.refuse_if is not None else _given(value)
        if refused:
            problems.append(f"{flag.name}: {flag.why}")
    return problems


def refused_prefixes(argv: Sequence[str]) -> list[str]:
    problems = []
    for prefix, why in REFUSED_PREFIXES.items():
        named = sorted({token.split("=", 1)[0] for token in argv if token.startswith(prefix)})
        if named:
            problems.append(f"{', '.join(named)}: {why}")
    return problems
