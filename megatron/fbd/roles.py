"""MegaFBD's two roles as action lists of the pipeline IR, run by the spine's one executor: the
IR's disaggregated lowering pass (megatron.app.lower_disaggregated) over the instance's pipeline,
with the role layout naming the global ranks of (replica, stage, tp rank)."""
from __future__ import annotations

from megatron.app.actions import Action
from megatron.app.lower_disaggregated import lower_backward_instance, lower_forward_instance
from megatron.app.schedule import PipelineLayout
from megatron.fbd.layout import FBDLayout, Instance


def forward_role(layout: FBDLayout, me: Instance, num_chunks: int, num_microbatches: int) -> list[Action]:
    """The action list of forward instance `me`: every microbatch through its chunks, each stage
    input and RNG state handed to its backward instance(s)."""
    return lower_forward_instance(
        PipelineLayout(layout.pp, num_chunks, num_microbatches), me.stage,
        forward_ranks=[layout.forward_of(me.replica, stage, me.tp_rank) for stage in range(layout.pp)],
        backward_ranks=layout.partners(me))


def backward_role(layout: FBDLayout, me: Instance, num_chunks: int, num_microbatches: int) -> list[Action]:
    """The action list of backward instance `me`: recompute and backward of every microbatch, then
    the gradient reduction and the optimizer step."""
    (forward_rank,) = layout.partners(me)
    return lower_backward_instance(
        PipelineLayout(layout.pp, num_chunks, num_microbatches), me.stage,
        backward_ranks=[layout.backward_of(me.replica, stage, me.tp_rank) for stage in range(layout.pp)],
        forward_rank=forward_rank)
