"""What the pipeline simulators compute with and report: the cost model, the records of a run,
its result and the errors it raises. Shared by the engine (megatron.app.simulator_actions), the
policy front end (megatron.app.simulator) and the Chrome trace (megatron.app.simulator_trace).
Pure Python; no torch."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from megatron.app.schedule import PipelineLayout, Task, TaskKind

__all__ = ["CostModel", "TaskCosts", "TaskRecord", "TransferRecord", "SimulationResult", "SimulationDeadlock",
           "PolicyError"]


class SimulationDeadlock(RuntimeError):
    """No rank can make progress. The message shows each rank's order with the blocked task in [brackets]."""

    def __init__(self, message: str, *, time: float, blocked: Mapping[int, Task | None], records: Sequence[TaskRecord]):
        super().__init__(message)
        self.time = time
        self.blocked = dict(blocked)  # rank -> the task it waits to run (None: finished or nothing to name)
        self.records = tuple(records)  # what did run before the deadlock


class PolicyError(ValueError):
    """A policy chose a task that is not ready (or not on its rank)."""


# ----------------------------------------------------------------------------------------- costs


class TaskCosts(Protocol):
    """What the simulator asks of a cost model; CostModel is the standard one, tests may pass their own."""

    def compute_time(self, rank: int, task: Task) -> float: ...

    def transfer_time(self, src_rank: int, dst_rank: int, task: Task) -> float: ...


def _jitter_factor(jitter: float, key: str) -> float:
    # Seeded by the task's identity rather than drawn in run order, so that two policies that run the
    # same tasks in different orders see exactly the same costs and can be compared fairly.
    if jitter == 0.0:
        return 1.0
    return random.Random(key).uniform(1.0 - jitter, 1.0 + jitter)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Durations in milliseconds. Compute time of a task = base time of its (rank, chunk) x the rank's
    slowdown x a jitter factor in [1 - jitter, 1 + jitter]; a split backward's I and W share its
    backward time by weight_grad_fraction. Transfer time between different ranks =
    latency + message_bytes / bandwidth, x a factor in [1 - link_jitter, 1 + link_jitter].
    A transfer between two chunks of the same rank is free unless link_latency names (rank, rank)."""

    forward_time: float = 1.0
    backward_time: float = 2.0
    stage_forward_time: Mapping[tuple[int, int], float] = field(default_factory=dict)  # (rank, chunk) -> ms
    stage_backward_time: Mapping[tuple[int, int], float] = field(default_factory=dict)
    rank_slowdown: Mapping[int, float] = field(default_factory=dict)  # rank -> factor, 1.5 = 50% slower
    jitter: float = 0.0
    p2p_latency: float = 0.0
    link_latency: Mapping[tuple[int, int], float] = field(default_factory=dict)  # (src, dst) -> ms
    message_bytes: float = 0.0  # size of one activation or gradient message
    bandwidth_gbs: float | None = None  # GB/s on every link; None = unlimited
    link_bandwidth_gbs: Mapping[tuple[int, int], float] = field(default_factory=dict)
    link_jitter: float = 0.0
    seed: int = 0
    # A split backward: W takes this share of the backward's time, I the rest (half each: the
    # input- and weight-gradient GEMMs of the linear layers cost the same).
    weight_grad_fraction: float = 0.5

    def __post_init__(self) -> None:
        times = {"forward_time": self.forward_time, "backward_time": self.backward_time, "p2p_latency": self.p2p_latency}
        times |= {f"stage_forward_time[{k}]": v for k, v in self.stage_forward_time.items()}
        times |= {f"stage_backward_time[{k}]": v for k, v in self.stage_backward_time.items()}
        times |= {f"link_latency[{k}]": v for k, v in self.link_latency.items()}
        times["message_bytes"] = self.message_bytes
        for name, value in times.items():
            if value < 0:
                raise ValueError(f"cost model: {name} must be >= 0, got {value}")
        for rank, factor in self.rank_slowdown.items():
            if factor <= 0:
                raise ValueError(f"cost model: slowdown of rank {rank} must be > 0, got {factor}")
        bandwidths = dict(self.link_bandwidth_gbs)
        if self.bandwidth_gbs is not None:
            bandwidths["all links"] = self.bandwidth_gbs
        for link, value in bandwidths.items():
            if value <= 0:
                raise ValueError(f"cost model: bandwidth of {link} must be > 0 GB/s, got {value}")
        for name in ("jitter", "link_jitter", "weight_grad_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"cost model: {name} is relative and must be in [0, 1], got {getattr(self, name)}")

    def compute_time(self, rank: int, task: Task) -> float:
        if task.is_forward:
            base = self.stage_forward_time.get((rank, task.chunk), self.forward_time)
        else:
            base = self.stage_backward_time.get((rank, task.chunk), self.backward_time)
            if task.kind is TaskKind.INPUT_GRAD:
                base *= 1.0 - self.weight_grad_fraction
            elif task.kind is TaskKind.WEIGHT_GRAD:
                base *= self.weight_grad_fraction
        slowdown = self.rank_slowdown.get(rank, 1.0)
        return base * slowdown * _jitter_factor(self.jitter, f"{self.seed}:compute:{rank}:{task}")

    def transfer_time(self, src_rank: int, dst_rank: int, task: Task) -> float:
        link = (src_rank, dst_rank)
        if src_rank == dst_rank and link not in self.link_latency:
            return 0.0
        latency = self.link_latency.get(link, self.p2p_latency)
        bandwidth = self.link_bandwidth_gbs.get(link, self.bandwidth_gbs)
        # GB/s = 1e6 bytes per millisecond.
        wire = self.message_bytes / (bandwidth * 1e6) if bandwidth and self.message_bytes else 0.0
        return (latency + wire) * _jitter_factor(self.link_jitter, f"{self.seed}:link:{src_rank}:{dst_rank}:{task}")


# ---------------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class TaskRecord:
    rank: int
    task: Task
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One P2P message: the producer's output travelling to the consumer task's input."""

    src_rank: int
    src_task: Task
    dst_rank: int
    dst_task: Task
    send_time: float
    arrival_time: float


@dataclass(frozen=True, slots=True)
class SimulationResult:
    layout: PipelineLayout
    records: tuple[TaskRecord, ...]  # in start order
    transfers: tuple[TransferRecord, ...]
    makespan: float
    busy_time: tuple[float, ...]  # per rank, ms of compute
    peak_stored_activations: tuple[int, ...]  # per rank

    @property
    def busy_fractions(self) -> tuple[float, ...]:
        return tuple(busy / self.makespan if self.makespan > 0 else 1.0 for busy in self.busy_time)

    @property
    def bubble_fractions(self) -> tuple[float, ...]:
        """Idle share of the makespan per rank: 1 - busy / makespan."""
        return tuple(1.0 - fraction for fraction in self.busy_fractions)

    def rank_records(self, rank: int) -> list[TaskRecord]:
        return [record for record in self.records if record.rank == rank]

    def order(self, rank: int) -> list[Task]:
        """The order in which `rank` actually ran its tasks."""
        return [record.task for record in self.rank_records(rank)]
