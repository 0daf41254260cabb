"""Role layout, start-up maps, process-group kinds and the megatron-core globals FBD installs."""
from __future__ import annotations

import pytest

from megatron.app.config import ConfigError
from megatron.fbd.groups import missing_parallel_state_globals
from megatron.fbd.layout import build_layout


def test_each_logical_rank_gets_one_forward_and_one_backward_rank():
    layout = build_layout(16, tp=2, pp=2, ignore_forward_tp=False)
    assert (layout.replicas, layout.mesh_size) == (2, 8)
    seen = {}
    for i in layout.instances():
        seen.setdefault((i.replica, i.stage, i.tp_rank), []).append(i.role)
    assert len(seen) == 8 and all(sorted(roles) == ["bwd", "fwd"] for roles in seen.values())
    # Backward ranks form megatron-core's order (tp fastest, then dp, then pp) on ranks 0..7.
    assert [layout.backward_of(r, s, t) for s in range(2) for r in range(2) for t in range(2)] == list(range(8))
    assert layout.partners(layout.forward_of(1, 1, 1)) == [layout.backward_of(1, 1, 1)]
    groups = layout.groups()
    assert [0, 2] in groups["dp"] and [0, 1] in groups["tp"] and [0, 4] in groups["pp"]
    assert [8, 10] in groups["dp"] and [8, 12] in groups["pp"]  # forward instances have their own mesh


def test_merged_forward_needs_tp_plus_one_over_two_tp_of_the_ranks():
    for tp in (2, 4):
        before = 2 * tp * 2  # tp x pp(2) x dp(2)
        layout = build_layout(before * (tp + 1) // (2 * tp), tp=tp, pp=2, ignore_forward_tp=True)
        assert layout.replicas == 1 and layout.forward_tp == 1
        forward = [i for i in layout.instances() if i.is_forward]
        assert len(forward) == 2 and all(i.tp_size == 1 for i in forward)
        assert layout.partners(forward[0].rank) == [layout.backward_of(0, 0, t) for t in range(tp)]


def test_maps_name_every_rank():
    layout = build_layout(4, tp=1, pp=2, ignore_forward_tp=False)
    physical, virtual = layout.physical_map(), layout.virtual_map()
    assert "rank   2: fwd instance of replica 0 stage 0 tp 0/1" in physical
    assert "dp 0 pp 1 tp 0: fwd rank 3, bwd rank 1" in virtual


def test_threaded_forward_host_runs_every_stage_of_its_replica():
    from megatron.fbd.threads import coordinator_groups

    layout = build_layout(6, tp=1, pp=2, ignore_forward_tp=False, forward_per_process=2)
    assert (layout.replicas, layout.mesh_size) == (2, 4)
    assert [(i.stage, i.slot) for i in layout.hosted(5)] == [(0, 0), (1, 1)]
    assert [layout.forward_of(1, s, 0) for s in range(2)] == [5, 5]
    assert layout.partners(layout.hosted(5)[1]) == [layout.backward_of(1, 1, 0)] == [3]
    groups = layout.groups()
    assert [4, 5] in groups["dp"] and [5] in groups["pp"]  # no group holds a rank twice
    assert all(len(set(g)) == len(g) for kind in groups.values() for g in kind)
    # Coordinator groups: (backward rank, slot 0) with (forward host, thread slot = stage).
    assert coordinator_groups(layout) == [[(0, 0), (4, 0)], [(2, 0), (4, 1)], [(1, 0), (5, 0)], [(3, 0), (5, 1)]]


def test_threaded_host_of_two_replicas_and_of_merged_tensor_parallel_stages():
    from megatron.fbd.threads import coordinator_groups

    # PP=1, 2 replicas per host: 4 backward ranks, 2 hosts.
    layout = build_layout(6, tp=1, pp=1, ignore_forward_tp=False, forward_per_process=2)
    assert (layout.replicas, layout.hosts) == (4, 2)
    assert [(i.replica, i.slot) for i in layout.hosted(5)] == [(2, 0), (3, 1)]
    assert coordinator_groups(layout) == [[(0, 0), (4, 0)], [(1, 0), (4, 1)], [(2, 0), (5, 0)], [(3, 0), (5, 1)]]
    # TP=2 PP=2 merged: one host holds both stages; each weight group has both backward TP ranks.
    layout = build_layout(5, tp=2, pp=2, ignore_forward_tp=True, forward_per_process=2)
    assert [(i.stage, i.tp_size, i.slot) for i in layout.hosted(4)] == [(0, 1, 0), (1, 1, 1)]
    assert layout.partners(layout.hosted(4)[1]) == [2, 3]
    assert coordinator_groups(layout) == [[(0, 0), (1, 0), (4, 0)], [(2, 0), (3, 0), (4, 1)]]


def test_merged_weight_hand_off_sums_to_the_shards_side_by_side():
    import torch

    from megatron.fbd.runner import weight_contribution

    layout = build_layout(5, tp=2, pp=2, ignore_forward_tp=True, forward_per_process=2)
    shard0, shard1 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    total = weight_contribution(layout, 0, shard0) + weight_contribution(layout, 1, shard1) + torch.zeros(4)
    assert total.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("world,tp,pp,ignore,fragment", [
    (6, 1, 2, False, "data-parallel size must be even: world_size(6) / (tp(1) x pp(2)) = dp(3) is odd"),
    (5, 2, 1, False, "tp(2) x pp(1) x dp(2) = 4 != world_size(5)"),
    (4, 2, 1, True, "multiple of pp(1) x (tp(2) + 1) = 3"),
])
def test_impossible_layouts_name_every_factor(world, tp, pp, ignore, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        build_layout(world, tp, pp, ignore)
    assert fragment in str(info.value)


def test_megatron_core_still_has_the_parallel_state_globals_fbd_sets():
    assert missing_parallel_state_globals() == []


@pytest.mark.parametrize("world,tp,pp,ignore_tp,chunks", [(4, 1, 2, False, 1), (8, 2, 2, False, 1), (6, 2, 2, True, 1),
                                                          (4, 1, 2, False, 2), (8, 1, 4, False, 1)])
def test_the_roles_action_lists_match_every_send_with_one_receive(world, tp, pp, ignore_tp, chunks):
    """Both roles are IR action lists: over all instances, each SEND meets exactly one RECV (same
    tag), and the backward role ends with the gradient reduction and the optimizer step."""
    from megatron.app.actions import Op, check_matching
    from megatron.app.schedule import PipelineLayout
    from megatron.fbd.roles import backward_role, forward_role

    layout = build_layout(world, tp, pp, ignore_tp, 1)
    programs = []
    for rank in range(world):
        me = layout.instance(rank)
        role = forward_role if me.is_forward else backward_role
        programs.append(role(layout, me, chunks, 4))
    check_matching(PipelineLayout(world, 1, 1), programs)
    for rank, program in enumerate(programs):
        kinds = [action.op for action in program]
        assert kinds[0] is Op.WEIGHTS
        if layout.instance(rank).is_forward:
            assert kinds.count(Op.FORWARD) == chunks * 4 and Op.BACKWARD not in kinds
        else:
            assert kinds.count(Op.RECOMPUTE) == kinds.count(Op.BACKWARD) == chunks * 4
            assert kinds[-2:] == [Op.REDUCE_GRADS, Op.OPTIMIZER_STEP]
