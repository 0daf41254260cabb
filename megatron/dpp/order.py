"""MegaDPP as an order source of the one pipeline executor: every receive of the iteration is
posted as early as it is legal, and at each step the rank runs the policy's highest-priority task
whose input has arrived. Each chosen task is lowered to actions by the IR's dynamic lowering
(megatron.app.lower_dynamic), the one the simulator lowers its policies' choices with; peers are
the pipeline's global ranks."""
from __future__ import annotations

import logging
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron.app.actions import Action, control_tag, step_actions
from megatron.app.executor import LossOptions, PipelineExecutor, StageContext
from megatron.app.lower_dynamic import DynamicLowering, RankState
from megatron.app.schedule import Task, TaskKind, format_schedule
from megatron.app.transport import Message, Transport

from .policy import DppPolicy

logger = logging.getLogger(__name__)

_KINDS = tuple(TaskKind)  # a decision's kind travels as its index here


class DppOrder:
    """Picks the next task of an iteration at run time with a MegaDPP policy.

    With tensor parallelism the first rank of the TP group (the leader) decides and sends each
    decision to the other TP ranks of its stage as a 3-integer P2P message; they run exactly the
    leader's order, so the TP collectives inside each task line up. The executor's static order
    only fixes which kinds run (forward-only drops backwards): the order is the policy's.
    """

    def __init__(self, layout, *, policy: str, budget: int | None, tp_ranks: Sequence[int] = (),
                 idle_timeout_s: float = 1e-3) -> None:
        self.policy_name = policy
        self.budget = budget
        self.split = layout.split_backward
        DppPolicy(policy, layout, budget)  # validates name and budget now, not in iteration 1
        me = dist.get_rank() if dist.is_initialized() else 0
        self.tp_ranks = list(tp_ranks) or [me]
        self.is_leader = self.tp_ranks[0] == me
        self.followers = [rank for rank in self.tp_ranks if rank != me] if self.is_leader else []
        self.idle_timeout_s = idle_timeout_s

    @property
    def name(self) -> str:
        """What the trainer's start-up line prints as the schedule."""
        return (f"dpp-{self.policy_name}{'+W' if self.split else ''} "
                f"(budget {self.budget if self.budget is not None else 'none'})")

    def program(self, executor: PipelineExecutor, tasks: Sequence[Task], forward_only: bool,
                step: bool) -> Iterator[Action]:
        layout, pp_rank = executor.layout, executor.stage.pp_rank  # the iteration's plan's layout
        lowering = DynamicLowering(layout, pp_rank, ranks=executor.stage.pp_global_ranks, forward_only=forward_only)
        state = lowering.state
        # Forward-only runs store nothing, so no budget applies.
        everything = layout.num_chunks * layout.num_microbatches
        policy = DppPolicy(self.policy_name, layout, everything if forward_only else self.budget)
        try:
            yield from lowering.opening()
            decision = 0
            while state.remaining:
                choice = self._decide(executor, decision, state, policy)
                if choice is None:
                    executor.idle(self.idle_timeout_s)
                    continue
                compute_action, *communication = lowering.run(choice)
                yield compute_action
                lowering.finish(choice)
                yield from communication
                decision += 1
        except Exception:
            logger.error("rank %d (pp rank %d, dpp policy %s) failed; ran: %s; still to run: %s",
                         dist.get_rank() if dist.is_initialized() else 0, pp_rank, self.policy_name,
                         format_schedule(state.executed), format_schedule(sorted(state.remaining)))
            raise
        if step:
            yield from step_actions()

    # --- choosing -----------------------------------------------------------------------
    def _decide(self, executor: PipelineExecutor, decision: int, state: RankState, policy: DppPolicy) -> Task | None:
        executor.flush()  # the last task's output goes out before this rank waits on anything
        if not self.is_leader:
            return self._decision_from_leader(executor, decision)
        choice = policy.choose(state, state.ready(executor.input_arrived))
        if choice is not None and self.followers:
            code = torch.tensor([_KINDS.index(choice.kind), choice.chunk, choice.microbatch], dtype=torch.int64)
            tag = control_tag(executor.layout, decision)
            executor.defer(executor.transport.post([Message(peer, tag, code) for peer in self.followers], []))
        return choice

    def _decision_from_leader(self, executor: PipelineExecutor, decision: int) -> Task:
        code = torch.empty(3, dtype=torch.int64)
        tag = control_tag(executor.layout, decision)
        handle = executor.transport.post([], [Message(self.tp_ranks[0], tag, code)])[-1]
        handle.wait()
        kind, chunk, microbatch = (int(value) for value in code)
        return Task(_KINDS[kind], chunk, microbatch)


def dpp_executor(chunks: Sequence[torch.nn.Module], stage: StageContext, transport: Transport, *, policy: str,
                 budget: int | None, tp_ranks: Sequence[int] = (), idle_timeout_s: float = 1e-3,
                 loss: LossOptions = LossOptions(), measure_memory: bool = False) -> PipelineExecutor:
    """The pipeline executor with a MegaDPP order (its stage's layout says whether backwards split)."""
    order = DppOrder(stage.layout, policy=policy, budget=budget, tp_ranks=tp_ranks, idle_timeout_s=idle_timeout_s)
    return PipelineExecutor(chunks, stage, transport, order=order, loss=loss, measure_memory=measure_memory)
