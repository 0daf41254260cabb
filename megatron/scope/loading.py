"""Models MegaScope can serve: a checkpoint of our trainer, a local Hugging Face GPT-2
directory, or a freshly initialised model (demos and tests). Returns this rank's chunks."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from megatron.app import checkpoint as ckpt
from megatron.app.config import ModelConfig, ParallelConfig
from megatron.app.tokenizer import Tokenizer, build_tokenizer
from megatron.scope.runner import ModelInfo, ModelRunner


class ModelLoadError(RuntimeError):
    """The model to serve cannot be built; the message says which flag or file to fix."""


@dataclass(kw_only=True, slots=True)
class LoadedModel:
    runner: ModelRunner
    tokenizer: Tokenizer
    model_config: ModelConfig
    backend: Any = None


def init_parallel(tp: int, pp: int, seed: int, device: str = "cpu"):
    """Process groups and the CPU stand-ins, as the trainer sets them up (torchrun env or one rank)."""
    import torch.distributed as dist

    from megatron.app.device import build_backend

    backend = build_backend(device)
    backend.init_distributed(timeout_s=600)
    world = dist.get_world_size()
    if world != tp * pp:
        raise ModelLoadError(
            f"tp({tp}) x pp({pp}) = {tp * pp} != world_size({world}): MegaScope serves one model "
            f"replica; launch with --nproc-per-node {tp * pp}"
        )
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        # A second model in one process (tests, notebooks): same layout, fresh groups and seeds.
        ps.destroy_model_parallel()
    backend.init_model_parallel(tp, pp, None, seed)
    return backend


def info_for(model_cfg: ModelConfig, tp: int, pp: int, name: str) -> ModelInfo:
    return ModelInfo(num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
                     num_heads=model_cfg.num_attention_heads,
                     ffn_hidden_size=model_cfg.ffn_hidden_size or 4 * model_cfg.hidden_size,
                     vocab_size=model_cfg.vocab_size, max_positions=model_cfg.max_position_embeddings,
                     tp=tp, pp=pp, name=name, num_query_groups=model_cfg.num_query_groups)


def build_random(model_cfg: ModelConfig, tokenizer: Tokenizer, tp: int = 1, pp: int = 1, seed: int = 1234,
                 device: str = "cpu", name: str = "random") -> LoadedModel:
    """A parallelism-invariant random model: the same seed gives the same weights for any TP x PP."""
    from megatron.app.model import build_model_chunks

    backend = init_parallel(tp, pp, seed, device)
    model_cfg = replace(model_cfg, vocab_size=tokenizer.vocab_size)  # the config is frozen
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp)
    chunks = build_model_chunks(model_cfg, parallel, 1, seed, backend.model_construction)
    for chunk in chunks:
        chunk.to(backend.device).eval()
    runner = ModelRunner(chunks, info_for(model_cfg, tp, pp, name), backend.device)
    return LoadedModel(runner=runner, tokenizer=tokenizer, model_config=model_cfg, backend=backend)


def read_checkpoint_header(root: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(iteration, model_config dict, args dict) from TP/PP rank (0, 0) of the latest checkpoint."""
    try:
        iteration = ckpt.find_latest(root)
    except ckpt.CheckpointError as exc:
        raise ModelLoadError(str(exc)) from exc
    path = ckpt.rank_file(ckpt.iteration_dir(root, iteration), 0, 0)
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; is {root} a checkpoint directory of pretrain_gpt.py?")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    return iteration, payload.get("model_config", {}), payload.get("args", {})


def load_checkpoint(root: str, tokenizer_overrides: dict[str, Any] | None = None, device: str = "cpu",
                    tp: int = 1, pp: int = 1) -> LoadedModel:
    """Build the model recorded in a checkpoint for a TP x PP layout of our choosing (one process
    by default): every saved rank file is merged into unsharded, unpipelined tensors, then sliced."""
    from megatron.app.model import build_model_chunks

    iteration, saved_cfg, args = read_checkpoint_header(root)
    known = {f.name for f in fields(ModelConfig)}
    model_cfg = ModelConfig(**{k: v for k, v in saved_cfg.items() if k in known})
    if args.get("num_layers_per_virtual_pipeline_stage"):
        raise ModelLoadError("checkpoints with virtual pipeline stages are not supported by MegaScope yet")
    tokenizer = tokenizer_from_args(args, tokenizer_overrides or {}, model_vocab_size=model_cfg.vocab_size or None,
                                    source=root)
    backend = init_parallel(tp, pp, int(args.get("seed", 1234)), device)
    from megatron.core import parallel_state as ps

    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp)
    chunks = build_model_chunks(model_cfg, parallel, 1, 0, backend.model_construction)
    saved_tp = int(args.get("tensor_model_parallel_size", 1))
    saved_pp = int(args.get("pipeline_model_parallel_size", 1))
    full = merged_checkpoint_state(root, iteration, saved_tp, saved_pp, model_cfg.num_layers, chunks[0],
                                   swiglu=model_cfg.swiglu)
    assign_full_state(chunks[0], full, tp, ps.get_tensor_model_parallel_rank(), model_cfg)
    for chunk in chunks:
        chunk.to(backend.device).eval()
    runner = ModelRunner(chunks, info_for(model_cfg, tp, pp, f"{Path(root).name}@{iteration}"), backend.device)
    return LoadedModel(runner=runner, tokenizer=tokenizer, model_config=model_cfg, backend=backend)


def merged_checkpoint_state(root: str, iteration: int, saved_tp: int, saved_pp: int, num_layers: int,
                            reference: torch.nn.Module, swiglu: bool = False) -> dict[str, torch.Tensor]:
    """Global parameter name -> full tensor, from all (tp, pp) rank files of one checkpoint.
    `reference` (any chunk of the same model) tells which parameters are TP-split and along what."""
    from megatron.app.model import global_parameter_name

    # Split dims come from this rank's own chunk, named globally (a last stage's tied output
    # layer names the word embedding); it only ever needs the tensors it holds.
    split_dims = {}
    for name, param in reference.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            glob = global_parameter_name(reference, name)
            split_dims[re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.*.", glob)] = param.partition_dim
    # First layer of each saved stage: the split the checkpoint records, else the even one.
    offsets = [pp_rank * (num_layers // saved_pp) for pp_rank in range(saved_pp)]
    tied = bool(getattr(reference, "share_embeddings_and_output_weights", False))
    shards: dict[str, list[torch.Tensor]] = {}
    for pp_rank in range(saved_pp):
        for tp_rank in range(saved_tp):
            path = ckpt.rank_file(ckpt.iteration_dir(root, iteration), tp_rank, pp_rank)
            if not path.is_file():
                raise ModelLoadError(f"{path} is missing: the checkpoint in {root} is incomplete")
            payload = torch.load(path, map_location="cpu", weights_only=False)
            state = payload["model"][0]
            split = payload.get("layout", {}).get("pipeline_layer_split")
            if split:
                offsets = [sum(split[:stage]) for stage in range(saved_pp)]
            for local, value in state.items():
                if local.endswith("_extra_state") or not isinstance(value, torch.Tensor):
                    continue
                if local == "output_layer.weight" and tied:
                    continue  # the last stage's copy of the tied word embedding
                name = re.sub(r"^decoder\.layers\.(\d+)\.",
                              lambda m: f"decoder.layers.{int(m.group(1)) + offsets[pp_rank]}.", local)
                shards.setdefault(name, []).append(value)
    full = {}
    for name, parts in shards.items():
        dim = split_dims.get(re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.*.", name))
        if swiglu and dim == 0 and len(parts) > 1 and name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
            halves = [part.chunk(2, dim=0) for part in parts]  # each shard is [its gate rows; its up rows]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            continue
        full[name] = torch.cat(parts, dim=dim) if dim is not None and len(parts) > 1 else parts[0]
    return full


@torch.no_grad()
def assign_full_state(chunk: torch.nn.Module, full: dict[str, torch.Tensor], tp: int, tp_rank: int,
                      model_cfg: ModelConfig | None = None) -> None:
    """Copy unsharded tensors into this rank's chunk: its layers, its TP slice (SwiGLU-aware when
    `model_cfg` says the MLP is gated)."""
    from megatron.app.model import global_parameter_name, tp_shard

    for local_name, param in chunk.named_parameters():
        name = global_parameter_name(chunk, local_name)
        if name not in full:
            raise ModelLoadError(f"no value for megatron-core parameter {name}")
        value = full[name]
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            value = tp_shard(name, value, param.partition_dim, tp, tp_rank, model_cfg or ModelConfig())
        if tuple(value.shape) != tuple(param.shape):
            raise ModelLoadError(f"{name}: the source holds {tuple(value.shape)}, the model wants {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))


def tokenizer_from_args(args: dict[str, Any], overrides: dict[str, Any], model_vocab_size: int | None = None,
                        source: str = "the checkpoint") -> Tokenizer:
    """The tokenizer a checkpoint was trained with (`args`, its saved flags), with the user's
    `overrides` (None = not given). `model_vocab_size` is the vocabulary the saved model was built
    for: it fills in a NullTokenizer's size that the flags do not record (--mock-data without
    --vocab-size trains on the default), and a tokenizer that disagrees with it is an error."""
    merged = {k: args.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file", "vocab_size")}
    merged.update({k: v for k, v in overrides.items() if v is not None})
    if merged["tokenizer_type"] is None and not (merged["vocab_file"] and merged["merge_file"]):
        merged["tokenizer_type"] = "NullTokenizer"  # what pretrain_gpt.py --mock-data trains with by default
    null = merged["tokenizer_type"] == "NullTokenizer"
    user_size = overrides.get("vocab_size")
    if user_size is not None and not null:
        raise ModelLoadError(f"--vocab-size is NullTokenizer's size; the tokenizer here is {merged['tokenizer_type']}, "
                             "which takes its vocabulary from its files: drop --vocab-size")
    if null and model_vocab_size and user_size is not None and int(user_size) + 1 != model_vocab_size:
        raise ModelLoadError(
            f"--vocab-size {user_size} disagrees with {source}: its model was trained with --vocab-size "
            f"{model_vocab_size - 1} (NullTokenizer: {model_vocab_size - 1} ids plus eod = {model_vocab_size}); "
            f"drop --vocab-size or pass {model_vocab_size - 1}")
    if null and merged["vocab_size"] is None and model_vocab_size:
        merged["vocab_size"] = model_vocab_size - 1  # NullTokenizer(N) has N ids plus eod
    try:
        kwargs = {"vocab_size": merged["vocab_size"]} if null else {}
        tokenizer = build_tokenizer(merged["tokenizer_type"], merged["vocab_file"], merged["merge_file"], **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"tokenizer: {exc} (override with --tokenizer-type/--vocab-file/--merge-file/"
                             "--vocab-size)") from exc
    if model_vocab_size and tokenizer.vocab_size != model_vocab_size:
        # The trainer sizes the model from its tokenizer, so this is another tokenizer than it trained with.
        raise ModelLoadError(
            f"the tokenizer {tokenizer!r} has {tokenizer.vocab_size} ids, but the model in {source} was trained "
            f"with a vocabulary of {model_vocab_size}; pass the tokenizer it was trained with "
            "(--tokenizer-type/--vocab-file/--merge-file/--vocab-size)")
    return tokenizer
