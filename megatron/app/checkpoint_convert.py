"""A checkpoint saved with one pipeline layer split, converted to another (same TP and PP sizes,
same model): `convert_rank_payload` builds the file a run would have written with its own split
from the saved files of its TP rank, moving decoder layers and their optimizer state by global
layer number. Loading calls it (checkpoint.load_checkpoint); tools/convert_checkpoint.py writes
such files for a whole checkpoint."""
from __future__ import annotations

from typing import Any

import torch

from megatron.app.checkpoint_files import DECODER_LAYER, SPLIT, CheckpointError, saved_layer_split
from megatron.app.config import chunk_layers, first_layer_of, format_layer_split, locate_layer
from megatron.app.optimizers import applies_weight_decay, group_order

# The parameters megatron-core marks `is_embedding_or_output_parameter` (their own groups with
# --decoupled-lr); only needed for checkpoints that do not record their optimizer's parameter order.
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
_Entry = tuple[torch.Tensor, dict, bool]  # a saved parameter: tensor, optimizer state, decoupled group or not


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
        match = DECODER_LAYER.match(key)
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
            if not DECODER_LAYER.match(local):
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
            match = DECODER_LAYER.match(local)
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
