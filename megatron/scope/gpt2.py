"""Import a local Hugging Face GPT-2 directory (config.json, model.safetensors or
pytorch_model.bin, vocab.json, merges.txt) into megatron-core's GPTModel, sliced for this
rank's TP x PP place. No download: everything is read from the directory."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron.app.config import ModelConfig, ParallelConfig
from megatron.app.tokenizer import GPT2BPETokenizer
from megatron.scope.loading import LoadedModel, ModelLoadError, assign_full_state, info_for, init_parallel
from megatron.scope.hf_files import read_weights as read_hf_weights
from megatron.scope.runner import ModelRunner


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: --hf-model needs a Hugging Face model directory")
    config = json.loads(path.read_text())
    if config.get("model_type", "gpt2") != "gpt2":
        raise ModelLoadError(f"{path}: model_type {config.get('model_type')!r} is not gpt2")
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ModelLoadError(f"{path}: activation {config['activation_function']!r} is not supported")
    return config


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    # GPT2LMHeadModel prefixes "transformer."; a bare GPT2Model does not.
    return {k.removeprefix("transformer."): v for k, v in read_hf_weights(directory).items()}


def megatron_state(hf: dict[str, torch.Tensor], config: dict, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Full (unsharded, unpipelined) megatron-core parameter names -> tensors."""
    hidden, heads = config["n_embd"], config["n_head"]
    head_dim = hidden // heads
    embedding = hf["wte.weight"]
    padded = torch.zeros(padded_vocab, hidden)
    padded[: embedding.shape[0]] = embedding  # padding rows never win: their logits are cut off
    state = {"embedding.word_embeddings.weight": padded,
             "embedding.position_embeddings.weight": hf["wpe.weight"],
             "decoder.final_layernorm.weight": hf["ln_f.weight"], "decoder.final_layernorm.bias": hf["ln_f.bias"]}
    for i in range(config["n_layer"]):
        src, dst = f"h.{i}.", f"decoder.layers.{i}."
        # HF Conv1D stores [in, out]; megatron's linear layers hold [out, in].
        qkv_weight = hf[src + "attn.c_attn.weight"].t()  # [q all heads; k; v] x hidden
        qkv_bias = hf[src + "attn.c_attn.bias"]
        # megatron-core groups the fused projection per head: [q_h; k_h; v_h] for each head h.
        qkv_weight = qkv_weight.view(3, heads, head_dim, hidden).transpose(0, 1).reshape(3 * hidden, hidden)
        qkv_bias = qkv_bias.view(3, heads, head_dim).transpose(0, 1).reshape(3 * hidden)
        renamed = {
            "input_layernorm": ("ln_1", False), "pre_mlp_layernorm": ("ln_2", False),
            "self_attention.linear_proj": ("attn.c_proj", True), "mlp.linear_fc1": ("mlp.c_fc", True),
            "mlp.linear_fc2": ("mlp.c_proj", True),
        }
        for target, (source, transposed) in renamed.items():
            weight = hf[src + source + ".weight"]
            state[dst + target + ".weight"] = weight.t() if transposed else weight
            state[dst + target + ".bias"] = hf[src + source + ".bias"]
        state[dst + "self_attention.linear_qkv.weight"] = qkv_weight
        state[dst + "self_attention.linear_qkv.bias"] = qkv_bias
    return state


def load_gpt2(directory: str, tp: int = 1, pp: int = 1, device: str = "cpu") -> LoadedModel:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.app.model import transformer_config

    root = Path(directory)
    config = read_config(root)
    for name in ("vocab.json", "merges.txt"):
        if not (root / name).is_file():
            raise ModelLoadError(f"{root / name} is missing: the GPT-2 tokenizer files must sit beside the weights")
    tokenizer = GPT2BPETokenizer(root / "vocab.json", root / "merges.txt")
    model_cfg = ModelConfig(num_layers=config["n_layer"], hidden_size=config["n_embd"],
                            num_attention_heads=config["n_head"], ffn_hidden_size=config.get("n_inner") or None,
                            seq_length=config["n_positions"], max_position_embeddings=config["n_positions"],
                            vocab_size=config["vocab_size"], make_vocab_size_divisible_by=tp)
    backend = init_parallel(tp, pp, 0, device)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp)
    transformer = transformer_config(model_cfg, parallel, 1)
    # GPT-2 differs from megatron-core's defaults in its GELU (tanh approximation) and norm epsilon.
    approximate = "none" if config.get("activation_function") == "gelu" else "tanh"
    transformer.activation_func = functools.partial(F.gelu, approximate=approximate)
    transformer.layernorm_epsilon = float(config.get("layer_norm_epsilon", 1e-5))
    with backend.model_construction():
        chunk = GPTModel(config=transformer, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=model_cfg.padded_vocab_size, max_sequence_length=model_cfg.max_position_embeddings,
                         pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                         share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    full = megatron_state(read_weights(root), config, model_cfg.padded_vocab_size)
    assign_full_state(chunk, full, tp, ps.get_tensor_model_parallel_rank(), model_cfg)
    chunk.to(backend.device).eval()
    runner = ModelRunner([chunk], info_for(model_cfg, tp, pp, f"gpt2:{root.name}"), backend.device)
    return LoadedModel(runner=runner, tokenizer=tokenizer, model_config=model_cfg, backend=backend)
