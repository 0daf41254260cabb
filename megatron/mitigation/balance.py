"""The arithmetic of straggler mitigation, free of torch and of the trainer: how many microbatches
each data-parallel replica should run given the measured time of one microbatch on each, when a
new plan is worth switching to (hysteresis), and how to re-split layers over slow pipeline stages.

Cost model (the what-if the decisions and the summary use): a replica that runs `s` microbatches,
each taking `t` seconds on its slowest stage, takes `(s + bubble) * t` seconds, `bubble` being
the pipeline's fill and drain in microbatches ((pp - 1) / virtual stages per rank); the iteration
takes as long as its slowest replica.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Sequence


def replica_cost(share: int, seconds_per_microbatch: float, bubble: float) -> float:
    return (share + bubble) * seconds_per_microbatch


def plan_cost(shares: Sequence[int], times: Sequence[float], bubble: float) -> float:
    """Predicted seconds of compute of an iteration: the slowest replica's."""
    return max(replica_cost(s, t, bubble) for s, t in zip(shares, times))


def plan_shares(total: int, times: Sequence[float], *, bubble: float = 0.0, granularity: int = 1,
                minimum: int = 1) -> tuple[int, ...]:
    """Microbatches per replica, adding up to `total`, that minimise the slowest replica's cost.
    Shares are multiples of `granularity` (the interleaved schedule runs whole groups of pp) and
    at least `minimum` (a replica keeps being measured, so a recovered rank is seen). Equal times
    give the even split; the result depends on nothing but the arguments (every rank computes it)."""
    if total % granularity:
        raise ValueError(f"{total} microbatches cannot be split in units of {granularity}")
    floor = max(1, -(-minimum // granularity))
    units = [floor] * len(times)
    left = total // granularity - floor * len(times)
    if left < 0:
        raise ValueError(f"{total} microbatches cannot give {len(times)} replicas {floor * granularity} each")
    for _ in range(left):
        # Give the next unit to the replica that would finish it soonest (lowest index on ties).
        best = min(range(len(times)), key=lambda d: (replica_cost((units[d] + 1) * granularity, times[d], bubble), d))
        units[best] += 1
    return tuple(u * granularity for u in units)


@dataclass(frozen=True)
class Decision:
    """A change of plan: the new shares, and the predicted seconds of the old and new plan."""

    shares: tuple[int, ...]
    previous: tuple[int, ...]
    predicted_before: float
    predicted_after: float
    times: tuple[float, ...]  # seconds per microbatch of each replica the decision used
    # An undo of the last change, which made iterations slower: measured seconds before and after it.
    undone: tuple[float, float] | None = None


class Rebalancer:
    """Decides, once per measurement, whether the replicas' shares should change.

    Each measurement gives every replica's seconds per microbatch; the decision uses the median of
    the last `window` of them (one noisy iteration is not a straggler), with replicas within
    `threshold` of the median counted as the median (`snap`). A new plan is adopted only
    when it is predicted to be faster than the current one by more than `threshold` in `patience`
    consecutive measurements, and after a change the measurements start afresh; the same rule
    brings the even split back when the slow rank recovers.

    Each change is checked against what it achieved: once a window has run under the new plan, its
    median iteration time is compared with the window's before the change. A change that gained
    less than half its prediction doubles the hold-off before the next one (up to MAX_HOLD_OFF
    windows), so a job whose ranks' speeds wander (a shared, oversubscribed host) stops chasing
    them; one that made iterations slower by more than `threshold` is undone at once.
    """

    MAX_HOLD_OFF = 16  # windows

    def __init__(self, data_parallel_size: int, nominal: int, *, bubble: float = 0.0, granularity: int = 1,
                 threshold: float = 0.1, patience: int = 3, window: int = 5) -> None:
        self.total = data_parallel_size * nominal
        self.shares: tuple[int, ...] = (nominal,) * data_parallel_size
        self.bubble = bubble
        self.granularity = granularity
        self.threshold = threshold
        self.patience = patience
        self.window = max(1, window)
        self.history: deque[tuple[float, ...]] = deque(maxlen=self.window)
        self.iteration_times: deque[float] = deque(maxlen=self.window)
        self.streak = 0
        self.times: tuple[float, ...] = ()
        self.hold_off = 0  # measurements to wait before the next change may be made
        self.failures = 0  # changes in a row that did not pay
        self._check: tuple[tuple[int, ...], float, float] | None = None  # (previous shares, time before, gain)

    def observe(self, replica_times: Sequence[float], iteration_time: float | None = None) -> Decision | None:
        """One iteration's seconds per microbatch of every replica (and its wall time, to check the
        last change): a Decision when the plan changes."""
        self.history.append(tuple(float(t) for t in replica_times))
        if iteration_time is not None:
            self.iteration_times.append(float(iteration_time))
        self.times = snap(tuple(statistics.median(column) for column in zip(*self.history)), self.threshold)
        if len(self.history) < self.history.maxlen:
            return None  # a full window first (after a change too)
        undo = self._review()
        if undo is not None:
            return undo
        if self.hold_off > 0:
            self.hold_off -= 1
            return None
        candidate = self.best()
        now = plan_cost(self.shares, self.times, self.bubble)
        then = plan_cost(candidate, self.times, self.bubble)
        if candidate == self.shares or then >= now * (1.0 - self.threshold):
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.patience:
            return None
        return self._change(candidate, now, then)

    def _change(self, shares: tuple[int, ...], now: float, then: float) -> Decision:
        before = statistics.median(self.iteration_times) if self.iteration_times else None
        if before is not None:
            self._check = (self.shares, before, 1.0 - then / now if now > 0 else 0.0)
        decision = Decision(shares=shares, previous=self.shares, predicted_before=now, predicted_after=then,
                            times=self.times)
        self.streak = 0
        self.history.clear()  # the next decision measures the new plan afresh
        self.iteration_times.clear()
        self.shares = shares
        return decision

    def _review(self) -> Decision | None:
        """A window after a change: did it pay? (None, or the Decision that undoes it.)"""
        if self._check is None or len(self.iteration_times) < self.window:
            return None
        previous, before, predicted_gain = self._check
        self._check = None
        gain = 1.0 - statistics.median(self.iteration_times) / before
        if gain >= predicted_gain / 2:
            self.failures = 0
            return None
        self.failures += 1
        self.hold_off = self.window * min(2 ** self.failures, self.MAX_HOLD_OFF)
        if gain < -self.threshold:
            after = statistics.median(self.iteration_times)
            now = plan_cost(self.shares, self.times, self.bubble)
            undo = self._change(previous, now, plan_cost(previous, self.times, self.bubble))
            self._check = None  # an undo is not judged again
            return dataclasses.replace(undo, undone=(before, after))
        return None

    def best(self) -> tuple[int, ...]:
        """The plan the latest measured times call for (whether or not it is adopted)."""
        return plan_shares(self.total, self.times, bubble=self.bubble, granularity=self.granularity)

    def predicted(self, shares: Sequence[int] | None = None) -> float:
        """Predicted seconds of `shares` (default: the current plan) at the latest measured times."""
        return plan_cost(self.shares if shares is None else shares, self.times, self.bubble) if self.times else 0.0


def snap(times: Sequence[float], tolerance: float) -> tuple[float, ...]:
    """Replicas within `tolerance` of the median count as exactly the median: noise moves no work
    and a healthy job keeps the even split; a straggler (or a replica really faster) keeps its own time."""
    middle = statistics.median(times)
    return tuple(middle if abs(t - middle) <= tolerance * middle else t for t in times)


def split_layers(num_layers: int, seconds_per_layer: Sequence[float], unit: int = 1) -> tuple[int, ...]:
    """Layers per pipeline stage (each a multiple of `unit` and at least one unit, adding up to
    `num_layers`) that minimise the slowest stage's time, given each stage's measured seconds per
    layer (`unit`: the virtual chunks per stage, which split a stage's layers evenly)."""
    stages = len(seconds_per_layer)
    if num_layers % unit or num_layers < stages * unit:
        raise ValueError(f"{num_layers} layers cannot give {stages} stages whole multiples of {unit}")
    counts = [unit] * stages
    for _ in range(num_layers // unit - stages):
        best = min(range(stages), key=lambda p: ((counts[p] + unit) * seconds_per_layer[p], p))
        counts[best] += unit
    return tuple(counts)


def stage_cost(split: Sequence[int], seconds_per_layer: Sequence[float]) -> float:
    return max(n * t for n, t in zip(split, seconds_per_layer))
