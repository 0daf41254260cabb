"""A rank's speed, one notion for slow-rank detection, the live metrics and straggler mitigation.

What a rank's speed is: the seconds its forward and backward spans take (`COMPUTE_SPANS`), per
microbatch where ranks run different numbers of them; `ComputeClock` measures it live. How a rank
compares with its peers: its measure over the median of theirs (`peer_median`). Detection compares
per-iteration series in log time (`log_ratio_to_peers`: the median of the other ranks, in log time);
the live figures compare one number per rank with the job's median (`slowness`, the rank itself
counted, as the suspect score and mitigation's log line always were) or with its fastest rank
(`relative_speed`, mitigation's replica speed). Free of torch at import time (detection loads it)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

# The spans whose time is a rank's compute (the trainer's and a launched job's alike).
COMPUTE_SPANS = ("forward", "backward")
# What a rank is compared with in the live figures: the median of the ranks, or the fastest one.
Reference = Literal["median", "fastest"]


class ComputeClock:
    """Observer that adds up this rank's forward and backward time of the current iteration (CUDA:
    timed by events on the current stream, read once per iteration)."""

    def __init__(self, device: "torch.device") -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list = []
        self._null = _Null()
        self._event = None
        if self.cuda:
            import torch

            self._event = torch.cuda.Event

    def span(self, kind: str, **attrs: Any):
        return _Timed(self) if kind in COMPUTE_SPANS else self._null

    def instant(self, kind: str, **attrs: Any) -> None:
        return None

    def take(self) -> float:
        """This iteration's compute seconds so far; starts the next sum."""
        seconds, self.seconds = self.seconds, 0.0
        if self._events:
            self._events[-1][1].synchronize()
            seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1e3
            self._events = []
        return seconds

    def take_per_microbatch(self, microbatches: int) -> float:
        """take() over the microbatches this rank ran in the iteration (at least 1): its speed."""
        return self.take() / max(1, microbatches)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


class _Timed:
    __slots__ = ("clock", "start")

    def __init__(self, clock: ComputeClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        if self.clock.cuda:
            self.start = self.clock._event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        if self.clock.cuda:
            end = self.clock._event(enable_timing=True)
            end.record()
            self.clock._events.append((self.start, end))
        else:
            self.clock.seconds += time.perf_counter() - self.start
        return False


def peer_median(values: np.ndarray, *, include_self: bool = False) -> np.ndarray:
    """[observation, rank] -> [observation, rank]: at each observation (an iteration, a task
    instance), the median of the rank's peers' values, nan values being no measurement; nan where
    no peer has one. `include_self`: the rank counts among its peers (the job's median)."""
    values = np.asarray(values, dtype=np.float64)
    out = np.full(values.shape, np.nan)
    measured = ~np.isnan(values)
    if include_self:
        rows = measured.any(axis=1)
        if rows.any():
            out[rows] = np.nanmedian(values[rows], axis=1)[:, None]
        return out
    # Leave-one-out medians from one sort per observation: with a row's measured values sorted,
    # the median of all but the one at position k reads the sorted row skipping k (thousands of
    # ranks per stage made the median of a copy without each rank cost ranks^2 x observations).
    n_obs, n_ranks = values.shape
    if not n_obs or not n_ranks:
        return out
    order = np.argsort(values, axis=1)  # nan last
    ordered = np.take_along_axis(values, order, axis=1)
    position = np.empty_like(order)
    np.put_along_axis(position, order, np.broadcast_to(np.arange(n_ranks), values.shape), axis=1)
    peers = measured.sum(axis=1, keepdims=True) - measured  # measured peers of each rank
    skip = np.where(measured, position, n_ranks)  # an unmeasured rank skips nothing

    def nth(i: np.ndarray) -> np.ndarray:
        index = np.clip(i + (i >= skip), 0, n_ranks - 1)
        return np.take_along_axis(ordered, index, axis=1)

    median = (nth((peers - 1) // 2) + nth(peers // 2)) / 2
    return np.where(peers > 0, median, np.nan)


def log_ratio_to_peers(log_values: np.ndarray) -> np.ndarray:
    """[observation, rank] log measures (nan: none) -> each rank's log ratio to its peers: its
    value less the median of the other ranks' at the same observation; nan where the rank has no
    value or no other rank has one. exp() of it is what detection calls a rank's slowdown."""
    log_values = np.asarray(log_values, dtype=np.float64)
    return log_values - peer_median(log_values)


def reference_seconds(seconds: Sequence[float], *, reference: Reference = "median") -> float | None:
    """What the ranks are compared with: the median of the measured ranks' seconds (> 0; the
    job's median), or the fastest one's; None when no rank measured any."""
    measured = [float(s) for s in seconds if s > 0]
    if not measured:
        return None
    if reference == "fastest":
        return min(measured)
    return float(peer_median(np.array([measured]), include_self=True)[0, 0])


def slowness(seconds: Sequence[float], *, reference: Reference = "median") -> list[float]:
    """Each rank's seconds over reference_seconds (1: as the reference, 1.5: 50% slower); a rank
    that measured none counts as 1."""
    against = reference_seconds(seconds, reference=reference)
    return [s / against if against is not None and s > 0 else 1.0 for s in seconds]


def relative_speed(seconds: Sequence[float], *, reference: Reference = "median") -> list[float]:
    """Each rank's speed relative to reference_seconds (the reference over its seconds: 1 as
    fast, 0.5 half speed), the reciprocal of slowness; a rank that measured none counts as 1."""
    against = reference_seconds(seconds, reference=reference)
    return [against / s if against is not None and s > 0 else 1.0 for s in seconds]
