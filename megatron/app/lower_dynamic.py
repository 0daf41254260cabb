"""The lowering of a dynamic order, beside `lower`: a rank that picks its next task at run time
(MegaDPP's policies, the simulator's policies) posts every forward's receive first, and each
task it picks becomes its compute action followed by the communication the IR derives for it
(`sends_after(eager=True)`: its output's SEND, and for a forward the RECV of its backward's
gradient). The runtime order source (megatron.dpp.order) and the simulator (megatron.app.simulator)
both lower their choices here, and both keep the rank's progress in one RankState. Pure Python."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megatron.app.actions import Action, compute, pipeline_ranks, receive_of, sends_after
from megatron.app.schedule import PipelineLayout, Task

__all__ = ["RankState", "DynamicLowering"]


@dataclass(slots=True)
class RankState:
    """What a policy may look at when choosing; its owner updates it, policies only read it."""

    rank: int
    layout: PipelineLayout
    now: float = 0.0
    executed: list[Task] = field(default_factory=list)  # in run order, including the running task
    completed: set[Task] = field(default_factory=set)
    remaining: set[Task] = field(default_factory=set)  # not started yet
    stored_activations: int = 0  # forwards started whose backward (B, or W when split) has not finished
    peak_stored_activations: int = 0

    def ready(self, input_here: Callable[[Task], bool]) -> list[Task]:
        """Sorted: the tasks not started whose input is here and whose prerequisite (a backward's own
        forward, W's own I) has completed."""
        return sorted(task for task in self.remaining
                      if (task.prerequisite is None or task.prerequisite in self.completed) and input_here(task))

    def start(self, task: Task, *, stores: bool = True) -> None:
        """`task` begins; a forward stores its activation unless `stores` is False (forward-only)."""
        self.remaining.discard(task)
        self.executed.append(task)
        if task.is_forward and stores:
            self.stored_activations += 1
            self.peak_stored_activations = max(self.peak_stored_activations, self.stored_activations)

    def finish(self, task: Task) -> None:
        """`task` has completed; a backward (B, or a split one's W) frees its activation."""
        self.completed.add(task)
        if task.frees_activation:
            self.stored_activations -= 1


class DynamicLowering:
    """One rank's dynamic order as actions: `opening()` before the first choice, `run(task)` for
    each chosen task, `finish(task)` once its compute has completed. Peers are global ranks
    (`ranks`: the pipeline's; None when the world is this one pipeline)."""

    def __init__(self, layout: PipelineLayout, pp_rank: int, *, ranks: Sequence[int] | None = None,
                 forward_only: bool = False) -> None:
        self.layout, self.pp_rank, self.forward_only = layout, pp_rank, forward_only
        self.ranks = pipeline_ranks(layout, ranks)
        self.tasks = [task for task in layout.tasks() if task.is_forward or not forward_only]
        self.state = RankState(rank=pp_rank, layout=layout, remaining=set(self.tasks))
        # task -> the RECV of its input, None where the input is local
        self.receive_of = {task: receive_of(layout, pp_rank, task, ranks=self.ranks) for task in self.tasks}

    def opening(self) -> list[Action]:
        """The receives posted before the first task: every forward's input (`eager_receives`)."""
        return [r for task in self.tasks if task.is_forward if (r := self.receive_of[task]) is not None]

    def receives(self) -> list[Action]:
        """Every receive this rank may post in the iteration."""
        return [r for r in self.receive_of.values() if r is not None]

    def run(self, task: Task) -> list[Action]:
        """`task` was chosen: its compute action, then the communication that follows it."""
        self.state.start(task, stores=not self.forward_only)
        return [compute(task), *sends_after(self.layout, self.pp_rank, task, eager=True,
                                            forward_only=self.forward_only, ranks=self.ranks)]

    def finish(self, task: Task) -> None:
        self.state.finish(task)
