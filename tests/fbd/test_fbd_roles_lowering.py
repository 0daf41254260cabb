"""MegaFBD's roles come from the IR's disaggregated lowering pass: the lists are exactly those the
hand-written roles built (kept below as the reference), over many role layouts; every peer is a
global rank; and the lists of a whole world run to the end in the action simulator."""
from __future__ import annotations

import itertools

import pytest

from megatron.app.actions import Action, Op, check_matching, message_tag, step_actions
from megatron.app.schedule import PipelineLayout, Task, TaskKind
from megatron.app.simulator_actions import simulate_actions
from megatron.fbd.layout import FBDLayout, Instance, build_layout
from megatron.fbd.roles import backward_role, forward_role


# --- the reference: the roles as they were written by hand before the lowering pass ------------
def _reference_place(layout: FBDLayout, stage: int, chunk: int, num_chunks: int):
    here = chunk * layout.pp + stage

    def neighbour(virtual: int) -> tuple[int, int] | None:
        return (virtual % layout.pp, virtual // layout.pp) if 0 <= virtual < num_chunks * layout.pp else None

    return neighbour(here - 1), neighbour(here + 1), here


def reference_forward_role(layout: FBDLayout, me: Instance, num_chunks: int, num_microbatches: int) -> list[Action]:
    backward_ranks = layout.partners(me)
    actions = [Action(Op.WEIGHTS)]
    for chunk in range(num_chunks):
        previous, following, here = _reference_place(layout, me.stage, chunk, num_chunks)
        for microbatch in range(num_microbatches):
            task = Task(TaskKind.FORWARD, chunk, microbatch)
            if previous is not None:
                peer = layout.forward_of(me.replica, previous[0], me.tp_rank)
                actions.append(Action(Op.RECV, task, peer, message_tag("F", here, microbatch, num_microbatches)))
            actions.append(Action(Op.FORWARD, task))
            if following is not None:
                peer = layout.forward_of(me.replica, following[0], me.tp_rank)
                actions.append(Action(Op.SEND, task, peer, message_tag("F", here + 1, microbatch, num_microbatches)))
            for rank in backward_ranks:
                if previous is not None:
                    actions.append(Action(Op.SEND, task, rank, message_tag("S", here, microbatch, num_microbatches),
                                          "S"))
                actions.append(Action(Op.SEND, task, rank, message_tag("R", here, microbatch, num_microbatches), "R"))
    return actions


def reference_backward_role(layout: FBDLayout, me: Instance, num_chunks: int, num_microbatches: int) -> list[Action]:
    (forward_rank,) = layout.partners(me.rank)
    actions = [Action(Op.WEIGHTS)]
    for chunk in reversed(range(num_chunks)):
        previous, following, here = _reference_place(layout, me.stage, chunk, num_chunks)
        for microbatch in range(num_microbatches):
            forward, backward = Task(TaskKind.FORWARD, chunk, microbatch), Task(TaskKind.BACKWARD, chunk, microbatch)
            if previous is not None:
                actions.append(Action(Op.RECV, forward, forward_rank,
                                      message_tag("S", here, microbatch, num_microbatches), "S"))
            actions.append(Action(Op.RECV, forward, forward_rank, message_tag("R", here, microbatch, num_microbatches),
                                  "R"))
            actions.append(Action(Op.RECOMPUTE, forward))
            if following is not None:
                peer = layout.backward_of(me.replica, following[0], me.tp_rank)
                actions.append(Action(Op.RECV, backward, peer, message_tag("B", here, microbatch, num_microbatches)))
            actions.append(Action(Op.BACKWARD, backward))
            if previous is not None:
                peer = layout.backward_of(me.replica, previous[0], me.tp_rank)
                actions.append(Action(Op.SEND, backward, peer,
                                      message_tag("B", here - 1, microbatch, num_microbatches)))
    return actions + step_actions()


# --- the layouts ------------------------------------------------------------------------------
def _layouts():
    """(description, FBDLayout): pp 1-4, tp 1-2, one or two replicas, separate or merged forward
    TP, and threaded forward hosts."""
    for pp, tp, replicas in itertools.product((1, 2, 3, 4), (1, 2), (1, 2)):
        yield f"pp{pp}-tp{tp}-r{replicas}", build_layout(2 * tp * pp * replicas, tp, pp, False)
        yield f"pp{pp}-tp{tp}-r{replicas}-merged", build_layout(pp * (tp + 1) * replicas, tp, pp, True)
        per_process = 2 if pp == 1 else 1  # replicas per forward host
        yield (f"pp{pp}-tp{tp}-h{replicas}-threaded", build_layout(
            (per_process * pp * tp + 1) * replicas, tp, pp, tp > 1, forward_per_process=per_process * pp))


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_the_lowering_pass_builds_exactly_the_hand_written_roles(name, layout):
    compared = 0
    for me in layout.instances():
        for chunks, microbatches in itertools.product((1, 2, 3), (1, 2, 3, 5, 8)):
            if me.is_forward:
                assert forward_role(layout, me, chunks, microbatches) == reference_forward_role(
                    layout, me, chunks, microbatches), (me, chunks, microbatches)
            else:
                assert backward_role(layout, me, chunks, microbatches) == reference_backward_role(
                    layout, me, chunks, microbatches), (me, chunks, microbatches)
            compared += 1
    assert compared == 15 * sum(1 for _ in layout.instances())
    assert layout.threaded == name.endswith("threaded")


def test_a_peer_is_the_global_rank_of_the_instance_on_the_other_end():
    layout = build_layout(16, tp=2, pp=2, ignore_forward_tp=False)  # backward ranks 0-7, forward 8-15
    me = layout.instance(layout.backward_of(1, 1, 1))  # replica 1, last stage, tp rank 1: rank 7
    actions = backward_role(layout, me, 1, 1)
    assert [(str(a), a.peer) for a in actions if a.is_communication] == [
        ("RECV(F0.0:S<-15)", 15), ("RECV(F0.0:R<-15)", 15), ("SEND(B0.0->3)", 3)]
    forward = forward_role(layout, layout.instance(15), 1, 1)
    assert [str(a) for a in forward if a.is_communication] == ["RECV(F0.0<-11)", "SEND(F0.0:S->7)", "SEND(F0.0:R->7)"]


@pytest.mark.parametrize("name,layout", [(n, l) for n, l in LAYOUTS if not l.threaded], ids=lambda v: str(v)[:24])
def test_the_roles_of_a_whole_world_run_to_the_end_in_the_action_simulator(name, layout):
    """One list per global rank: the forward instances' activations and hand-offs and the backward
    instances' gradients all meet their receives, and nothing waits forever."""
    for chunks in (1, 2):
        programs = [(forward_role if layout.instance(rank).is_forward else backward_role)(
            layout, layout.instance(rank), chunks, 3) for rank in range(layout.world_size)]
        check_matching(PipelineLayout(layout.world_size, 1, 1), programs)
        result = simulate_actions(PipelineLayout(layout.world_size, chunks, 3), programs)
        for rank in range(layout.world_size):
            ran = result.order(rank)
            assert len(ran) == (1 if layout.instance(rank).is_forward else 2) * chunks * 3, (rank, ran)
