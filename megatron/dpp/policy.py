"""MegaDPP scheduling policies: which ready task a rank runs next (dfc, bfc, adaptive), with the
activation-memory admission rule. With split backwards (I and W) every policy runs a pending W
only when no F or I it may run is ready (the oldest W first: its activation has waited longest),
so weight gradients fill the time a rank would otherwise wait; an iteration ends only once every
W ran, before the optimizer step. Pure Python; the same objects drive the runtime executor and the
simulator (they satisfy megatron.app.simulator.Policy), both over a RankState
(megatron.app.lower_dynamic)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from megatron.app.schedule import PipelineLayout, ScheduleError, Task, TaskKind, build_schedule

__all__ = ["POLICY_NAMES", "DppPolicy", "MemoryLedger", "minimum_budget", "static_peak_activations",
           "dpp_policies", "task_priority", "default_budget"]

POLICY_NAMES = ("adaptive", "dfc", "bfc")


class _ExecutedView(Protocol):  # structurally megatron.app.lower_dynamic.RankState
    layout: PipelineLayout
    executed: list[Task]
    stored_activations: int


def _depth_first_key(task: Task) -> tuple:
    # Backward first (it frees memory and unblocks upstream ranks), oldest microbatch first, and within
    # one microbatch the chunk nearest the end of its backward. Forwards: the deepest chunk first, so a
    # microbatch runs through all of this rank's chunks before a new one is started.
    if task.takes_gradient:
        return (0, task.microbatch, task.chunk)
    return (1, -task.chunk, task.microbatch)


def _breadth_first_key(task: Task) -> tuple:
    # Forward first, the shallowest chunk first, so every microbatch advances one chunk before any
    # advances two; backward walks the chunks from the last one, again across microbatches.
    if task.kind is TaskKind.FORWARD:
        return (0, task.chunk, task.microbatch)
    return (1, -task.chunk, task.microbatch)


def _adaptive_key(task: Task) -> tuple:
    # Below the budget: a ready backward first (oldest microbatch), then forwards breadth-first. The
    # backward must not wait behind new forwards, else the last stage, whose backward is ready right
    # after its forward, would hold every gradient back and stall the ranks upstream.
    if task.takes_gradient:
        return (0, task.microbatch, task.chunk)
    return (1, task.chunk, task.microbatch)


def task_priority(policy: str, task: Task, at_budget: bool) -> tuple:
    """Sort key (smallest runs first) of `task` under `policy`; `at_budget` tells adaptive that the
    stored activations have reached the memory budget, where it turns depth-first."""
    if policy == "dfc" or (policy == "adaptive" and at_budget):
        return _depth_first_key(task)
    if policy == "adaptive":
        return _adaptive_key(task)
    if policy == "bfc":
        return _breadth_first_key(task)
    raise ValueError(f"unknown DPP policy {policy!r}: choose one of {', '.join(POLICY_NAMES)}")


def minimum_budget(layout: PipelineLayout) -> int:
    """Fewest stored activations with which every schedule can finish: a microbatch's forwards on all
    of a rank's chunks run before the first of its backwards there."""
    return layout.num_chunks


def default_budget(policy: str, layout: PipelineLayout) -> int | None:
    """Budget used when none is given: adaptive keeps twice the activations of the static schedule's
    first rank (headroom that absorbs jitter); dfc and bfc are unbounded."""
    if policy != "adaptive":
        return None
    return min(2 * static_peak_activations(layout), layout.num_chunks * layout.num_microbatches)


def static_peak_activations(layout: PipelineLayout, schedule: str = "auto", pp_rank: int = 0) -> int:
    """Peak stored activations of a static order on `pp_rank` (rank 0 stores the most)."""
    if schedule == "auto":
        schedule = "1f1b" if layout.num_chunks == 1 else "interleaved"
    try:
        order = build_schedule(schedule, layout, pp_rank)
    except ScheduleError:
        # Interleaving needs whole groups of pp_size microbatches; the dynamic policies do not, and
        # compare themselves with the warmup the interleaved order would have had.
        warmup = (layout.pp_size - pp_rank - 1) * 2 + (layout.num_chunks - 1) * layout.pp_size
        return min(warmup + 1, layout.num_chunks * layout.num_microbatches)
    stored = peak = 0
    for task in order:
        stored += 1 if task.is_forward else -1 if task.frees_activation else 0
        peak = max(peak, stored)
    return peak


class MemoryLedger:
    """Admission of forwards under a budget of stored (chunk, microbatch) activations.

    A microbatch that started on this rank will need one slot per chunk before any of its backwards
    can free one, so its later-chunk forwards are reserved: they are always admitted, and a new
    microbatch is admitted only if its whole reservation fits. That keeps every budget
    >= minimum_budget deadlock-free."""

    def __init__(self, layout: PipelineLayout, budget: int | None) -> None:
        self.layout = layout
        self.budget = budget
        self.forwards_started: dict[int, int] = {}  # microbatch -> forwards started on this rank
        self.backwards_started = 0
        self._seen = 0

    def observe(self, executed: Sequence[Task]) -> None:
        """Account for tasks appended to `executed` since the last call."""
        for task in executed[self._seen:]:
            if task.is_forward:
                self.forwards_started[task.microbatch] = self.forwards_started.get(task.microbatch, 0) + 1
            elif task.frees_activation:  # B, or W (I keeps what its W needs)
                self.backwards_started += 1
        self._seen = len(executed)

    @property
    def committed(self) -> int:
        """Stored activations plus the slots reserved for forwards of started microbatches."""
        return len(self.forwards_started) * self.layout.num_chunks - self.backwards_started

    def admits(self, task: Task) -> bool:
        if self.budget is None or not task.is_forward or task.microbatch in self.forwards_started:
            return True
        return self.committed + self.layout.num_chunks <= self.budget

    def at_budget(self, stored: int) -> bool:
        return self.budget is not None and (stored >= self.budget or
                                            self.committed + self.layout.num_chunks > self.budget)


class DppPolicy:
    """One rank's dynamic policy (budget None: the policy's default_budget). `choose(state, ready)` returns the highest-priority ready task that
    the memory budget admits, or None to wait for the next arrival. `state` needs `executed` (tasks
    in start order) and `stored_activations`, as megatron.app.lower_dynamic.RankState has."""

    def __init__(self, name: str, layout: PipelineLayout, budget: int | None = None) -> None:
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown DPP policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")
        if budget is None:
            budget = default_budget(name, layout)
        if budget is not None and budget < minimum_budget(layout):
            raise ValueError(f"memory budget {budget} is below the minimum {minimum_budget(layout)} "
                             f"(num_chunks={layout.num_chunks}) that any schedule needs")
        self.name = name
        self.layout = layout
        self.budget = budget
        self.ledger = MemoryLedger(layout, budget)

    def choose(self, state: _ExecutedView, ready: Sequence[Task]) -> Task | None:
        self.ledger.observe(state.executed)
        candidates = [task for task in ready if task.kind is not TaskKind.WEIGHT_GRAD and self.ledger.admits(task)]
        if not candidates:
            return _oldest_weight_grad(state.executed, ready)
        at_budget = self.ledger.at_budget(state.stored_activations)
        return min(candidates, key=lambda task: task_priority(self.name, task, at_budget))

    def __repr__(self) -> str:
        return f"DppPolicy({self.name!r}, budget={self.budget})"


def _oldest_weight_grad(executed: Sequence[Task], ready: Sequence[Task]) -> Task | None:
    """The ready W whose I ran first, or None."""
    waiting = {task for task in ready if task.kind is TaskKind.WEIGHT_GRAD}
    if not waiting:
        return None
    for task in executed:
        if task.kind is TaskKind.INPUT_GRAD and (w := Task(TaskKind.WEIGHT_GRAD, task.chunk, task.microbatch)) in waiting:
            return w
    return min(waiting)


def dpp_policies(layout: PipelineLayout, name: str, budget: int | None = None) -> list[DppPolicy]:
    """One fresh policy per rank, for megatron.app.simulator.simulate."""
    return [DppPolicy(name, layout, budget) for _ in range(layout.pp_size)]


