"""Core attention through torch's scaled_dot_product_attention (--attention-backend flash / fused,
and auto on CUDA): a drop-in for megatron-core's DotProductAttention as the `core_attention`
submodule of its self-attention spec, with the same constructor and forward signatures.

megatron-core's DotProductAttention (the local spec's) materialises the [b, heads, sq, sk] scores,
masks and softmaxes them, drops out and multiplies by the values in separate kernels; SDPA lets
PyTorch pick a fused kernel (FlashAttention for bf16/fp16 on CUDA, memory-efficient attention for
fp32, its own flash kernel on CPU). The arithmetic is the same up to rounding:

- scale: `softmax_scale` (config.softmax_scale) or 1/sqrt(kv_channels), as DotProductAttention.
  Its --apply-query-key-layer-scaling divides the scores by the layer number and multiplies them
  back inside the fp32 softmax, so the net scale is the same; SDPA's fused kernels keep the
  softmax in fp32 themselves.
- mask: megatron's boolean mask is True where a position is masked out, SDPA's True where it may
  be attended, so an explicit mask is passed inverted. A causal layer given no mask is causal
  (`is_causal`). When the model is only ever given the plain causal mask (`plain_causal_mask`: the
  trainer without --reset-attention-mask) the mask is not read either, so CUDA can run the flash
  kernel rather than one taking a dense mask; the first mask each layer is given is checked to be
  that causal mask once (one comparison per layer per process, not per step), and a layer given
  anything else uses the mask it is given from then on.
- grouped-query attention: SDPA's enable_gqa (no copy of the keys and values; FlashAttention takes it
  on CUDA), except for fp32 on CUDA, whose fused kernel does not: the keys and values are repeated.
- dropout: SDPA's dropout_p in training, drawn inside megatron-core's model-parallel RNG fork as
  DotProductAttention's dropout is (so selective recomputation and TP see the same streams).

What it does not do is refused with the reason: packed sequences (THD), attention_bias, context
parallelism, sliding-window attention and the off-by-one / learnable softmax variants.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide


class AttentionBackendError(ValueError):
    """The SDPA core attention was asked for something it does not do."""


_WHAT = "--attention-backend flash/fused (torch's scaled_dot_product_attention)"


class SDPAttention(MegatronModule):
    """megatron-core's DotProductAttention computed with torch.nn.functional.scaled_dot_product_attention.

    query [sq, b, heads per partition, head dim], key / value [sk, b, groups per partition, head dim]
    -> context [sq, b, heads per partition x head dim]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        *,
        plain_causal_mask: bool = False,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        if config.context_parallel_size != 1:
            raise AttentionBackendError(f"{_WHAT} does not support context parallelism "
                                        f"(context_parallel_size {config.context_parallel_size})")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise AttentionBackendError(f"{_WHAT} does not support sliding-window attention "
                                        f"(window_size {config.window_size})")
        if config.softmax_type != "vanilla":
            raise AttentionBackendError(f"{_WHAT} supports only the vanilla softmax, not "
                                        f"softmax_type {config.softmax_type!r}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.plain_causal_mask = plain_causal_mask
        self._mask_checked = False

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        # DotProductAttention's scale; with apply_query_key_layer_scaling it divides this by the
        # layer number and its softmax multiplies by it again, a net factor of 1.
        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if packed_seq_params is not None:
            raise AttentionBackendError(f"{_WHAT} does not support packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise AttentionBackendError(f"{_WHAT} does not support attention_bias")
        sq, b, heads, _ = query.shape
        sk = key.size(0)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        is_causal, mask = self._mask(attention_mask, mask_type, sq, sk)

        # [s, b, n, d] -> [b, n, s, d] (views; the head dim stays contiguous)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        grouped = k.size(1) != heads
        if grouped and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
            # CUDA's fp32 fused kernel (memory-efficient attention) takes no grouped keys: repeat them,
            # as DotProductAttention does, rather than fall back to the unfused math.
            k, v = (t.repeat_interleave(heads // t.size(1), dim=1) for t in (k, v))
            grouped = False
        dropout_p = self.attention_dropout_p if self.training else 0.0
        kwargs = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
                      enable_gqa=grouped)
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, n, sq, d] -> [sq, b, n x d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _mask(self, attention_mask: Optional[Tensor], mask_type: AttnMaskType, sq: int,
              sk: int) -> tuple[bool, Optional[Tensor]]:
        """(is_causal, SDPA's boolean mask: True = may attend) for megatron's mask (True = masked)."""
        causal_type = mask_type == AttnMaskType.causal
        if attention_mask is None:
            # DotProductAttention: a causal layer without a mask builds the causal one (sq > 1).
            if causal_type and sq > 1:
                if sq != sk:
                    raise AttentionBackendError(f"{_WHAT}: a causal mask needs as many queries as keys "
                                                f"(sq {sq}, sk {sk}); pass an explicit mask")
                return True, None
            return False, None
        if self.plain_causal_mask and sq == sk and self._is_plain_causal(attention_mask, sq):
            return True, None
        return False, ~attention_mask

    def _is_plain_causal(self, mask: Tensor, seq: int) -> bool:
        """The mask is the one shared causal mask [1, 1, s, s]: its shape every time, its values the
        first time (one comparison per layer); a layer once given another mask reads its masks."""
        if mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, seq, seq):
            return False
        if not self._mask_checked:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu_(1)
            self.plain_causal_mask = bool(torch.equal(mask[0, 0], causal))
            self._mask_checked = True
        return self.plain_causal_mask
