"""Command-line flags (Megatron-LM names) and their translation into a RunConfig."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Sequence

from megatron.app import megatron_lm
from megatron.app.config import (
    ATTENTION_BACKENDS,
    ConfigError,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    format_layer_split,
    parse_layer_split,
)


def build_parser(plugins: Sequence = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Train megatron-core's GPTModel with tensor, pipeline and data parallelism.",
        allow_abbrev=False,
    )
    # Groups named and ordered as Megatron-LM's arguments.py names them; a flag sits in the
    # group where Megatron-LM puts it (this trainer's own flags where they fit best).
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, help="number of transformer layers (default %(default)s)")
    g.add_argument("--hidden-size", type=int, help="transformer hidden size (default %(default)s)")
    g.add_argument("--ffn-hidden-size", type=int,
                   help="hidden size of the MLP (default 4 x --hidden-size)")
    g.add_argument("--num-attention-heads", type=int,
                   help="number of attention heads (default %(default)s)")
    g.add_argument("--kv-channels", type=int, help="per-head dimension (default hidden / heads)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=None, help="key/value heads with --group-query-attention")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="positions the position embedding holds, in tokens (default --seq-length)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   help="learned absolute positions or rotary embeddings (default %(default)s)")
    g.add_argument("--rotary-base", type=int, help="RoPE base (with --position-embedding-type rope)")
    g.add_argument("--rotary-percent", type=float, help="fraction of each head's dims RoPE rotates")
    g.add_argument("--make-vocab-size-divisible-by", type=int,
                   help="pad the vocabulary up to a multiple of this many ids (default %(default)s)")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], help="norm layers")
    g.add_argument("--norm-epsilon", type=float, help="epsilon of the norm layers")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights stored as gamma - 1 (start at 0, applied as 1 + weight)")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU), as in Llama")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="give the output layer its own weights instead of sharing the input embedding's")

    g = parser.add_argument_group("regularization")
    g.add_argument("--attention-dropout", type=float,
                   help="dropout probability on the attention weights (default %(default)s)")
    g.add_argument("--hidden-dropout", type=float,
                   help="dropout probability at the end of each attention and MLP block (default %(default)s)")
    g.add_argument("--weight-decay", type=float,
                   help="AdamW decoupled weight-decay coefficient (default %(default)s)")
    g.add_argument("--clip-grad", type=float,
                   help="clip the global gradient L2 norm to this value; 0 turns clipping off (default %(default)s)")
    g.add_argument("--adam-beta1", type=float,
                   help="Adam coefficient of the gradient's running mean (default %(default)s)")
    g.add_argument("--adam-beta2", type=float,
                   help="Adam coefficient of the squared gradient's running mean (default %(default)s)")
    g.add_argument("--adam-eps", type=float,
                   help="term added to Adam's denominator for numerical stability (default %(default)s)")

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int,
                   help="samples per microbatch on each data-parallel rank (default %(default)s)")
    g.add_argument("--global-batch-size", type=int,
                   help="samples per optimizer step over all data-parallel ranks; the microbatches per step are "
                        "global / (micro x data-parallel size) (default %(default)s)")
    g.add_argument("--recompute-activations", action="store_true", help="same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: recompute whole layers in backward; selective: only the core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="with full: uniform = every layer in blocks of --recompute-num-layers; block = the first "
                        "--recompute-num-layers layers of each stage")
    g.add_argument("--recompute-num-layers", type=int, help="see --recompute-method")
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps (default 10)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train for this many samples instead: --train-iters = samples / global batch")
    g.add_argument("--log-interval", type=int,
                   help="print the loss and timing line every N iterations (default %(default)s)")
    g.add_argument("--exit-interval", type=int,
                   help="stop (after saving, if --save) once iteration %% N == 0")
    g.add_argument("--exit-duration-in-mins", type=float,
                   help="stop (after saving, if --save) once training has run this many minutes")
    g.add_argument("--tensorboard-dir",
                   help="write TensorBoard scalars (loss, learning rate, ...) to this directory (default: none)")
    g.add_argument("--optimizer", choices=["adam"], default="adam",
                   help="adam (AdamW with --weight-decay); the only optimizer here")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers, as in Llama")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"],
                   help="local: megatron-core's own layers (the only one here; transformer_engine is refused)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="weigh every token of the global batch equally: gradients of the summed token losses "
                        "divided by the global batch's token count (default: each microbatch's mean, averaged)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible runs on CUDA: deterministic kernels only (torch.use_deterministic_algorithms, "
                        "CUBLAS_WORKSPACE_CONFIG, megatron-core's deterministic embedding, NCCL_ALGO=Ring unless set); "
                        "slower. CPU runs are deterministic without it")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                   help="core attention kernel: flash or fused = torch's scaled_dot_product_attention (flash "
                        "kernel on CUDA with bf16/fp16, causal without reading the mask unless "
                        "--reset-attention-mask); unfused or local = megatron-core's DotProductAttention; "
                        "auto = the first on CUDA, the second on CPU (default %(default)s)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="where to train: auto = cuda when torch sees a GPU, else cpu; also picks the process-group "
                        "backend (cuda: nccl, cpu: gloo) (default %(default)s)")

    g = parser.add_argument_group("initialization")
    g.add_argument("--seed", type=int,
                   help="random seed of Python, NumPy and torch (weights, dropout, data order) (default %(default)s)")
    g.add_argument("--init-method-std", type=float,
                   help="standard deviation of the normal distribution weights start from (default %(default)s)")

    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float,
                   help="peak learning rate, reached after the warmup (default %(default)s)")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"],
                   help="shape of the decay from --lr to --min-lr after the warmup (default %(default)s)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="decay steps (default --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="decay in samples")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay steps (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warmup steps")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="warmup in samples")
    g.add_argument("--min-lr", type=float,
                   help="learning rate at the end of the decay and after it (default %(default)s)")
    g.add_argument("--decoupled-lr", type=float,
                   help="peak learning rate of the embedding and output layer (same warmup and decay shape)")
    g.add_argument("--decoupled-min-lr", type=float,
                   help="final learning rate of the embedding and output layer (default --min-lr)")

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save",
                   help="directory to write checkpoints to (every --save-interval, at the end and on exit); "
                        "default: no checkpoints")
    g.add_argument("--save-interval", type=int,
                   help="with --save: also save every N iterations (default: only at the end and on exit)")
    g.add_argument("--load",
                   help="resume from the latest checkpoint in DIR; a DIR without one starts from scratch")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop with an error when --load DIR holds no checkpoint")
    g.add_argument("--ckpt-step", type=int, metavar="N",
                   help="with --load: load iteration N (DIR/iter_N) instead of the latest one the tracker names; "
                        "each file is checked against the checkpoint's checksums")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "zarr", "fsdp_dtensor"], default="torch",
                   help="torch: per-rank torch files, the only format written here (others are reported "
                        "at start-up and written as torch)")

    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations with fp32 master weights and loss scaling")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    g.add_argument("--loss-scale", type=float, help="a fixed loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, help="first dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, help="the dynamic scale never goes below this")
    g.add_argument("--loss-scale-window", type=int,
                   help="iterations without overflow before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, help="overflows tolerated before the dynamic scale halves")

    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int,
                   help="ranks each layer's weights are split over (tensor parallelism) (default %(default)s)")
    g.add_argument("--pipeline-model-parallel-size", type=int,
                   help="pipeline stages the layers are split into (default %(default)s); the data-parallel size "
                        "is world size / (tensor x pipeline)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per model chunk for the interleaved schedule: each stage holds several chunks "
                        "(default: one chunk per stage)")
    g.add_argument("--pipeline-layer-split", type=parse_layer_split, metavar="N,N,...",
                   help="transformer layers on each pipeline stage, comma separated, stage 0 first: one entry per "
                        "stage, each >= 1, summing to --num-layers (e.g. 3,5 for 8 layers on 2 stages); with "
                        "virtual stages each stage's layers are split evenly over its chunks. A checkpoint saved "
                        "with another split is converted while loading (default: num_layers / pp on every stage)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int,
                   help="Megatron-LM's uneven split: layers on the first pipeline stage, the rest spread evenly "
                        "over the other stages (same as the matching --pipeline-layer-split)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int,
                   help="Megatron-LM's uneven split: layers on the last pipeline stage, the rest spread evenly "
                        "over the other stages (same as the matching --pipeline-layer-split)")
    g.add_argument("--pipeline-schedule",
                   choices=["auto", "1f1b", "interleaved", "gpipe", "zb-h1", "zb-h2", "megatron-core"],
                   help="pipeline order run by this trainer's executor; auto = interleaved with virtual stages, "
                        "else 1f1b. zb-h1 / zb-h2: zero-bubble orders, each backward split into the input "
                        "gradient (sent upstream at once) and the weight gradients (run later to fill the "
                        "pipeline's idle time); zb-h1 stores no more activations than 1f1b, zb-h2 stores more "
                        "for a smaller bubble; with virtual stages both interleave. megatron-core: "
                        "megatron-core's own get_forward_backward_func() (no pipelining, 1F1B or interleaved, by "
                        "the parallel sizes) drives each iteration, on CPU and CUDA alike")
    g.add_argument("--report-activation-memory", action="store_true",
                   help="measure what each rank keeps for backward (bytes of the tensors autograd saves, and of "
                        "pending weight-gradient work) and print its peak at the end of training")
    g.add_argument("--distributed-timeout-minutes", type=float,
                   help="timeout of the process group's collectives, in minutes (default %(default)s)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="CUDA: shard optimizer state over data-parallel ranks; on CPU reported as not used")

    g = parser.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int,
                   help="global batches of the validation set per evaluation (default %(default)s)")
    g.add_argument("--eval-interval", type=int,
                   help="evaluate on the validation set every N iterations; 0 = never (default %(default)s)")

    g = parser.add_argument_group("data and dataloader")
    g.add_argument("--data-path", nargs="*",
                   help="indexed dataset(s) as PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...] "
                        "(PREFIX.bin/.idx, as tools/preprocess_data.py writes them)")
    g.add_argument("--split",
                   help="train,validation,test weights the documents of --data-path are split by "
                        "(default %(default)s)")
    g.add_argument("--mock-data", action="store_true",
                   help="train on synthetic token sequences instead of --data-path")
    g.add_argument("--seq-length", type=int,
                   help="tokens per training sample (default %(default)s)")
    g.add_argument("--data-cache-path",
                   help="directory for the dataset's index caches (default: beside the data, megatron-core's "
                        "PREFIX/cache/GPTDataset_indices)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="restart position ids at 0 after every end-of-document token in a sample")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="a per-sample attention mask that keeps tokens from attending across end-of-document "
                        "tokens (builds the mask in the data loader)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="leave end-of-document tokens out of the loss")

    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type",
                   help="GPT2BPETokenizer, ByteLevelTokenizer or NullTokenizer (default: GPT2BPETokenizer with "
                        "--vocab-file and --merge-file; NullTokenizer with --mock-data)")
    g.add_argument("--vocab-file", help="GPT-2 BPE vocab.json (GPT2BPETokenizer)")
    g.add_argument("--merge-file", help="GPT-2 BPE merges.txt (GPT2BPETokenizer)")
    g.add_argument("--vocab-size", type=int, help="vocabulary size for --mock-data")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-throughput", action="store_true",
                   help="add model TFLOP/s per rank ('throughput per GPU') to the log line")

    megatron_lm.add_arguments(parser)

    parser.set_defaults(**{dest: value for dest, value in section_defaults().items()
                            if any(action.dest == dest for action in parser._actions)})
    for plugin in plugins:
        plugin.add_arguments(parser)
    return parser


# Config fields that no flag of the same name sets: the value comes from other flags (or the run).
_DERIVED: dict[type, tuple[str, ...]] = {
    # pipeline_layer_split: from --pipeline-layer-split or Megatron-LM's --decoder-first/last-pipeline-num-layers
    ParallelConfig: ("world_size", "pipeline_layer_split"),
    ModelConfig: ("max_position_embeddings", "vocab_size", "num_query_groups", "add_bias_linear",
                  "recompute_granularity", "cuda"),
    OptimizerConfig: ("lr_warmup_iters", "lr_decay_iters"),
    TrainingConfig: ("train_iters",),
    CheckpointConfig: (),
    LoggingConfig: (),
    # The run's sizes the datasets are built for, from the training and model sections.
    DataConfig: ("seq_length", "seed", "micro_batch_size", "global_batch_size", "data_parallel_size",
                 "train_iters", "eval_iters", "eval_interval", "create_attention_mask"),
}


def section_defaults() -> dict[str, object]:
    """Flag dest -> default, from the config sections: a flag mirroring a config field takes the
    field's default, so each default is written once (in megatron/app/config.py)."""
    defaults: dict[str, object] = {}
    for section, derived in _DERIVED.items():
        for item in dataclasses.fields(section):
            if item.name in derived or item.default is dataclasses.MISSING:
                continue
            if item.name in defaults and defaults[item.name] != item.default:
                raise AssertionError(f"config field {item.name} has two defaults: {defaults[item.name]!r} and "
                                     f"{item.default!r} ({section.__name__})")
            defaults[item.name] = item.default
    return defaults


def _section(section: type, args: argparse.Namespace, **derived):
    """One config section: every field from the flag of the same name, except the derived ones."""
    expected = set(_DERIVED[section])
    if set(derived) != expected:
        raise AssertionError(f"{section.__name__}: derived fields {sorted(derived)} != {sorted(expected)}")
    values = {item.name: getattr(args, item.name) for item in dataclasses.fields(section)
              if item.name not in expected and hasattr(args, item.name)}
    return section(**values, **derived)


def config_from_args(args: argparse.Namespace, world_size: int | None = None) -> RunConfig:
    """Translate parsed flags into the typed config (no validation here; see config.validate)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    train_iters, warmup_iters, decay_iters = _iteration_counts(args)
    training = _section(TrainingConfig, args, train_iters=train_iters)
    model = _section(
        ModelConfig, args,
        max_position_embeddings=args.max_position_embeddings or args.seq_length,
        vocab_size=0,  # filled from the tokenizer
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        add_bias_linear=not args.disable_bias_linear,
        recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
        cuda=_trains_on_cuda(args.device),
    )
    return RunConfig(
        parallel=_section(ParallelConfig, args, world_size=world_size, pipeline_layer_split=_layer_split(args)),
        model=model,
        optimizer=_section(OptimizerConfig, args, lr_warmup_iters=warmup_iters, lr_decay_iters=decay_iters),
        training=training,
        checkpoint=_section(CheckpointConfig, args),
        logging=_section(LoggingConfig, args),
        data=_section(DataConfig, args, seq_length=model.seq_length, seed=training.seed,
                      micro_batch_size=training.micro_batch_size, global_batch_size=training.global_batch_size,
                      data_parallel_size=1,  # set by the data builder, once plugins have fixed the layout
                      train_iters=train_iters, eval_iters=training.eval_iters,
                      eval_interval=training.eval_interval or None,
                      create_attention_mask=args.reset_attention_mask),  # the mask is what gets reset
        args=args,
    )


def _trains_on_cuda(device: str) -> bool:
    """--device resolved as the trainer resolves it (device.resolve_device, which also refuses cuda
    without a GPU): auto is cuda when torch sees a GPU."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def _layer_split(args: argparse.Namespace) -> list[int] | None:
    """The pipeline layer split: --pipeline-layer-split as given, or Megatron-LM's first / last stage
    counts with the remaining layers spread evenly over the other stages (None: the even split)."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return args.pipeline_layer_split
    named = " and ".join(flag for flag, value in (("--decoder-first-pipeline-num-layers", first),
                                                   ("--decoder-last-pipeline-num-layers", last)) if value is not None)
    if args.pipeline_layer_split is not None:
        raise ConfigError(f"--pipeline-layer-split and {named} both set the layers per stage; pass one")
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    ends = [n for n in (first, last) if n is not None]
    if pp < max(2, len(ends)):
        raise ConfigError(f"{named} {'need' if len(ends) > 1 else 'needs'} --pipeline-model-parallel-size >= "
                          f"{max(2, len(ends))}, got {pp}")
    if any(n < 1 for n in ends):
        raise ConfigError(f"{named}: every stage needs at least 1 layer")
    others = pp - len(ends)
    rest = layers - sum(ends)
    if others == 0:
        split = [first, last]
    else:
        if rest < others or rest % others != 0:
            raise ConfigError(
                f"{named}: the remaining {rest} of the {layers} layers (--num-layers) do not spread evenly over "
                f"the other {others} pipeline stage(s); change the counts, or give every stage's layers with "
                f"--pipeline-layer-split")
        split = [first] if first is not None else []
        split += [rest // others] * others + ([last] if last is not None else [])
    if sum(split) != layers:
        raise ConfigError(f"{named} give a split {format_layer_split(split)} that sums to {sum(split)}, but "
                          f"--num-layers is {layers}; change the counts")
    return split


def _iteration_counts(args: argparse.Namespace) -> tuple[int, int, int | None]:
    """(train iters, warmup iters, decay iters) from Megatron-LM's iteration-, sample- or
    fraction-based flags; a fixed global batch turns samples into iterations."""
    batch = max(1, args.global_batch_size)
    if args.train_samples is not None and args.train_iters is not None:
        raise ConfigError("--train-iters and --train-samples were both given; pass one")
    train_iters = args.train_iters if args.train_iters is not None else (
        args.train_samples // batch if args.train_samples is not None else TrainingConfig().train_iters)
    decay_iters = args.lr_decay_iters
    if args.lr_decay_samples is not None:
        if decay_iters is not None:
            raise ConfigError("--lr-decay-iters and --lr-decay-samples were both given; pass one")
        decay_iters = args.lr_decay_samples // batch
    warmups = [name for name, value in (("--lr-warmup-iters", args.lr_warmup_iters or None),
                                        ("--lr-warmup-fraction", args.lr_warmup_fraction),
                                        ("--lr-warmup-samples", args.lr_warmup_samples)) if value is not None]
    if len(warmups) > 1:
        raise ConfigError(f"{' and '.join(warmups)} were all given; pass one way of setting the warmup")
    warmup_iters = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup_iters = int(args.lr_warmup_fraction * (decay_iters or train_iters))
    elif args.lr_warmup_samples is not None:
        warmup_iters = args.lr_warmup_samples // batch
    return train_iters, warmup_iters, decay_iters

