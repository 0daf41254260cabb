"""Checkpoints: one file per (tp, pp) rank under `iter_NNNNNNN/`, written atomically.

Each rank writes its file into `iter_N.tmp/` (temp file + rename); after all ranks finished,
global rank 0 renames the directory to `iter_N/` and then updates the tracker file. A run killed
mid-save leaves only a `.tmp` directory, which is never loaded.

A checkpoint saved with another pipeline layer split (same TP and PP sizes, same model) is
converted while loading: `convert_rank_payload` builds the file the run would have written with its
own split from the saved files of its TP rank, moving decoder layers and their optimizer state by
global layer number. tools/convert_checkpoint.py writes such files for a whole checkpoint. The
module is over 400 lines because the converter works on the file format, layout signature and
errors defined here, and loading calls it.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.app.config import chunk_layers, first_layer_of, format_layer_split, locate_layer
from megatron.app.model import global_parameter_name, unwrap_model
from megatron.app.optimizers import Fp16Optimizer, TorchOptimizer, applies_weight_decay, group_order

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, or does not match the launch configuration."""


def iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def rank_file(directory: Path, tp_rank: int, pp_rank: int) -> Path:
    return directory / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model_optim_rng.pt"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def layout_signature(cfg) -> dict[str, Any]:
    """What must match between the saving and the loading run."""
    m, p = cfg.model, cfg.parallel
    return {
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "num_chunks": cfg.num_chunks,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "ffn_hidden_size": m.ffn_hidden_size,
        "padded_vocab_size": m.padded_vocab_size,
        "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights,
        "position_embedding_type": m.position_embedding_type,
        SPLIT: p.layers_per_stage(m.num_layers),
    }


SPLIT = "pipeline_layer_split"
_DECODER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# The parameters megatron-core marks `is_embedding_or_output_parameter` (their own groups with
# --decoupled-lr); only needed for checkpoints that do not record their optimizer's parameter order.
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
_Entry = tuple[torch.Tensor, dict, bool]  # a saved parameter: tensor, optimizer state, decoupled group or not


def saved_layer_split(layout: dict) -> list[int]:
    """The layer split a checkpoint's layout signature records (checkpoints written before splits
    were recorded hold the even one)."""
    if layout.get(SPLIT) is not None:
        return [int(n) for n in layout[SPLIT]]
    pp = int(layout["pipeline_model_parallel_size"])
    return [int(layout["num_layers"]) // pp] * pp


def parameter_key(chunk: torch.nn.Module, local_name: str) -> str:
    """The name a checkpoint converter tracks a state entry of a model chunk by: decoder layers by
    their global layer number, everything else (embedding, final norm, output layer: they stay on
    the first and last stage) by its name in the chunk."""
    if _DECODER_LAYER.match(local_name):
        return global_parameter_name(chunk, local_name)
    return local_name


def optimizer_kind(optimizer) -> str:
    if isinstance(optimizer, Fp16Optimizer):
        return "fp16-adamw"
    if isinstance(optimizer, TorchOptimizer):
        return "adamw"
    return "megatron-core"


def optimizer_parameter_keys(chunks, optimizer) -> list[str] | None:
    """`parameter_key` of each parameter in the optimizer's order (the positions its state_dict
    is keyed by); None for megatron-core's optimizer."""
    key_of = {}
    for chunk in chunks:
        module = unwrap_model(chunk)
        for local_name, param in module.named_parameters():
            key_of[id(param)] = parameter_key(module, local_name)
    if isinstance(optimizer, Fp16Optimizer):
        params = [param for param, _ in optimizer.pairs]
    elif isinstance(optimizer, TorchOptimizer):
        params = [param for group in optimizer.param_groups for param in group["params"]]
    else:
        return None
    return [key_of[id(param)] for param in params]


def save_checkpoint(root: str, iteration: int, consumed_samples: int, chunks, optimizer, cfg,
                    tp_rank: int, pp_rank: int, dp_rank: int) -> Path:
    """Collective over all ranks. Returns the final directory."""
    final = iteration_dir(root, iteration)
    staging = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        if staging.exists():
            shutil.rmtree(staging)  # a torn earlier attempt at this same iteration, made by us
        staging.mkdir(parents=True)
    dist.barrier()
    if dp_rank == 0:
        target = rank_file(staging, tp_rank, pp_rank)
        payload = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "layout": layout_signature(cfg),
            "model": [unwrap_model(c).state_dict() for c in chunks],
            "optimizer": optimizer.state_dict(),
            "optimizer_kind": optimizer_kind(optimizer),
            "optimizer_keys": optimizer_parameter_keys(chunks, optimizer),
            "rng": rng_state(),
            "args": {k: v for k, v in vars(cfg.args).items() if isinstance(v, (int, float, str, bool, type(None), list))},
            "model_config": asdict(cfg.model),
        }
        write_rank_file(target, payload)
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        atomic_write_text(Path(root) / TRACKER, f"{iteration}\n")
    dist.barrier()
    return final


def write_rank_file(target: Path, payload: dict) -> None:
    """One rank's file, whole or not at all: a temp file beside it, synced, then renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    torch.save(payload, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read_rank_file(path: Path) -> dict:
    """A rank file's payload; CheckpointError when it cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); the file is damaged") from exc


def has_checkpoint(root: str) -> bool:
    """Whether `root` holds a complete checkpoint (its tracker file exists)."""
    return (Path(root) / TRACKER).is_file()


def find_latest(root: str) -> int:
    tracker = Path(root) / TRACKER
    if not Path(root).is_dir():
        raise CheckpointError(f"--load {root}: directory does not exist; check the path or drop --load")
    if not tracker.is_file():
        raise CheckpointError(
            f"--load {root}: no {TRACKER} in it, so it holds no complete checkpoint "
            "(a save that was interrupted leaves only iter_*.tmp directories)"
        )
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


def _read_rank_file(root: str, cfg, tp_rank: int, pp_rank: int, ignore: tuple[str, ...] = ()) -> dict:
    """The latest checkpoint's file of (tp_rank, pp_rank), checked against the run's layout
    (except the `ignore`d entries)."""
    iteration = find_latest(root)
    path = rank_file(iteration_dir(root, iteration), tp_rank, pp_rank)
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: the checkpoint in {root} was not saved with this rank's "
            f"(tp={tp_rank}, pp={pp_rank}) coordinates; load it with the parallel sizes it was saved with"
        )
    payload = read_rank_file(path)
    expected = layout_signature(cfg)
    saved = payload.get("layout", {})
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs run {v!r}" for k, v in expected.items()
             if k not in ignore and saved.get(k) != v]
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} does not match this run:\n  " + "\n  ".join(diffs)
            + "\nlaunch with the checkpoint's model and parallel sizes"
        )
    return payload


def load_checkpoint(root: str, chunks, optimizer, cfg, tp_rank: int, pp_rank: int) -> tuple[int, int]:
    """Returns (iteration, consumed_samples). Raises CheckpointError with what to change. A
    checkpoint saved with another pipeline layer split is converted to the run's."""
    payload = _read_rank_file(root, cfg, tp_rank, pp_rank, ignore=(SPLIT,))
    saved_split, split = saved_layer_split(payload["layout"]), layout_signature(cfg)[SPLIT]
    if saved_split != split:
        payload = _convert_while_loading(root, payload, chunks, optimizer, cfg, tp_rank, pp_rank)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"converted checkpoint from layer split {format_layer_split(saved_split)} to "
                  f"{format_layer_split(split)} while loading", flush=True)
    for chunk, state in zip(chunks, payload["model"]):
        unwrap_model(chunk).load_state_dict(state)
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"]


def _convert_while_loading(root: str, own: dict, chunks, optimizer, cfg, tp_rank: int, pp_rank: int) -> dict:
    saved = format_layer_split(saved_layer_split(own["layout"]))
    if optimizer_kind(optimizer) == "megatron-core":
        raise CheckpointError(
            f"the checkpoint in {root} was saved with layer split {saved}, this run asks for "
            f"{format_layer_split(layout_signature(cfg)[SPLIT])}: converting while loading is done for this "
            "trainer's CPU optimizer only, not megatron-core's (--device cuda). Resume with --pipeline-layer-split "
            f"{saved}; tools/convert_checkpoint.py converts checkpoints of CPU runs only")
    files = {pp_rank: own}

    def read(stage: int) -> dict:
        if stage not in files:
            files[stage] = _read_rank_file(root, cfg, tp_rank, stage, ignore=(SPLIT,))
        return files[stage]

    try:
        converted = convert_rank_payload(read, pp_rank, layout_signature(cfg)[SPLIT])
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}\nresume with --pipeline-layer-split {saved} (the saved split)") from exc
    if converted["optimizer_kind"] != optimizer_kind(optimizer):
        raise CheckpointError(
            f"the checkpoint in {root} holds {converted['optimizer_kind']} optimizer state but this run uses "
            f"{optimizer_kind(optimizer)}; resume with the precision flags (--fp16) it was saved with")
    expected = optimizer_parameter_keys(chunks, optimizer)
    if converted["optimizer_keys"] != expected:
        raise CheckpointError(
            f"converting the checkpoint in {root} from layer split {saved}: the converted optimizer state does not "
            f"line up with this run's parameters (stage {pp_rank}: {len(converted['optimizer_keys'])} converted, "
            f"{len(expected)} in the optimizer); resume with --pipeline-layer-split {saved}")
    return converted


def convert_rank_payload(read, stage: int, split: list[int]) -> dict:
    """The checkpoint file stage `stage` of one TP rank would hold with layer split `split`, built
    from the saved files of that TP rank (`read(stage) -> payload`, read only where needed): the
    stage's own file gives the embedding, final norm, output layer (tied or not), RNG state, loss
    scaler and iteration; each decoder layer, with its optimizer state (AdamW moments and step, fp16
    master weights), comes from the file that holds it under the saved split. Same TP and PP sizes,
    number of layers and virtual chunks as the saved run."""
    own = read(stage)
    layout = own["layout"]
    problems = conversion_problems(own, split)
    if problems:
        raise CheckpointError("cannot convert the checkpoint: " + "; ".join(problems))
    saved_split = saved_layer_split(layout)
    num_chunks = int(layout.get("num_chunks", 1))
    kind = _optimizer_kind_of(own)
    old_sizes, new_sizes = chunk_layers(saved_split, num_chunks), chunk_layers(split, num_chunks)

    def source_of(key: str) -> tuple[int, str]:
        """(saved stage, key there is tracked by) of a converted state entry."""
        match = _DECODER_LAYER.match(key)
        return (locate_layer(old_sizes, int(match.group(1)))[0], key) if match else (stage, key)

    entries: dict[int, dict[str, _Entry]] = {}  # saved stage -> tracked key -> entry

    def entries_of(saved_stage: int) -> dict[str, _Entry]:
        if saved_stage not in entries:
            payload = read(saved_stage)
            if saved_layer_split(payload["layout"]) != saved_split or payload["iteration"] != own["iteration"]:
                raise CheckpointError(f"the saved files of stages {stage} and {saved_stage} come from different "
                                      "saves (layer split or iteration differ); the checkpoint is damaged")
            entries[saved_stage] = _tracked_entries(payload, saved_stage, old_sizes, kind)
        return entries[saved_stage]

    model, keys = [], []
    for chunk in range(num_chunks):
        state: dict[str, Any] = {}
        first = first_layer_of(new_sizes, stage, chunk)
        placed = False
        for local, value in own["model"][chunk].items():
            if not _DECODER_LAYER.match(local):
                state[local] = value
                keys.append(local)
                continue
            if placed:
                continue
            placed = True  # this chunk's decoder layers go where the saved chunk's were
            for index in range(new_sizes[stage][chunk]):
                layer = first + index
                saved_stage, saved_chunk, saved_index = locate_layer(old_sizes, layer)
                prefix = f"decoder.layers.{saved_index}."
                for saved_local, saved_value in read(saved_stage)["model"][saved_chunk].items():
                    if saved_local.startswith(prefix):
                        suffix = saved_local[len(prefix):]
                        state[f"decoder.layers.{index}.{suffix}"] = saved_value
                        keys.append(f"decoder.layers.{layer}.{suffix}")
        model.append(state)

    # The optimizer's parameter order as parameter_groups builds it: groups by (decay, decoupled)
    # in group_order, each in the chunks' parameter order.
    groups: dict[tuple[bool, bool], list[str]] = {}
    for key in keys:
        saved_stage, tracked = source_of(key)
        found = entries_of(saved_stage).get(tracked)
        if found is None:
            continue  # not a parameter (a buffer or extra state)
        tensor, _, decoupled = found
        groups.setdefault((applies_weight_decay(key, tensor.ndim), bool(decoupled)), []).append(key)
    own_groups = _group_settings(own, kind, entries_of(stage))
    order = sorted(groups, key=group_order)
    missing = [ident for ident in order if ident not in own_groups]
    if missing:
        raise CheckpointError(f"stage {stage}'s saved optimizer has no parameter group for {missing} "
                              "(decay, decoupled); the checkpoint cannot be converted")
    optimizer_keys = [key for ident in order for key in groups[ident]]
    found = [entries_of(saved_stage)[tracked] for saved_stage, tracked in map(source_of, optimizer_keys)]
    torch_state = {index: entry[1]["state"] for index, entry in enumerate(found) if entry[1]["state"] is not None}
    masters = [entry[1]["master"] for entry in found]
    param_groups, start = [], 0
    for ident in order:
        param_groups.append({**own_groups[ident], "params": list(range(start, start + len(groups[ident])))})
        start += len(groups[ident])
    optimizer = {"state": torch_state, "param_groups": param_groups}
    if kind == "fp16-adamw":
        optimizer = {"optimizer": optimizer, "masters": masters, "scaler": own["optimizer"]["scaler"]}
    converted = dict(own)
    converted.update(model=model, optimizer=optimizer, optimizer_kind=kind, optimizer_keys=optimizer_keys,
                     layout={**layout, SPLIT: list(split)})
    args = dict(own.get("args", {}))
    if args:
        args.update(pipeline_layer_split=list(split), decoder_first_pipeline_num_layers=None,
                    decoder_last_pipeline_num_layers=None)
        converted["args"] = args
    return converted


def conversion_problems(payload: dict, split: list[int]) -> list[str]:
    """What keeps a checkpoint (one of its rank files' `payload`) from being converted to `split`."""
    layout = payload["layout"]
    pp, num_layers = int(layout["pipeline_model_parallel_size"]), int(layout["num_layers"])
    num_chunks = int(layout.get("num_chunks", 1))
    shown = format_layer_split(split)
    problems = []
    if len(split) != pp:
        problems.append(f"layer split {shown} has {len(split)} entries but the checkpoint has {pp} pipeline stages; "
                        "give one layer count per stage")
    if sum(split) != num_layers:
        problems.append(f"layer split {shown} sums to {sum(split)}, but the sum must be the checkpoint's "
                        f"{num_layers} layers")
    if any(n < 1 or n % num_chunks for n in split):
        problems.append(f"layer split {shown}: the checkpoint has {num_chunks} model chunk(s) per stage, so every "
                        f"entry must be a positive multiple of {num_chunks}")
    if _optimizer_kind_of(payload) == "megatron-core":
        problems.append(f"it holds megatron-core's optimizer state (a --device cuda run, saved with layer split "
                        f"{format_layer_split(saved_layer_split(layout))}); only checkpoints of this trainer's CPU "
                        "optimizer are converted")
    return problems


def _optimizer_kind_of(payload: dict) -> str:
    kind = payload.get("optimizer_kind")
    if kind is not None:
        return kind
    state = payload.get("optimizer", {})
    if isinstance(state, dict) and "masters" in state and "scaler" in state:
        return "fp16-adamw"
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if groups and "state" in state and all("decoupled" in group for group in groups):
        return "adamw"
    return "megatron-core"


def _torch_state(payload: dict, kind: str) -> dict:
    return payload["optimizer"]["optimizer"] if kind == "fp16-adamw" else payload["optimizer"]


def _tracked_entries(payload: dict, stage: int, sizes: list[list[int]], kind: str) -> dict[str, _Entry]:
    """Tracked key -> (tensor, {"state": AdamW state, "master": fp16 master}, decoupled) of every
    parameter in a saved stage file."""
    tensors = {}
    for chunk, state in enumerate(payload["model"]):
        first = first_layer_of(sizes, stage, chunk)
        for local, value in state.items():
            match = _DECODER_LAYER.match(local)
            key = f"decoder.layers.{first + int(match.group(1))}.{local[match.end():]}" if match else local
            tensors[key] = value
    keys = payload.get("optimizer_keys") or _reconstructed_keys(payload, tensors, kind)
    torch_state = _torch_state(payload, kind)
    decoupled_at = {}
    for group in torch_state["param_groups"]:
        for index in group["params"]:
            decoupled_at[index] = bool(group.get("decoupled"))
    masters = payload["optimizer"]["masters"] if kind == "fp16-adamw" else None
    if len(keys) != len(decoupled_at) or (masters is not None and len(masters) != len(keys)):
        raise CheckpointError(f"stage {stage}'s saved optimizer holds {len(decoupled_at)} parameters but its model "
                              f"{len(keys)}; the checkpoint cannot be converted")
    return {key: (tensors[key], {"state": torch_state["state"].get(index),
                                 "master": masters[index] if masters is not None else None}, decoupled_at[index])
            for index, key in enumerate(keys)}


def _reconstructed_keys(payload: dict, tensors: dict[str, Any], kind: str) -> list[str]:
    """The optimizer's parameter order of a file that does not record it: the model's tensors in
    state_dict order, grouped as parameter_groups groups them; checked against the saved groups."""
    groups = _torch_state(payload, kind)["param_groups"]
    decoupled_on = any(group.get("decoupled") for group in groups)
    by_group: dict[tuple[bool, bool], list[str]] = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
            continue
        ident = (applies_weight_decay(key, value.ndim), decoupled_on and key in _EMBEDDING_OR_OUTPUT)
        by_group.setdefault(ident, []).append(key)
    order = sorted(by_group, key=group_order)
    if [len(by_group[ident]) for ident in order] != [len(group["params"]) for group in groups] or any(
            bool(group.get("decoupled")) != ident[1] for ident, group in zip(order, groups)):
        raise CheckpointError("the checkpoint does not record its optimizer's parameter order and it cannot be "
                              "told from the model's; it cannot be converted to another layer split")
    return [key for ident in order for key in by_group[ident]]


def _group_settings(payload: dict, kind: str, entries: dict) -> dict[tuple[bool, bool], dict]:
    """(decay, decoupled) -> the saved group's settings (lr, betas, weight decay, ...), of one file."""
    keys = list(entries)  # in the optimizer's order
    settings = {}
    for group in _torch_state(payload, kind)["param_groups"]:
        if not group["params"]:
            continue
        tensor, _, decoupled = entries[keys[group["params"][0]]]
        ident = (applies_weight_decay(keys[group["params"][0]], tensor.ndim), bool(decoupled))
        settings[ident] = {k: v for k, v in group.items() if k != "params"}
    return settings


def load_progress(root: str, cfg, tp_rank: int, pp_rank: int, any_tensor_parallel_size: bool = False) -> tuple[int, int]:
    """Resume a rank that gets its weights from elsewhere: only the iteration, the consumed samples
    and the RNG state of file (tp_rank, pp_rank) are restored (its layer split does not matter).
    With `any_tensor_parallel_size`, the file may come from a run of another TP size (a merged rank
    reads TP rank 0's file)."""
    ignore = ("tensor_model_parallel_size", SPLIT) if any_tensor_parallel_size else (SPLIT,)
    payload = _read_rank_file(root, cfg, tp_rank, pp_rank, ignore)
    set_rng_state(payload["rng"])
    return payload["iteration"], payload["consumed_samples"]
