"""The lowering pass of forward-backward disaggregation (MegaFBD), beside `lower`: one pipeline
stage's two instances as action lists of the IR (megatron.app.actions).

    forward instance:  WEIGHTS  per chunk, microbatch: [RECV F] F(hand-off) [SEND F] [SEND S] SEND R
    backward instance: WEIGHTS  per chunk (last first), microbatch: [RECV S] RECV R RECOMPUTE
                                [RECV B] B [SEND B]   then REDUCE_GRADS OPTIMIZER_STEP

A forward instance runs every microbatch without keeping activations and hands each stage input
(S) and the RNG state it drew from (R) to its backward instance(s), which recompute the forward
from them and run the backward. The stage arithmetic is the pipeline layout's and the
activation/gradient messages are `lower`'s own (receive_of, send_of); the caller only says which
global ranks hold the instances. WEIGHTS is the weight hand-off between the two instances. Pure
Python; no torch."""
from __future__ import annotations

from collections.abc import Sequence

from megatron.app.actions import Action, Op, compute, message_tag, receive_of, send_of, step_actions
from megatron.app.schedule import PipelineLayout, Task, TaskKind

__all__ = ["lower_forward_instance", "lower_backward_instance"]


def _hand_off_tag(layout: PipelineLayout, stage: int, payload: str, task: Task) -> int:
    return message_tag(payload, layout.virtual_stage(stage, task.chunk), task.microbatch, layout.num_microbatches)


def lower_forward_instance(layout: PipelineLayout, stage: int, *, forward_ranks: Sequence[int],
                           backward_ranks: Sequence[int]) -> list[Action]:
    """The forward instance of pipeline rank `stage`: chunk by chunk, every microbatch. Virtual
    stage v waits only on v - 1, which its rank has finished (or will, in the same order), so the
    all-forward order cannot deadlock. `forward_ranks`: the global rank of the forward instance of
    each pipeline rank (this instance's pipeline); `backward_ranks`: the backward instance(s) it
    hands each stage input and RNG state to, in the order they receive them."""
    actions = [Action(Op.WEIGHTS)]
    for chunk in range(layout.num_chunks):
        first = layout.is_first_stage(stage, chunk)
        for microbatch in range(layout.num_microbatches):
            task = Task(TaskKind.FORWARD, chunk, microbatch)
            actions += [a for a in (receive_of(layout, stage, task, ranks=forward_ranks), compute(task),
                                    send_of(layout, stage, task, ranks=forward_ranks)) if a is not None]
            for rank in backward_ranks:
                if not first:  # the first stage's input is data, which the backward instance reads itself
                    actions.append(Action(Op.SEND, task, rank, _hand_off_tag(layout, stage, "S", task), "S"))
                actions.append(Action(Op.SEND, task, rank, _hand_off_tag(layout, stage, "R", task), "R"))
    return actions


def lower_backward_instance(layout: PipelineLayout, stage: int, *, backward_ranks: Sequence[int],
                            forward_rank: int) -> list[Action]:
    """The backward instance of pipeline rank `stage`: chunks in reverse, every microbatch. Virtual
    stage v's gradient comes from v + 1, which its rank has finished already (the same order
    there), so this cannot deadlock either. `backward_ranks`: the global rank of the backward
    instance of each pipeline rank (this instance's pipeline); `forward_rank`: the forward instance
    that hands it stage inputs and RNG states. Ends with the gradient reduction and the step."""
    actions = [Action(Op.WEIGHTS)]
    for chunk in reversed(range(layout.num_chunks)):
        first = layout.is_first_stage(stage, chunk)
        for microbatch in range(layout.num_microbatches):
            forward, backward = Task(TaskKind.FORWARD, chunk, microbatch), Task(TaskKind.BACKWARD, chunk, microbatch)
            if not first:
                actions.append(Action(Op.RECV, forward, forward_rank, _hand_off_tag(layout, stage, "S", forward), "S"))
            actions.append(Action(Op.RECV, forward, forward_rank, _hand_off_tag(layout, stage, "R", forward), "R"))
            actions.append(Action(Op.RECOMPUTE, forward))
            actions += [a for a in (receive_of(layout, stage, backward, ranks=backward_ranks), compute(backward),
                                    send_of(layout, stage, backward, ranks=backward_ranks)) if a is not None]
    return actions + step_actions()
