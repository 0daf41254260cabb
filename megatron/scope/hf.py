"""Import a local Hugging Face model directory into megatron-core's GPTModel for MegaScope:
GPT-2 (`GPT2LMHeadModel`) or Llama (`LlamaForCausalLM`: SwiGLU, RMSNorm, RoPE, grouped-query
attention, no biases, tied or untied output), picked by `model_type` in config.json, with its
tokenizer, sliced for this rank's TP x PP place. Weights come from model.safetensors (also
sharded, with its index) or pytorch_model.bin. Nothing is downloaded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron.app.config import ModelConfig, ParallelConfig
from megatron.app.tokenizer import Tokenizer
from megatron.scope.loading import LoadedModel, ModelLoadError, assign_full_state, info_for, init_parallel
from megatron.scope.gpt2 import load_gpt2
from megatron.scope.hf_files import SUPPORTED, read_config, read_weights  # noqa: F401  (part of this API)
from megatron.scope.runner import ModelRunner

class HFTokenizer(Tokenizer):
    """The directory's own tokenizer through `transformers.AutoTokenizer` (local files only)."""

    def __init__(self, directory: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ModelLoadError("a Llama directory's tokenizer is read with transformers "
                                 "(pip install transformers)") from exc
        try:
            self.hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as exc:  # transformers raises OSError/ValueError variants
            raise ModelLoadError(f"{directory}: no tokenizer could be read ({exc}); it needs tokenizer.json or "
                                 "tokenizer.model with tokenizer_config.json") from exc
        self.name = directory.name

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eod(self) -> int:
        return self.hf.eos_token_id if self.hf.eos_token_id is not None else 0

    def tokenize(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": "HFTokenizer", "name": self.name}


def llama_model_config(config: dict, tp: int) -> ModelConfig:
    unsupported = [
        (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r} (only silu)"),
        (bool(config.get("rope_scaling")), f"rope_scaling {config.get('rope_scaling')!r} (plain RoPE only)"),
        (bool(config.get("attention_bias")), "attention_bias (Llama has none)"),
        (bool(config.get("mlp_bias")), "mlp_bias (Llama has none)"),
    ]
    problems = [text for bad, text in unsupported if bad]
    if problems:
        raise ModelLoadError("this Llama config is not supported: " + "; ".join(problems))
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    if groups % tp or heads % tp:
        raise ModelLoadError(f"{heads} attention heads and {groups} key/value heads cannot be split over "
                             f"--tensor-model-parallel-size {tp}")
    positions = config.get("max_position_embeddings", 2048)
    return ModelConfig(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=config["intermediate_size"], seq_length=positions, max_position_embeddings=positions,
        vocab_size=config["vocab_size"], make_vocab_size_divisible_by=tp,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        position_embedding_type="rope", rotary_base=int(config.get("rope_theta", 10000)), swiglu=True,
        normalization="RMSNorm", norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        num_query_groups=groups if groups != heads else None,
        kv_channels=config.get("head_dim") or config["hidden_size"] // heads, add_bias_linear=False)


def llama_state(hf: dict[str, torch.Tensor], config: dict, model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full (unsharded, unpipelined) megatron-core parameter names -> tensors."""
    hf = {name.removeprefix("model."): value for name, value in hf.items()}
    heads, hidden = model_cfg.num_attention_heads, model_cfg.hidden_size
    groups, head_dim = model_cfg.num_query_groups or heads, model_cfg.kv_channels

    def padded(weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(model_cfg.padded_vocab_size, hidden)
        out[: weight.shape[0]] = weight  # padding rows never win: their logits are cut off
        return out

    state = {"embedding.word_embeddings.weight": padded(hf["embed_tokens.weight"]),
             "decoder.final_layernorm.weight": hf["norm.weight"]}
    if model_cfg.untie_embeddings_and_output_weights:
        state["output_layer.weight"] = padded(hf["lm_head.weight"])
    for i in range(model_cfg.num_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        # megatron-core's fused QKV holds, per key/value group, that group's query heads, then its
        # key head, then its value head. Both use the rotate-half RoPE, so no row permutation.
        q = hf[src + "self_attn.q_proj.weight"].view(groups, heads // groups * head_dim, hidden)
        k = hf[src + "self_attn.k_proj.weight"].view(groups, head_dim, hidden)
        v = hf[src + "self_attn.v_proj.weight"].view(groups, head_dim, hidden)
        state[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        state[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        state[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        state[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        state[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"],
                                                          hf[src + "mlp.up_proj.weight"]], dim=0)
        state[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    return state


def load_llama(directory: str, tp: int = 1, pp: int = 1, device: str = "cpu") -> LoadedModel:
    from megatron.core import parallel_state as ps

    from megatron.app.model import build_model_chunks

    root = Path(directory)
    config = read_config(root)
    model_cfg = llama_model_config(config, tp)
    tokenizer = HFTokenizer(root)
    backend = init_parallel(tp, pp, 0, device)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp)
    chunks = build_model_chunks(model_cfg, parallel, 1, 0, backend.model_construction)
    full = llama_state(read_weights(root), config, model_cfg)
    assign_full_state(chunks[0], full, tp, ps.get_tensor_model_parallel_rank(), model_cfg)
    chunks[0].to(backend.device).eval()
    runner = ModelRunner(chunks, info_for(model_cfg, tp, pp, f"llama:{root.name}"), backend.device)
    return LoadedModel(runner=runner, tokenizer=tokenizer, model_config=model_cfg, backend=backend)


def load_hf(directory: str, tp: int = 1, pp: int = 1, device: str = "cpu") -> LoadedModel:
    """The model in a Hugging Face directory, by its config's model_type."""
    if read_config(Path(directory)).get("model_type", "gpt2") == "llama":
        return load_llama(directory, tp, pp, device)
    return load_gpt2(directory, tp, pp, device)
