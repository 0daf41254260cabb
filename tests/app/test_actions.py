"""The pipeline IR: lowering static orders into actions with explicit communication, the one tag
function, and the simulator running action lists exactly as it runs the static orders."""
from __future__ import annotations

import itertools

import pytest

from megatron.app.actions import (PAYLOADS, Action, Op, check_matching, compute, compute_tasks, control_tag,
                                  eager_receives, format_actions, lower, message_tag, sends_after)
from megatron.app.schedule import SCHEDULES, PipelineLayout, build_schedule, parse_schedule
from megatron.app.simulator import CostModel, SimulationDeadlock, simulate_schedule
from megatron.app.simulator_actions import simulate_actions, simulate_lowered

LAYOUTS = [("1f1b", PipelineLayout(2, 1, 3)), ("1f1b", PipelineLayout(4, 1, 8)), ("gpipe", PipelineLayout(3, 2, 5)),
           ("interleaved", PipelineLayout(2, 2, 4)), ("interleaved", PipelineLayout(4, 3, 8)),
           ("1f1b", PipelineLayout(1, 1, 3))]


def test_1f1b_on_two_ranks_lowers_to_receives_just_before_use_and_sends_right_after():
    layout = PipelineLayout(2, 1, 2)
    first = format_actions(lower(layout, 0, build_schedule("1f1b", layout, 0), step=True))
    last = format_actions(lower(layout, 1, build_schedule("1f1b", layout, 1), step=True))
    assert first == ("F0.0 SEND(F0.0->1) F0.1 SEND(F0.1->1) RECV(B0.0<-1) B0.0 RECV(B0.1<-1) B0.1 "
                     "REDUCE_GRADS OPTIMIZER_STEP")
    assert last == ("RECV(F0.0<-0) F0.0 B0.0 SEND(B0.0->0) RECV(F0.1<-0) F0.1 B0.1 SEND(B0.1->0) "
                    "REDUCE_GRADS OPTIMIZER_STEP")


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("eager", [False, True], ids=["just-in-time", "eager"])
def test_every_lowered_send_meets_one_receive_and_the_compute_order_is_kept(name, layout, eager):
    """Just-in-time: the lowering pass. Eager: what a dynamic order yields for the same order."""
    orders = [build_schedule(name, layout, rank) for rank in range(layout.pp_size)]
    if eager:
        programs = [eager_receives(layout, rank, order)
                    + [a for task in order for a in (compute(task), *sends_after(layout, rank, task, eager=True))]
                    for rank, order in enumerate(orders)]
    else:
        programs = [lower(layout, rank, order) for rank, order in enumerate(orders)]
    check_matching(layout, programs)
    for order, program in zip(orders, programs):
        assert compute_tasks(program) == order
        for index, action in enumerate(program):  # a SEND follows the compute that produced it
            if action.op is Op.SEND:
                assert action.task in compute_tasks(program[:index])
            if action.op is Op.RECV and not eager:  # ...and a RECV precedes the compute that needs it
                assert action.task in compute_tasks(program[index:])


def test_forward_only_lowering_has_no_backward_and_no_step():
    layout = PipelineLayout(2, 2, 2)
    programs = [lower(layout, rank, build_schedule("interleaved", layout, rank), forward_only=True, step=True)
                for rank in range(2)]
    check_matching(layout, programs)
    assert all(action.task is not None and action.task.is_forward for program in programs for action in program)


def test_an_unmatched_send_is_named():
    layout = PipelineLayout(2, 1, 1)
    programs = [lower(layout, rank, build_schedule("1f1b", layout, rank)) for rank in range(2)]
    programs[1] = [a for a in programs[1] if a.op is not Op.RECV]
    with pytest.raises(ValueError, match="SEND without RECV, rank 0 -> rank 1"):
        check_matching(layout, programs)


def test_tags_are_unique_per_payload_stage_and_microbatch_and_control_tags_lie_above():
    layout = PipelineLayout(3, 2, 5)
    tags = [message_tag(p, v, m, layout.num_microbatches)
            for p, v, m in itertools.product(PAYLOADS, range(layout.num_virtual_stages), range(layout.num_microbatches))]
    assert len(set(tags)) == len(tags)
    assert control_tag(layout, 0) > max(tags)
    with pytest.raises(ValueError, match="unknown message payload 'X'"):
        message_tag("X", 0, 0, 1)


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=lambda v: str(v))
def test_action_lists_simulate_exactly_as_the_static_orders(name, layout):
    for seed in range(4):
        costs = CostModel(jitter=0.3, link_jitter=0.5, p2p_latency=0.4, seed=seed,
                          rank_slowdown={1: 1.7} if layout.pp_size > 1 else {})
        by_order, by_actions = simulate_schedule(name, layout, costs), simulate_lowered(name, layout, costs)
        assert by_actions.records == by_order.records
        assert by_actions.makespan == by_order.makespan
        assert by_actions.peak_stored_activations == by_order.peak_stored_activations
        key = lambda t: (t.send_time, t.src_rank, t.src_task)  # noqa: E731
        assert sorted(by_actions.transfers, key=key) == sorted(by_order.transfers, key=key)


def test_orders_that_wait_on_each_other_deadlock_in_the_action_simulator():
    layout = PipelineLayout(2, 1, 2)
    orders = [parse_schedule("F0.0 B0.0 F0.1 B0.1"), parse_schedule("F0.0 F0.1 B0.0 B0.1")]
    programs = [lower(layout, rank, order) for rank, order in enumerate(orders)]
    with pytest.raises(SimulationDeadlock, match=r"rank 1: .*\[RECV\(F0.1<-0\)\]|rank 1: .*\[F0.1\]") as error:
        simulate_actions(layout, programs)
    assert error.value.blocked[0] is not None and error.value.blocked[1] is not None


def test_every_static_schedule_is_lowered_by_the_same_pass():
    assert set(SCHEDULES) == {"1f1b", "interleaved", "gpipe", "zb-h1", "zb-h2"}
    layout = PipelineLayout(2, 1, 1)
    assert lower(layout, 0, build_schedule("gpipe", layout, 0)) == [
        Action(Op.FORWARD, build_schedule("gpipe", layout, 0)[0]),
        Action(Op.SEND, build_schedule("gpipe", layout, 0)[0], 1, message_tag("F", 1, 0, 1)),
        Action(Op.RECV, build_schedule("gpipe", layout, 0)[1], 1, message_tag("B", 0, 0, 1)),
        Action(Op.BACKWARD, build_schedule("gpipe", layout, 0)[1]),
    ]


# --- a peer is a global rank -------------------------------------------------------------------
def test_a_peer_is_the_global_rank_of_the_pipeline_rank_on_the_other_end():
    """PP=2 inside a TP=2 world: the pipeline of TP rank 1 is global ranks 1 and 3, and every
    peer the passes name is one of those, never a pipeline rank."""
    layout, ranks = PipelineLayout(2, 2, 4), [1, 3]
    orders = [build_schedule("interleaved", layout, rank) for rank in range(2)]
    programs = [lower(layout, rank, order, ranks=ranks, step=True) for rank, order in enumerate(orders)]
    assert format_actions(programs[1][:3]) == "RECV(F0.0<-1) F0.0 SEND(F0.0->1)"
    for rank, program in enumerate(programs):
        assert {a.peer for a in program if a.is_communication} == {ranks[1 - rank]}
        dynamic = eager_receives(layout, rank, orders[rank], ranks=ranks) + [
            a for task in orders[rank] for a in sends_after(layout, rank, task, eager=True, ranks=ranks)]
        assert {a.peer for a in dynamic} == {ranks[1 - rank]}
    check_matching(layout, programs, ranks=ranks)
    with pytest.raises(ValueError, match=r"peers \[3\] have no action list here .* pass each list's global rank"):
        check_matching(layout, programs)
    # Without ranks the world is the one pipeline: its pipeline ranks are the global ranks.
    assert lower(layout, 1, orders[1]) == lower(layout, 1, orders[1], ranks=range(2))
    with pytest.raises(ValueError, match=r"global rank of each of the pp_size\(2\) pipeline ranks, got 3"):
        lower(layout, 0, orders[0], ranks=[0, 2, 4])


def test_lists_with_global_peers_simulate_as_the_pipeline_they_are():
    layout = PipelineLayout(4, 1, 8)
    orders = [build_schedule("1f1b", layout, rank) for rank in range(4)]
    costs = CostModel(p2p_latency=0.2, jitter=0.3, seed=5)
    ranks = [2, 6, 10, 14]  # a pipeline of TP=2 x DP=2 x PP=4
    by_global = simulate_actions(layout, [lower(layout, r, o, ranks=ranks) for r, o in enumerate(orders)], costs,
                                 ranks=ranks)
    assert by_global == simulate_lowered("1f1b", layout, costs)
    with pytest.raises(ValueError, match=r"peers \[6, 10, 14\] have no action list here"):
        simulate_actions(layout, [lower(layout, r, o, ranks=ranks) for r, o in enumerate(orders)], costs,
                         ranks=[0, 1, 2, 3])
