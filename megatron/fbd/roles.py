"""MegaFBD's two roles as action lists of the pipeline IR (megatron.app.actions), run by the spine's
one executor:

    forward instance:  WEIGHTS  per chunk, microbatch: [RECV F] F(hand-off) [SEND F] [SEND S] SEND R
    backward instance: WEIGHTS  per chunk (last first), microbatch: [RECV S] RECV R RECOMPUTE
                                [RECV B] B [SEND B]   then REDUCE_GRADS OPTIMIZER_STEP

A forward instance runs every microbatch without keeping activations and hands each stage input
(S) and the RNG state it drew from (R) to its backward instance(s), which recompute the forward
from them and run the backward. Peers are global ranks; the tags are the IR's one tag function.
WEIGHTS is the weight hand-off (the backward instance's weights out, the forward instance's in),
whose handler the step runner supplies (P2P, or a forward host's coordinator)."""
from __future__ import annotations

from megatron.app.actions import Action, Op, message_tag, step_actions
from megatron.app.schedule import Task, TaskKind
from megatron.fbd.layout import FBDLayout, Instance


def _virtual(layout: FBDLayout, stage: int, chunk: int) -> int:
    return chunk * layout.pp + stage


def _place(layout: FBDLayout, stage: int, chunk: int, num_chunks: int):
    """(the (stage, chunk) before, the one after, this virtual stage): None past either end."""
    here = _virtual(layout, stage, chunk)

    def neighbour(virtual: int) -> tuple[int, int] | None:
        return (virtual % layout.pp, virtual // layout.pp) if 0 <= virtual < num_chunks * layout.pp else None

    return neighbour(here - 1), neighbour(here + 1), here


def forward_role(layout: FBDLayout, me: Instance, num_chunks: int, num_microbatches: int) -> list[Action]:
    """Chunk by chunk, every microbatch: virtual stage v waits only on v - 1, which its rank has
    finished (or will, in the same order), so the all-forward order cannot deadlock."""
    backward_ranks = layout.partners(me)
    actions = [Action(Op.WEIGHTS)]
    for chunk in range(num_chunks):
        previous, following, here = _place(layout, me.stage, chunk, num_chunks)
        for microbatch in range(num_microbatches):
            task = Task(TaskKind.FORWARD, chunk, microbatch)
            if previous is not None:
                peer = layout.forward_of(me.replica, previous[0], me.tp_rank)
                actions.append(Action(Op.RECV, task, peer, message_tag("F", here, microbatch, num_microbatches)))
            actions.append(Action(Op.FORWARD, task))
            if following is not None:
                peer = layout.forward_of(me.replica, following[0], me.tp_rank)
                actions.append(Action(Op.SEND, task, peer, message_tag("F", here + 1, microbatch, num_microbatches)))
            for rank in backward_ranks:  # in the order the backward instance receives them
                if previous is not None:
                    actions.append(Action(Op.SEND, task, rank, message_tag("S", here, microbatch, num_microbatches),
                                          "S"))
                actions.append(Action(Op.SEND, task, rank, message_tag("R", here, microbatch, num_microbatches), "R"))
    return actions


def backward_role(layout: FBDLayout, me: Instance, num_chunks: int, num_microbatches: int) -> list[Action]:
    """Chunks in reverse, every microbatch: virtual stage v's gradient comes from v + 1, which its
    rank has finished already (the same order there), so this cannot deadlock either."""
    (forward_rank,) = layout.partners(me.rank)
    actions = [Action(Op.WEIGHTS)]
    for chunk in reversed(range(num_chunks)):
        previous, following, here = _place(layout, me.stage, chunk, num_chunks)
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
