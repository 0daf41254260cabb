"""Zero-bubble static orders ("zb-h1", "zb-h2") for layouts whose backwards are split into I and W
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): W has no consumer on another rank, so it
can wait and fill the bubbles that 1F1B leaves idle.

The orders of all ranks are built at once by a greedy list-scheduling run of the project's own
simulator (megatron.app.simulator.simulate) on uniform costs -- forward 1, backward 2 split into
I 1 and W 1, free links -- with one ZeroBubblePolicy per rank; what each rank ran there is its order.
Each rank's policy, whenever the rank is free:

1. zb-h2: runs the next input gradient I if its gradient has arrived (I's go in the 1F1B backward
   sequence, the interleaved one with num_chunks > 1: the critical path upstream ranks wait on),
   else the next forward F of the 1F1B (interleaved) forward sequence, if its input has arrived and
   the caps below allow it; zb-h1: the same two, the forward first;
2. else the oldest pending W (W's run in the order of their I's);
3. else it waits for the next message.

So per chunk the I's, and the W's that accumulate the weight gradients, run in microbatch order, as
in 1F1B: the same sums in the same order, hence bit-identical gradients. Which of a ready F and a
ready I goes first was measured over pp 1..8, chunks 1..3 on uniform costs: under zb-h1's caps the
forward first is faster in 100 layouts and never slower (29 -> 27 at p=4, m=8: a forward admitted
early keeps the next rank fed, and the cap on forwards awaiting their I keeps it from running
ahead); under zb-h2's caps, which do not hold forwards back as much, the I first is faster in 63
layouts and never slower (a forward first delays the gradient every upstream rank waits for).
`orders(..., forward_first=...)` builds the other choice.

Activation caps per rank r (p = pp_size, v = num_chunks; a microbatch's activation counts until W):

- zb-h1: 1F1B's memory, as the ZB-H1 of the paper has it: no rank stores more than 1F1B's busiest
  rank (rank 0: p activations; interleaved 1F1B's rank 0 with num_chunks > 1), and each rank keeps
  no more forwards awaiting their I than 1F1B has on that rank (p - r; interleaved's peak on r).
  So the later ranks, which 1F1B leaves below rank 0's memory, may hold W's back: they run them in
  the drain while the last gradients travel upstream, and each gradient leaves after its I instead
  of after the whole backward. (Capping each rank at its own 1F1B peak instead leaves no room for a
  W to wait with one chunk: the order is then the split 1F1B, 30 instead of 29 at p=4, m=8.)
- zb-h2: zb-h1's activation cap plus p - 1 - r, and no bound on forwards awaiting their I: with
  one chunk rank 0 may store 2p - 1, the forwards that fill its warm-up (its first gradient comes
  back 2p - 1 forward times after its first forward; the ZB-H2 peak), each later rank one less,
  the last p. On uniform costs it reaches the bound (p - 1) F + v m (F + B) whenever m >= p
  (checked for p <= 8, v <= 3). With virtual stages zb-h1 already reaches that bound on uniform
  costs; zb-h2's room (p - 1 - r more on rank r) is for costs that are not uniform.

Every recorded order is the order of a run in which each task started after its inputs existed, so
the orders cannot deadlock under any other costs: the blocked task that ran earliest in the
construction run would find its producer blocked behind a task that ran even earlier.
Pure Python; no torch."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence

from megatron.app.schedule import (
    ZERO_BUBBLE_SCHEDULES,
    PipelineLayout,
    ScheduleError,
    Task,
    TaskKind,
    build_schedule,
)
from megatron.app.simulator import CostModel, RankState, simulate

__all__ = ["CONSTRUCTION_COSTS", "ZeroBubblePolicy", "activation_caps", "in_flight_caps", "build", "orders"]

# Uniform costs the orders are built on: F 1, B 2 split into I 1 and W 1, free links.
CONSTRUCTION_COSTS = CostModel(forward_time=1.0, backward_time=2.0, weight_grad_fraction=0.5)


class ZeroBubblePolicy:
    """One rank's greedy choice (the module's docstring): a ready I or the next F under the caps
    (which first: `forward_first`), else the oldest pending W, else wait. `forwards` and `input_grads` are the
    sequences F's and I's must follow. `in_flight_cap` also bounds the forwards whose I has not run
    (None: only `cap` does); `forward_first` runs a ready F before a ready I."""

    def __init__(self, forwards: Sequence[Task], input_grads: Sequence[Task], cap: int, *,
                 in_flight_cap: int | None = None, forward_first: bool = False) -> None:
        self.forwards, self.input_grads, self.cap = tuple(forwards), tuple(input_grads), cap
        self.in_flight_cap, self.forward_first = in_flight_cap, forward_first
        self.next_forward = self.next_input_grad = 0
        self.pending_weight_grads: deque[Task] = deque()  # W's of the I's done, oldest first
        self.seen = 0  # how many of state.executed this policy has accounted for

    def _catch_up(self, state: RankState) -> None:
        for task in state.executed[self.seen:]:
            if task.is_forward:
                self.next_forward += 1
            elif task.kind is TaskKind.INPUT_GRAD:
                self.next_input_grad += 1
                self.pending_weight_grads.append(Task(TaskKind.WEIGHT_GRAD, task.chunk, task.microbatch))
            else:
                self.pending_weight_grads.remove(task)
        self.seen = len(state.executed)

    def choose(self, state: RankState, ready: Sequence[Task]) -> Task | None:
        self._catch_up(state)
        ready_now = set(ready)
        input_grad = self.input_grads[self.next_input_grad] if self.next_input_grad < len(self.input_grads) else None
        forward = self.forwards[self.next_forward] if self.next_forward < len(self.forwards) else None
        if input_grad not in ready_now:
            input_grad = None
        in_flight = self.next_forward - self.next_input_grad
        if (forward not in ready_now or state.stored_activations >= self.cap
                or (self.in_flight_cap is not None and in_flight >= self.in_flight_cap)):
            forward = None
        first, second = (forward, input_grad) if self.forward_first else (input_grad, forward)
        if first is not None or second is not None:
            return first if first is not None else second
        return self.pending_weight_grads[0] if self.pending_weight_grads else None

    def pending(self, state: RankState) -> Sequence[Task]:
        self._catch_up(state)
        return [*self.input_grads[self.next_input_grad:self.next_input_grad + 1], *self.pending_weight_grads,
                *self.forwards[self.next_forward:self.next_forward + 1]]


def _reference_order(layout: PipelineLayout, pp_rank: int) -> list[Task]:
    """The unsplit 1F1B (one chunk) or interleaved 1F1B order the zero-bubble order replaces."""
    unsplit = PipelineLayout(layout.pp_size, layout.num_chunks, layout.num_microbatches)
    return build_schedule("1f1b" if layout.num_chunks == 1 else "interleaved", unsplit, pp_rank)


def _peak(order: Sequence[Task]) -> int:
    stored = peak = 0
    for task in order:
        stored += 1 if task.is_forward else -1
        peak = max(peak, stored)
    return peak


def activation_caps(name: str, layout: PipelineLayout) -> list[int]:
    """Per rank, the most activations the order `name` may store at once (the module's docstring)."""
    _check(name, layout)
    busiest = max(_peak(_reference_order(layout, rank)) for rank in range(layout.pp_size))
    caps = []
    for rank in range(layout.pp_size):
        caps.append(busiest + (layout.pp_size - 1 - rank if name == "zb-h2" else 0))
    return caps


def in_flight_caps(name: str, layout: PipelineLayout) -> list[int | None]:
    """Per rank, the most forwards whose I has not run (zb-h1: 1F1B's peak on the rank; zb-h2: no
    bound beyond its activation cap)."""
    _check(name, layout)
    if name == "zb-h2":
        return [None] * layout.pp_size
    return [_peak(_reference_order(layout, rank)) for rank in range(layout.pp_size)]


def _check(name: str, layout: PipelineLayout) -> None:
    if name not in ZERO_BUBBLE_SCHEDULES:
        raise ScheduleError(f"unknown zero-bubble schedule {name!r}: choose one of {', '.join(ZERO_BUBBLE_SCHEDULES)}")
    if not layout.split_backward:
        raise ScheduleError(
            f"{name} runs each backward as an input gradient I and a weight gradient W, but this layout "
            "runs it as one B: build the layout with PipelineLayout(..., split_backward=True), or choose "
            "1f1b / interleaved"
        )
    pp_size, num_microbatches = layout.pp_size, layout.num_microbatches
    if layout.num_chunks > 1 and num_microbatches % pp_size:
        lower = num_microbatches - num_microbatches % pp_size
        hint = f"{lower} or {lower + pp_size}" if lower else f"{pp_size}"
        raise ScheduleError(
            f"{name} with num_chunks={layout.num_chunks} follows the interleaved order, which needs "
            f"num_microbatches ({num_microbatches}) to be a multiple of pp_size ({pp_size}): use {hint} "
            "microbatches, or num_chunks=1"
        )


@functools.lru_cache(maxsize=64)
def orders(name: str, layout: PipelineLayout, *, forward_first: bool | None = None) -> tuple[tuple[Task, ...], ...]:
    """Every rank's order for `name` on `layout`, from one greedy run on CONSTRUCTION_COSTS
    (`forward_first`: None, the schedule's own choice; see the module's docstring)."""
    if forward_first is None:
        forward_first = name == "zb-h1"
    caps, in_flight = activation_caps(name, layout), in_flight_caps(name, layout)
    policies = []
    for rank in range(layout.pp_size):
        reference = _reference_order(layout, rank)
        forwards = [task for task in reference if task.is_forward]
        input_grads = [Task(TaskKind.INPUT_GRAD, task.chunk, task.microbatch) for task in reference
                       if task.kind is TaskKind.BACKWARD]
        policies.append(ZeroBubblePolicy(forwards, input_grads, caps[rank], in_flight_cap=in_flight[rank],
                                         forward_first=forward_first))
    result = simulate(layout, policies, CONSTRUCTION_COSTS)
    return tuple(tuple(result.order(rank)) for rank in range(layout.pp_size))


def build(name: str, layout: PipelineLayout, pp_rank: int) -> list[Task]:
    """The zero-bubble order `name` ("zb-h1" or "zb-h2") of one rank; ScheduleError says what to
    change when the layout does not fit (no split backward; num_chunks > 1 with microbatches that
    are not a multiple of pp_size)."""
    _check(name, layout)
    if not 0 <= pp_rank < layout.pp_size:
        raise ScheduleError(f"pp_rank {pp_rank} out of range: pp_size is {layout.pp_size}")
    return list(orders(name, layout)[pp_rank])
