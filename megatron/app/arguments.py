"""Command-line flags (Megatron-LM names) and their translation into a RunConfig."""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from megatron.app import megatron_lm
from megatron.app.config import (
    ConfigError,
    CheckpointConfig,
    DataArgs,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)


def build_parser(plugins: Sequence = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Train megatron-core's GPTModel with tensor, pipeline and data parallelism.",
        allow_abbrev=False,
    )
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--pipeline-schedule", choices=["auto", "1f1b", "interleaved", "gpipe", "megatron-core"],
                   default="auto",
                   help="pipeline order run by this trainer's executor; auto = interleaved with virtual stages, "
                        "else 1f1b. megatron-core: megatron-core's own get_forward_backward_func() (no "
                        "pipelining, 1F1B or interleaved, by the parallel sizes) drives each iteration, "
                        "on CPU and CUDA alike")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local: megatron-core's own layers (the only one here; transformer_engine is refused)")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU), as in Llama")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm", help="norm layers")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of the norm layers")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (with --position-embedding-type rope)")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of each head's dims RoPE rotates")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=None, help="key/value heads with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None, help="per-head dimension (default hidden / heads)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers, as in Llama")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="weigh every token of the global batch equally: gradients of the summed token losses "
                        "divided by the global batch's token count (default: each microbatch's mean, averaged)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights stored as gamma - 1 (start at 0, applied as 1 + weight)")

    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations with fp32 master weights and loss scaling")
    g.add_argument("--loss-scale", type=float, default=None, help="a fixed loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="first dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="the dynamic scale never goes below this")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="iterations without overflow before the dynamic scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the dynamic scale halves")

    g = parser.add_argument_group("activation recomputation")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: recompute whole layers in backward; selective: only the core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with full: uniform = every layer in blocks of --recompute-num-layers; block = the first "
                        "--recompute-num-layers layers of each stage")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="see --recompute-method")
    g.add_argument("--recompute-activations", action="store_true", help="same as --recompute-granularity selective")

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps (default 10)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train for this many samples instead: --train-iters = samples / global batch")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (after saving, if --save) once training has run this many minutes")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible runs on CUDA: deterministic kernels only (torch.use_deterministic_algorithms, "
                        "CUBLAS_WORKSPACE_CONFIG, megatron-core's deterministic embedding, NCCL_ALGO=Ring unless set); "
                        "slower. CPU runs are deterministic without it")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save) once iteration %% N == 0")

    g = parser.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warmup steps")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay steps (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="warmup in samples")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="decay steps (default --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="decay in samples")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the embedding and output layer (same warmup and decay shape)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="final learning rate of the embedding and output layer (default --min-lr)")
    g.add_argument("--optimizer", choices=["adam"], default="adam",
                   help="adam (AdamW with --weight-decay); the only optimizer here")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="CUDA: shard optimizer state over data-parallel ranks; on CPU reported as not used")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for --mock-data")
    g.add_argument("--data-cache-path", default=None)

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None,
                   help="resume from the latest checkpoint in DIR; a DIR without one starts from scratch")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop with an error when --load DIR holds no checkpoint")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "zarr", "fsdp_dtensor"], default="torch",
                   help="torch: per-rank torch files, the only format written here (others are reported "
                        "at start-up and written as torch)")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--eval-interval", type=int, default=0)
    g.add_argument("--eval-iters", type=int, default=0)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-throughput", action="store_true",
                   help="add model TFLOP/s per rank ('throughput per GPU') to the log line")

    megatron_lm.add_arguments(parser)

    for plugin in plugins:
        plugin.add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace, world_size: int | None = None) -> RunConfig:
    """Translate parsed flags into the typed config (no validation here; see config.validate)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    train_iters, warmup_iters, decay_iters = _iteration_counts(args)
    return RunConfig(
        parallel=ParallelConfig(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
            world_size=world_size,
        ),
        model=ModelConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            ffn_hidden_size=args.ffn_hidden_size,
            seq_length=args.seq_length,
            max_position_embeddings=args.max_position_embeddings or args.seq_length,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            hidden_dropout=args.hidden_dropout,
            attention_dropout=args.attention_dropout,
            init_method_std=args.init_method_std,
            bf16=args.bf16,
            fp16=args.fp16,
            transformer_impl=args.transformer_impl,
            deterministic_mode=args.deterministic_mode,
            swiglu=args.swiglu,
            normalization=args.normalization,
            norm_epsilon=args.norm_epsilon,
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            kv_channels=args.kv_channels,
            add_bias_linear=not args.disable_bias_linear,
            apply_layernorm_1p=args.apply_layernorm_1p,
            calculate_per_token_loss=args.calculate_per_token_loss,
            recompute_granularity="selective" if args.recompute_activations else args.recompute_granularity,
            recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers,
        ),
        optimizer=OptimizerConfig(
            lr=args.lr,
            min_lr=args.min_lr,
            lr_decay_style=args.lr_decay_style,
            lr_warmup_iters=warmup_iters,
            lr_decay_iters=decay_iters,
            weight_decay=args.weight_decay,
            clip_grad=args.clip_grad,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            bf16=args.bf16,
            fp16=args.fp16,
            loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis,
            use_distributed_optimizer=args.use_distributed_optimizer,
            decoupled_lr=args.decoupled_lr,
            decoupled_min_lr=args.decoupled_min_lr,
        ),
        training=TrainingConfig(
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            train_iters=train_iters,
            seed=args.seed,
            log_interval=args.log_interval,
            eval_interval=args.eval_interval,
            eval_iters=args.eval_iters,
            pipeline_schedule=args.pipeline_schedule,
            device=args.device,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            exit_interval=args.exit_interval,
            exit_duration_in_mins=args.exit_duration_in_mins,
        ),
        checkpoint=CheckpointConfig(save=args.save, load=args.load, save_interval=args.save_interval,
                                    exit_on_missing_checkpoint=args.exit_on_missing_checkpoint),
        logging=LoggingConfig(tensorboard_dir=args.tensorboard_dir, log_throughput=args.log_throughput),
        data=DataArgs(
            data_path=args.data_path,
            split=args.split,
            mock_data=args.mock_data,
            tokenizer_type=args.tokenizer_type,
            vocab_file=args.vocab_file,
            merge_file=args.merge_file,
            vocab_size=args.vocab_size,
            data_cache_path=args.data_cache_path,
        ),
        args=args,
    )


def _iteration_counts(args: argparse.Namespace) -> tuple[int, int, int | None]:
    """(train iters, warmup iters, decay iters) from Megatron-LM's iteration-, sample- or
    fraction-based flags; a fixed global batch turns samples into iterations."""
    batch = max(1, args.global_batch_size)
    if args.train_samples is not None and args.train_iters is not None:
        raise ConfigError("--train-iters and --train-samples were both given; pass one")
    train_iters = args.train_iters if args.train_iters is not None else (
        args.train_samples // batch if args.train_samples is not None else 10)
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

