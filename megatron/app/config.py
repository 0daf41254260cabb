"""Typed run configuration, built once from the command line and validated up front.

Every component gets its own small dataclass; nothing reads a global args object. The sections
are frozen: the one change after the command line, a plugin's `configure_layout`, returns a new
config (`dataclasses.replace`), before `validate`. The module is
over 400 lines because those sections and `validate`, which checks them together (every problem
named at once, before any work), belong in one place.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field


# --attention-backend (Megatron-LM's choices): flash and fused run torch's scaled_dot_product_attention
# (megatron/app/attention.py), unfused and local megatron-core's DotProductAttention, auto the first on
# CUDA and the second on CPU.
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


class ConfigError(ValueError):
    """The launch configuration cannot work; the message lists every problem found."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    # Transformer layers per pipeline stage, one entry per stage (--pipeline-layer-split 3,5);
    # None: num_layers / pp on every stage.
    pipeline_layer_split: list[int] | None = None
    world_size: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    def virtual_chunks(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (1 without a virtual pipeline): num_layers / (pp x
        --num-layers-per-virtual-pipeline-stage), the same on every stage whatever the split."""
        if not self.num_layers_per_virtual_pipeline_stage:
            return 1
        per_stage = num_layers // self.pipeline_model_parallel_size
        return per_stage // self.num_layers_per_virtual_pipeline_stage

    def layers_per_stage(self, num_layers: int) -> list[int]:
        """Transformer layers held by each pipeline stage, stage 0 first (the split, or the even one)."""
        if self.pipeline_layer_split is not None:
            return [int(n) for n in self.pipeline_layer_split]
        pp = self.pipeline_model_parallel_size
        return [num_layers // pp] * pp

    def layers_per_chunk(self, num_layers: int) -> list[list[int]]:
        """[stage][local chunk] -> layers in that model chunk: each stage's layers split evenly
        over its virtual chunks (config.validate checks that they divide)."""
        return chunk_layers(self.layers_per_stage(num_layers), self.virtual_chunks(num_layers))

    def first_layer(self, num_layers: int, stage: int, chunk: int = 0) -> int:
        """Global index (0-based) of the first layer of a stage's local model chunk."""
        return first_layer_of(self.layers_per_chunk(num_layers), stage, chunk)


def chunk_layers(split, num_chunks: int) -> list[list[int]]:
    """Layers per stage (`split`) -> [stage][local chunk] layers, each stage's split evenly."""
    num_chunks = max(1, num_chunks)
    return [[int(n) // num_chunks] * num_chunks for n in split]


def first_layer_of(sizes: list[list[int]], stage: int, chunk: int = 0) -> int:
    """Global index of the first layer of (stage, chunk) given [stage][chunk] layer counts: the
    model runs virtual stage chunk x pp + stage after virtual stage chunk x pp + stage - 1."""
    pp = len(sizes)
    return sum(sizes[s][c] for c in range(chunk + 1) for s in range(pp if c < chunk else stage))


def locate_layer(sizes: list[list[int]], layer: int) -> tuple[int, int, int]:
    """(stage, local chunk, index in the chunk) of global layer `layer` given [stage][chunk] counts."""
    start = 0
    for chunk in range(len(sizes[0])):
        for stage, per_chunk in enumerate(sizes):
            if layer < start + per_chunk[chunk]:
                return stage, chunk, layer - start
            start += per_chunk[chunk]
    raise ValueError(f"layer {layer} is outside the model's {start} layers")


def parse_layer_split(text: str) -> list[int]:
    """`--pipeline-layer-split 3,5` -> [3, 5] (argparse type: a malformed value is a usage error)."""
    parts = [part.strip() for part in str(text).split(",")]
    if not parts or any(not part.lstrip("-").isdigit() for part in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of layer counts, one per pipeline stage (e.g. 3,5)")
    return [int(part) for part in parts]


def format_layer_split(split) -> str:
    return ",".join(str(n) for n in split)


def layer_split_problems(parallel: ParallelConfig, num_layers: int) -> list[str]:
    """What is wrong with the pipeline layer split (empty when it fits the model and the pipeline)."""
    pp, split = parallel.pipeline_model_parallel_size, parallel.pipeline_layer_split
    if split is None:
        if num_layers % pp != 0:
            return [f"num_layers({num_layers}) is not divisible by pipeline stages pp({pp}); use a multiple of "
                    f"{pp} for --num-layers, or give each stage's layers with --pipeline-layer-split"]
        return []
    shown = format_layer_split(split)
    problems = []
    if len(split) != pp:
        problems.append(f"--pipeline-layer-split {shown} has {len(split)} entries but there are pp({pp}) pipeline "
                        f"stages; give one layer count per stage")
    if sum(split) != num_layers:
        problems.append(f"--pipeline-layer-split {shown} sums to {sum(split)}, but the sum must be "
                        f"--num-layers ({num_layers})")
    if any(n < 1 for n in split):
        problems.append(f"--pipeline-layer-split {shown}: every stage needs at least 1 layer")
    vpp_layers = parallel.num_layers_per_virtual_pipeline_stage
    if not problems and vpp_layers and vpp_layers >= 1 and pp > 1:
        if num_layers % (pp * vpp_layers) != 0:
            problems.append(
                f"--pipeline-layer-split with --num-layers-per-virtual-pipeline-stage {vpp_layers}: every stage "
                f"holds num_layers({num_layers}) / (pp({pp}) x {vpp_layers}) model chunks, which must be a whole "
                f"number; change --num-layers-per-virtual-pipeline-stage")
        else:
            chunks = parallel.virtual_chunks(num_layers)
            uneven = [f"stage {s}: {n}" for s, n in enumerate(split) if n % chunks != 0]
            if uneven:
                problems.append(
                    f"--pipeline-layer-split {shown} with {chunks} virtual chunks per stage (num_layers({num_layers}) "
                    f"/ (pp({pp}) x --num-layers-per-virtual-pipeline-stage {vpp_layers})): each stage's layers "
                    f"are split evenly over its chunks, so every entry must be a multiple of {chunks} "
                    f"({', '.join(uneven)})")
    return problems


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    seq_length: int = 128
    max_position_embeddings: int = 128
    vocab_size: int = 0  # filled from the tokenizer
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    bf16: bool = False
    fp16: bool = False
    transformer_impl: str = "local"
    deterministic_mode: bool = False
    # Llama-style architecture (Megatron-LM flags --swiglu, --normalization, --norm-epsilon,
    # --rotary-base, --rotary-percent, --group-query-attention --num-query-groups, --kv-channels,
    # --disable-bias-linear)
    swiglu: bool = False
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    num_query_groups: int | None = None
    kv_channels: int | None = None
    add_bias_linear: bool = True
    apply_layernorm_1p: bool = False  # norm weights stored as gamma - 1 (zero-centred)
    # --calculate-per-token-loss: gradients of the loss summed over every token of the global
    # batch, divided by the global batch's token count (instead of a mean per microbatch)
    calculate_per_token_loss: bool = False
    # Activation recomputation (--recompute-granularity/-method/-num-layers)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # The core attention kernel (Megatron-LM's --attention-backend): it changes speed, and results
    # only within rounding. `auto` follows `cuda`; see megatron/app/attention.py.
    attention_backend: str = "auto"
    cuda: bool = False  # derived: the run trains on CUDA (--device cuda, or auto with a GPU)
    # --reset-attention-mask: the attention mask differs per sample (documents); without it the
    # model is only ever given the plain causal mask, which the SDPA attention then does not read.
    reset_attention_mask: bool = False

    @property
    def params_dtype(self):
        """The dtype of parameters and activations (--bf16, --fp16, else fp32)."""
        import torch

        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def sdpa_attention(self) -> bool:
        """The core attention is torch's scaled_dot_product_attention (megatron/app/attention.py):
        --attention-backend flash or fused, or auto on CUDA; else megatron-core's DotProductAttention."""
        return self.attention_backend in ("flash", "fused") or (self.attention_backend == "auto" and self.cuda)

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return ((self.vocab_size + multiple - 1) // multiple) * multiple


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    bf16: bool = False
    # --fp16: dynamic loss scaling (a fixed scale when loss_scale is set)
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    # --decoupled-lr / --decoupled-min-lr: the embedding and output layer's own peak and final LR
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 8
    train_iters: int = 10
    seed: int = 1234
    log_interval: int = 1
    eval_interval: int = 0
    eval_iters: int = 0
    pipeline_schedule: str = "auto"
    report_activation_memory: bool = False
    device: str = "auto"
    distributed_timeout_minutes: float = 10.0
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_on_missing_checkpoint: bool = False
    ckpt_step: int | None = None  # load this iteration from `load` instead of the tracker's latest


@dataclass(kw_only=True, slots=True, frozen=True)
class LoggingConfig:
    tensorboard_dir: str | None = None
    log_throughput: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    """The data section: its own flags (paths, split, tokenizer, document masking) and the run's
    sizes it builds datasets for (filled from the other sections by config_from_args)."""

    data_path: list[str] | None = None  # "PREFIX ..." or "WEIGHT PREFIX WEIGHT PREFIX ..."
    split: str = "969,30,1"
    mock_data: bool = False
    data_cache_path: str | None = None  # default: megatron-core's PREFIX/cache/GPTDataset_indices
    seq_length: int = 1024
    seed: int = 1234
    micro_batch_size: int = 1
    global_batch_size: int = 8
    data_parallel_size: int = 1
    train_iters: int = 0
    eval_iters: int = 0
    eval_interval: int | None = None  # None: a single evaluation at the end
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # NullTokenizer ids without eod (Megatron-LM's --vocab-size)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # A [seq, seq] mask per sample is only worth building when documents must not attend across
    # eod; otherwise one shared causal mask serves every sample (megatron-core's own fallback,
    # transformer.utils.get_default_causal_mask, allocates it on CUDA, so a CPU trainer passes one).
    create_attention_mask: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class RunConfig:
    parallel: ParallelConfig
    model: ModelConfig
    optimizer: OptimizerConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    data: DataConfig
    args: argparse.Namespace = field(repr=False)  # plugins read their own flags from here

    @property
    def num_microbatches(self) -> int:
        per_step = self.training.micro_batch_size * self.parallel.data_parallel_size
        return self.training.global_batch_size // per_step

    @property
    def num_chunks(self) -> int:
        return self.parallel.virtual_chunks(self.model.num_layers)


def validate(cfg: RunConfig) -> None:
    """Check every factor once, before any work starts; raise one ConfigError listing all."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    problems: list[str] = []
    for name, value in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
        ("--micro-batch-size", t.micro_batch_size),
        ("--global-batch-size", t.global_batch_size),
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--seq-length", m.seq_length),
    ):
        if value < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))

    if p.world_size % (tp * pp) != 0:
        dp_guess = max(1, p.world_size // (tp * pp))
        problems.append(
            f"tp({tp}) x pp({pp}) x dp({dp_guess}) = {tp * pp * dp_guess} != world_size({p.world_size}): "
            f"world size must be a multiple of tp x pp = {tp * pp}; change the parallel sizes or --nproc-per-node"
        )
    dp = max(1, p.data_parallel_size)
    problems.extend(layer_split_problems(p, m.num_layers))
    vpp_layers = p.num_layers_per_virtual_pipeline_stage
    if vpp_layers is not None:
        if pp == 1:
            problems.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        elif p.pipeline_layer_split is None and m.num_layers % pp == 0 and (
                vpp_layers < 1 or (m.num_layers // pp) % vpp_layers != 0):
            per_stage = m.num_layers // pp
            problems.append(
                f"layers per stage num_layers({m.num_layers}) / pp({pp}) = {per_stage} is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage({vpp_layers})"
            )
        elif vpp_layers < 1:
            problems.append(f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {vpp_layers}")
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        problems.append(
            f"global_batch_size({t.global_batch_size}) is not divisible by "
            f"micro_batch_size({t.micro_batch_size}) x dp({dp}) = {t.micro_batch_size * dp}"
        )
    if m.hidden_size % m.num_attention_heads != 0:
        problems.append(
            f"hidden_size({m.hidden_size}) is not divisible by num_attention_heads({m.num_attention_heads})"
        )
    if m.num_attention_heads % tp != 0:
        problems.append(f"num_attention_heads({m.num_attention_heads}) is not divisible by tp({tp})")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp != 0:
        problems.append(f"ffn_hidden_size({ffn}) is not divisible by tp({tp})")
    if m.seq_length > m.max_position_embeddings and m.position_embedding_type == "learned_absolute":
        problems.append(
            f"seq_length({m.seq_length}) > max_position_embeddings({m.max_position_embeddings}); "
            "raise --max-position-embeddings"
        )
    if m.attention_backend not in ATTENTION_BACKENDS:
        problems.append(f"--attention-backend {m.attention_backend}: use one of {', '.join(ATTENTION_BACKENDS)}")
    if m.transformer_impl != "local":
        problems.append(
            f"--transformer-impl {m.transformer_impl} needs Transformer Engine, which this trainer does not use "
            "(megatron-core's local spec runs instead); use --transformer-impl local"
        )
    problems.extend(_llama_and_precision_problems(cfg))
    if not cfg.data.mock_data and not cfg.data.data_path:
        problems.append("no training data: pass --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    if t.train_iters < 1:
        problems.append(f"--train-iters must be >= 1, got {t.train_iters}")
    if cfg.checkpoint.save_interval and not cfg.checkpoint.save:
        problems.append("--save-interval is set but --save DIR is not")
    if t.eval_interval and t.eval_iters < 1:
        problems.append("--eval-interval is set but --eval-iters is 0; pass --eval-iters N")
    if not problems:
        chunks = cfg.num_chunks
        num_mb = cfg.num_microbatches
        if chunks > 1 and num_mb % pp != 0:
            problems.append(
                f"interleaved pipeline needs the number of microbatches, global_batch_size({t.global_batch_size}) / "
                f"(micro_batch_size({t.micro_batch_size}) x dp({dp})) = {num_mb}, to be a multiple of pp({pp})"
            )
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _llama_and_precision_problems(cfg: RunConfig) -> list[str]:
    """Megatron-LM flags honoured here whose values must fit together."""
    m, o, tp = cfg.model, cfg.optimizer, cfg.parallel.tensor_model_parallel_size
    problems = []
    if m.bf16 and m.fp16:
        problems.append("--bf16 and --fp16 were both given; pick one")
    if m.normalization not in ("LayerNorm", "RMSNorm"):
        problems.append(f"--normalization {m.normalization}: use LayerNorm or RMSNorm")
    if m.num_query_groups is not None:
        if m.num_query_groups < 1 or m.num_attention_heads % m.num_query_groups != 0:
            problems.append(f"--num-query-groups({m.num_query_groups}) must divide "
                            f"--num-attention-heads({m.num_attention_heads})")
        elif m.num_query_groups % tp != 0:
            problems.append(f"--num-query-groups({m.num_query_groups}) is not divisible by tp({tp})")
    if not 0.0 < m.rotary_percent <= 1.0:
        problems.append(f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
    if m.recompute_granularity == "full" and m.recompute_method is None:
        problems.append("--recompute-granularity full needs --recompute-method uniform|block "
                        "(and --recompute-num-layers N)")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        problems.append("--recompute-method applies to --recompute-granularity full only")
    if m.recompute_granularity == "full" and m.recompute_num_layers is None:
        problems.append("--recompute-granularity full needs --recompute-num-layers N (layers per recomputed block "
                        "for uniform, recomputed layers per stage for block)")
    if o.fp16 and o.loss_scale is not None and o.loss_scale <= 0:
        problems.append(f"--loss-scale must be > 0, got {o.loss_scale}")
    if o.fp16 and (o.loss_scale_window < 1 or o.hysteresis < 1 or o.min_loss_scale <= 0):
        problems.append("--loss-scale-window and --hysteresis must be >= 1 and --min-loss-scale > 0")
    if o.use_distributed_optimizer and _runs_on_cuda(cfg) and (cfg.checkpoint.save or cfg.checkpoint.load):
        problems.append("--use-distributed-optimizer with --save/--load: checkpoints of the sharded optimizer "
                        "state are not written by this trainer yet; drop --use-distributed-optimizer to checkpoint")
    if cfg.args is not None:
        from megatron.app import megatron_lm

        problems.extend(megatron_lm.refusals(cfg.args))
    return problems



def _runs_on_cuda(cfg: RunConfig) -> bool:
    import torch

    device = cfg.training.device
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())
