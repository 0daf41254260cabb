"""Process groups for an FBD layout, installed as megatron-core's parallel state.

megatron-core's `initialize_model_parallel` builds one uniform tp x pp x dp mesh over the whole
world; FBD needs two meshes side by side (backward instances: the training mesh; forward
instances: their own, possibly with TP=1). Every rank creates every group (torch.distributed
requires the same `new_group` calls in the same order everywhere) and then points the
parallel_state module globals at its own groups, the same globals `initialize_model_parallel`
sets. No megatron-core code is changed; `PARALLEL_STATE_GLOBALS` lists what is assigned and
tests/fbd/test_fbd_layout.py fails if a megatron-core upgrade drops one of them.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron.fbd.layout import FBDLayout

# parallel_state global -> the kind of group (from FBDLayout.groups) it holds for this rank.
PARALLEL_STATE_GLOBALS: dict[str, str] = {
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_EMBEDDING_GROUP": "embedding",
    "_POSITION_EMBEDDING_GROUP": "position_embedding",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_GLOO": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "dp",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp",
    "_CONTEXT_PARALLEL_GROUP": "self",
    # No experts in this model: expert groups mirror the dense ones, as with ep=1, etp=tp.
    "_EXPERT_MODEL_PARALLEL_GROUP": "self",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "mp",
    "_EXPERT_DATA_PARALLEL_GROUP": "dp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "dp",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": "dp",
}
# parallel_state global -> kind whose global-rank list it holds.
PARALLEL_STATE_RANK_LISTS: dict[str, str] = {
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_EMBEDDING_GLOBAL_RANKS": "embedding",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "position_embedding",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "self",
    "_EXPERT_MODEL_PARALLEL_RANKS": "self",
}
# Rank / size overrides that must be unset so the getters ask the groups.
_OVERRIDES_TO_CLEAR = (
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_WORLD_SIZE", "_MPU_DATA_PARALLEL_RANK", "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK", "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
)


def create_groups(layout: FBDLayout) -> dict[tuple[int, ...], object]:
    """Every distinct rank set of the layout as a process group, keyed by its sorted ranks.
    Collective: all ranks call `new_group` for the same sets in the same order."""
    made: dict[tuple[int, ...], object] = {}
    for kind, groups in layout.groups().items():
        for ranks in groups:
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(ranks=list(key))
    return made


def install_parallel_state(layout: FBDLayout, made: dict[tuple[int, ...], object], rank: int,
                           vpp: int | None = None) -> None:
    """Point megatron-core's parallel_state at this rank's groups of the FBD layout (and the virtual
    pipeline size, as initialize_model_parallel sets it)."""
    from megatron.core import parallel_state

    for name in _OVERRIDES_TO_CLEAR:
        setattr(parallel_state, name, None)
    groups = layout.groups()
    mine = {kind: next((g for g in groups[kind] if rank in g), None) for kind in groups}
    # A middle pipeline stage is in no embedding group: megatron-core leaves those unset too.
    for name, kind in PARALLEL_STATE_GLOBALS.items():
        setattr(parallel_state, name, None if mine[kind] is None else made[tuple(mine[kind])])
    for name, kind in PARALLEL_STATE_RANK_LISTS.items():
        setattr(parallel_state, name, None if mine[kind] is None else list(mine[kind]))
    if layout.threaded and rank >= layout.mesh_size:
        # A forward host runs every stage (one thread each): the pipeline is pp stages, all on this
        # rank; each chunk is built for its stage through its own pipeline group view (threads.py).
        parallel_state._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = layout.pp
        parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK = 0
        parallel_state._PIPELINE_GLOBAL_RANKS = [rank] * layout.pp
    if vpp is not None:
        parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        parallel_state._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = vpp
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def missing_parallel_state_globals() -> list[str]:
    """Names this module assigns that megatron-core's parallel_state no longer defines."""
    from megatron.core import parallel_state

    names = [*PARALLEL_STATE_GLOBALS, *PARALLEL_STATE_RANK_LISTS, *_OVERRIDES_TO_CLEAR, "_GLOBAL_MEMORY_BUFFER"]
    return [n for n in names if not hasattr(parallel_state, n)]
