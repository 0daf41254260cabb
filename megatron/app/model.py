"""Build megatron-core's GPTModel (local transformer spec) as this rank's pipeline chunks.

Weights get a parallelism-invariant initialisation: every parameter is drawn in full from a
generator seeded by (seed, global parameter name) and then sliced to this rank's TP shard, so
the same --seed gives the same model for any TP x PP x virtual-pipeline layout.
"""
from __future__ import annotations

import functools
import math
import re
import zlib
from typing import Callable, ContextManager

import torch

from megatron.app.config import ModelConfig, ParallelConfig

_LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def transformer_config(model: ModelConfig, parallel: ParallelConfig, num_chunks: int, stage: int | None = None):
    """megatron-core's TransformerConfig of the run. With --pipeline-layer-split the layers per
    stage go to megatron-core as a `pipeline_model_parallel_layout`; `stage`: the pipeline stage
    whose chunks are built with it when that is not this process's own (see `pipeline_layout`)."""
    from megatron.core.transformer import TransformerConfig

    import torch.nn.functional as F

    dtype = model.params_dtype
    return TransformerConfig(
        num_layers=model.num_layers,
        pipeline_model_parallel_layout=pipeline_layout(parallel, model.num_layers, stage),
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=num_chunks if num_chunks > 1 else None,
        # For megatron-core's own schedules (--pipeline-schedule megatron-core), Megatron-LM's
        # defaults: the interleaved schedule overlaps P2P with compute and posts single ops, since
        # with PP=2 a batch of ops to the one peer in both directions pairs the wrong messages.
        overlap_p2p_comm=num_chunks > 1,
        batch_p2p_comm=num_chunks == 1,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=model.add_bias_linear,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
        calculate_per_token_loss=model.calculate_per_token_loss,
        use_cpu_initialization=True,
        # megatron-core only tags TP-partitioned weights when it initialises them, so it does;
        # init_parallel_invariant then overwrites the values.
        bf16=model.bf16,
        fp16=model.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # megatron-core's compiled bias fusions stay off: on an H200 (torch 2.11) they made short runs
        # slower (docs/trainer.md), and CPU runs keep the plain ops' numerics.
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        deterministic_mode=model.deterministic_mode,
    )


def build_model_chunks(model_cfg: ModelConfig, parallel: ParallelConfig, num_chunks: int, seed: int,
                       construction_context: Callable[[], ContextManager], *,
                       pg_collection=None) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank (a single one without vpp).
    `pg_collection`: megatron-core's process groups to build with instead of its parallel state's
    (MegaFBD's forward hosts build the chunk of another stage: its `pp` group says which)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    stage = None if pg_collection is None else pg_collection.pp.rank()
    config = transformer_config(model_cfg, parallel, num_chunks, stage)
    chunks = []
    for vp_stage in range(num_chunks):
        vp = vp_stage if num_chunks > 1 else None
        if pg_collection is None:
            first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            groups = {}
        else:
            stage, stages = pg_collection.pp.rank(), pg_collection.pp.size()
            first, last, groups = stage == 0, stage == stages - 1, {"pg_collection": pg_collection}
        with construction_context():
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(model_cfg, config, vp),
                pre_process=first,
                post_process=last,
                vp_stage=vp,
                **groups,
                **gpt_model_kwargs(model_cfg),
            )
        init_parallel_invariant(chunk, seed, model_cfg)
        if model_cfg.bf16 or model_cfg.fp16:
            from megatron.core.transformer.module import Float16Module

            # Casts the parameters to bf16 and the first stage's inputs / last stage's outputs.
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    return chunks


def pipeline_layout(parallel: ParallelConfig, num_layers: int, stage: int | None = None):
    """The layer split as megatron-core's PipelineParallelLayerLayout (None without
    --pipeline-layer-split, or with one stage: megatron-core then splits evenly by itself).

    megatron-core reads the pipeline rank from its parallel state when it asks the layout for a
    stage's layer count and offset; a chunk built for another stage (MegaFBD's forward hosts) gets
    a layout bound to that `stage`."""
    if parallel.pipeline_layer_split is None or parallel.pipeline_model_parallel_size == 1:
        return None
    sizes = parallel.layers_per_chunk(num_layers)  # [stage][chunk]
    pp, chunks = len(sizes), len(sizes[0])
    rows = []  # megatron-core's order: virtual stage chunk x pp + stage
    for chunk in range(chunks):
        for s in range(pp):
            row = ["decoder"] * sizes[s][chunk]
            if chunk == 0 and s == 0:
                row.insert(0, "embedding")
            if chunk == chunks - 1 and s == pp - 1:
                row.append("loss")
            rows.append(row)
    return _stage_bound_layout_class()(rows, pp, stage)


@functools.cache
def _stage_bound_layout_class():
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    class StageBoundLayout(PipelineParallelLayerLayout):
        """A PipelineParallelLayerLayout whose stage defaults to `stage` when one is given."""

        def __init__(self, layout: list, pipeline_model_parallel_size: int, stage: int | None) -> None:
            super().__init__(layout, pipeline_model_parallel_size)
            self.stage = stage

        def get_num_layers_to_build(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
            return super().get_num_layers_to_build(layer_type, vp_stage, self.stage if pp_rank is None else pp_rank)

        def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
            return super().get_layer_offset(layer_type, vp_stage, self.stage if pp_rank is None else pp_rank)

    return StageBoundLayout


def layer_spec(model_cfg: ModelConfig, config=None, vp_stage: int | None = None):
    """megatron-core's local (no Transformer Engine) transformer layer, with RMSNorm when asked and
    the SDPA core attention when --attention-backend picks it (ModelConfig.sdpa_attention).
    With --apply-layernorm-1p every norm, the final one included, is a `ZeroCenteredNorm`, so the
    spec is a whole block's (this stage's layers: needs the TransformerConfig and vp stage)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=model_cfg.normalization)
    if model_cfg.sdpa_attention:
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron.app.attention import SDPAttention

        # Without --reset-attention-mask the trainer passes only the plain causal mask.
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=SDPAttention, params={"plain_causal_mask": not model_cfg.reset_attention_mask})
    if not model_cfg.apply_layernorm_1p:
        return spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec.submodules.input_layernorm = ZeroCenteredNorm
    spec.submodules.pre_mlp_layernorm = ZeroCenteredNorm
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=ZeroCenteredNorm))


class ZeroCenteredNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (by `config.normalization`) whose weight holds gamma - 1: it starts at
    zero and the norm multiplies by 1 + weight (Megatron-LM's --apply-layernorm-1p), so weight
    decay pulls gamma towards 1 rather than 0. Built by megatron-core as
    `(config=, hidden_size=, eps=)` wherever its layer spec names a norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_) -> None:
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = 1 + self.weight
        if self.rms:
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), gamma, self.eps)
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), gamma, self.bias, self.eps)


def gpt_model_kwargs(model_cfg: ModelConfig) -> dict:
    """The GPTModel arguments that come from the model config (besides config, spec and stage)."""
    return dict(
        vocab_size=model_cfg.padded_vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
        position_embedding_type=model_cfg.position_embedding_type,
        rotary_base=model_cfg.rotary_base,
        rotary_percent=model_cfg.rotary_percent,
    )


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_parameter_name(chunk: torch.nn.Module, local_name: str) -> str:
    """The parameter's name in the unpipelined model: local layer indices become global ones,
    and the tied output weight is named after the word embedding it mirrors."""
    if local_name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"
    match = _LOCAL_LAYER.match(local_name)
    if match:
        layer = chunk.decoder.layers[int(match.group(1))]
        return f"decoder.layers.{layer.layer_number - 1}." + local_name[match.end():]
    return local_name


def _initial_value(name: str, full_shape: torch.Size, seed: int, cfg: ModelConfig) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias" or leaf.endswith("_bias"):
        return torch.zeros(full_shape)
    if "norm" in name and len(full_shape) == 1:
        return (torch.zeros if cfg.apply_layernorm_1p else torch.ones)(full_shape)
    std = cfg.init_method_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        # Output projections of residual branches are scaled by depth (GPT-2 style).
        std = std / math.sqrt(2.0 * cfg.num_layers)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(full_shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_parallel_invariant(chunk: torch.nn.Module, seed: int, cfg: ModelConfig) -> None:
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for local_name, param in chunk.named_parameters():
        name = global_parameter_name(chunk, local_name)
        full_shape = list(param.shape)
        partitioned = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        if partitioned:
            full_shape[param.partition_dim] *= tp_size
        value = _initial_value(name, torch.Size(full_shape), seed, cfg)
        if partitioned:
            value = tp_shard(name, value, param.partition_dim, tp_size, tp_rank, cfg)
        param.copy_(value.to(param.dtype))


def tp_shard(name: str, full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, cfg: ModelConfig) -> torch.Tensor:
    """This TP rank's part of a parameter given in full (unpartitioned layout). With SwiGLU the
    first MLP projection holds [gate; up] and each TP rank holds [its gate rows; its up rows]."""
    if cfg.swiglu and name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")) and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())
