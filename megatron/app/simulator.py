"""Dry-run pipeline simulator: runs one policy per rank (a static order or a dynamic chooser) on a cost
model, without torch, and reports the timeline, bubbles, stored activations, deadlocks and a Chrome
trace. `python -m megatron.app.simulator --help` for the command line. Messages are the SEND/RECV
actions of the pipeline IR (megatron.app.actions); megatron.app.simulator_actions runs whole
action lists. Over 400 lines because the cost model, the event loop, its deadlock report and the
command line that prints them are read together."""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from megatron.app.actions import receive_of, send_of
from megatron.app.simulator_trace import to_chrome_trace, write_chrome_trace
from megatron.app.schedule import (
    SCHEDULES,
    PipelineLayout,
    ScheduleError,
    Task,
    TaskKind,
    build_schedule,
    format_schedule,
    validate_schedule,
)

__all__ = [
    "CostModel",
    "TaskCosts",
    "RankState",
    "Policy",
    "StaticOrderPolicy",
    "static_policies",
    "TaskRecord",
    "TransferRecord",
    "SimulationResult",
    "SimulationDeadlock",
    "PolicyError",
    "simulate",
    "simulate_schedule",
    "to_chrome_trace",
    "write_chrome_trace",
    "main",
]


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
    slowdown x a jitter factor in [1 - jitter, 1 + jitter]. Transfer time between different ranks =
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
        for name in ("jitter", "link_jitter"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"cost model: {name} is relative and must be in [0, 1], got {getattr(self, name)}")

    def compute_time(self, rank: int, task: Task) -> float:
        if task.is_forward:
            base = self.stage_forward_time.get((rank, task.chunk), self.forward_time)
        else:
            base = self.stage_backward_time.get((rank, task.chunk), self.backward_time)
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


# --------------------------------------------------------------------------------------- policies


@dataclass(slots=True)
class RankState:
    """What a policy may look at when choosing; the simulator owns it, policies only read it."""

    rank: int
    layout: PipelineLayout
    now: float = 0.0
    executed: list[Task] = field(default_factory=list)  # in run order, including the running task
    completed: set[Task] = field(default_factory=set)
    remaining: set[Task] = field(default_factory=set)  # not started yet
    stored_activations: int = 0  # forwards started whose backward has not finished
    peak_stored_activations: int = 0


@runtime_checkable
class Policy(Protocol):
    """Chooses what one rank runs next. `ready` holds, sorted, the tasks whose input has arrived (and,
    for a backward, whose own forward is done). Return one of them, or None to stay idle until the
    next message arrives at this rank. A policy may also define `pending(state) -> Sequence[Task]`
    (the tasks it still means to run, in its preferred order) so deadlock reports can name the task
    it waits for."""

    def choose(self, state: RankState, ready: Sequence[Task]) -> Task | None: ...


class StaticOrderPolicy:
    """Run a fixed order: always the next task in the list, waiting for its input if need be."""

    def __init__(self, order: Sequence[Task], *, layout: PipelineLayout | None = None, pp_rank: int | None = None):
        if layout is not None and pp_rank is not None:
            validate_schedule(layout, pp_rank, order)
        self.order = tuple(order)

    def choose(self, state: RankState, ready: Sequence[Task]) -> Task | None:
        position = len(state.executed)
        if position >= len(self.order):
            return None
        wanted = self.order[position]
        return wanted if wanted in ready else None

    def pending(self, state: RankState) -> Sequence[Task]:
        return self.order[len(state.executed):]


def static_policies(layout: PipelineLayout, orders: str | Sequence[Sequence[Task]]) -> list[StaticOrderPolicy]:
    """One StaticOrderPolicy per rank, from a SCHEDULES name or from explicit per-rank orders."""
    if isinstance(orders, str):
        orders = [build_schedule(orders, layout, rank) for rank in range(layout.pp_size)]
    if len(orders) != layout.pp_size:
        raise ScheduleError(f"got orders for {len(orders)} ranks, but pp_size is {layout.pp_size}")
    return [StaticOrderPolicy(order, layout=layout, pp_rank=rank) for rank, order in enumerate(orders)]


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


# ------------------------------------------------------------------------------------- simulation

_COMPLETE, _ARRIVE = 0, 1  # at equal times, completions are handled before arrivals (only for determinism)


def simulate(layout: PipelineLayout, policies: Sequence[Policy], costs: TaskCosts | None = None) -> SimulationResult:
    """Run one iteration. Each rank is one compute stream; sends are asynchronous, so an output reaches
    its consumer at producer end + transfer time. Raises SimulationDeadlock if no rank can progress."""
    costs = CostModel() if costs is None else costs
    if len(policies) != layout.pp_size:
        raise ValueError(f"need one policy per rank: got {len(policies)} for pp_size {layout.pp_size}")
    states = [RankState(rank=rank, layout=layout, remaining=set(layout.tasks())) for rank in range(layout.pp_size)]
    arrived: list[set[Task]] = [set() for _ in states]  # input here, maybe still waiting for its own forward
    ready: list[set[Task]] = [set() for _ in states]
    running: list[tuple[Task, float] | None] = [None for _ in states]
    events: list[tuple[float, int, int, int, Task]] = []
    records: list[TaskRecord] = []
    transfers: list[TransferRecord] = []
    busy = [0.0 for _ in states]
    sequence = 0
    consumers = receive_index(layout)

    def push(time: float, kind: int, rank: int, task: Task) -> None:
        nonlocal sequence
        heapq.heappush(events, (time, kind, sequence, rank, task))
        sequence += 1

    def input_arrives(rank: int, task: Task) -> None:
        arrived[rank].add(task)
        own_forward = Task(TaskKind.FORWARD, task.chunk, task.microbatch)
        if task.is_forward or own_forward in states[rank].completed:
            ready[rank].add(task)

    # The first virtual stage reads its data locally: every microbatch is available at time zero.
    first_rank, first_chunk = layout.rank_and_chunk(0)
    for microbatch in range(layout.num_microbatches):
        input_arrives(first_rank, Task(TaskKind.FORWARD, first_chunk, microbatch))

    now = 0.0
    dirty = set(range(layout.pp_size))
    while True:
        for rank in sorted(dirty):
            state = states[rank]
            if running[rank] is not None or not state.remaining:
                continue
            state.now = now
            choice = policies[rank].choose(state, sorted(ready[rank]))
            if choice is None:
                continue
            if choice not in ready[rank]:
                raise PolicyError(
                    f"policy of rank {rank} chose {choice} at t={now:.3f} ms, which is not ready "
                    f"(ready: {format_schedule(sorted(ready[rank])) or 'none'})"
                )
            ready[rank].discard(choice)
            state.remaining.discard(choice)
            state.executed.append(choice)
            if choice.is_forward:
                state.stored_activations += 1
                state.peak_stored_activations = max(state.peak_stored_activations, state.stored_activations)
            running[rank] = (choice, now)
            push(now + costs.compute_time(rank, choice), _COMPLETE, rank, choice)
        dirty.clear()
        if not events:
            break
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, _, rank, task = heapq.heappop(events)
            dirty.add(rank)
            if kind == _ARRIVE:
                input_arrives(rank, task)
                continue
            state = states[rank]
            _, start = running[rank]
            running[rank] = None
            records.append(TaskRecord(rank, task, start, now))
            busy[rank] += now - start
            state.completed.add(task)
            if not task.is_forward:
                state.stored_activations -= 1
            own_backward = Task(TaskKind.BACKWARD, task.chunk, task.microbatch)
            if task.is_forward and layout.is_last_stage(rank, task.chunk):
                input_arrives(rank, own_backward)  # the loss is computed locally, right after the forward
            elif task.is_forward and own_backward in arrived[rank]:
                ready[rank].add(own_backward)
            # The message the IR's lowering sends after this task, to the task whose RECV has its tag.
            send = send_of(layout, rank, task)
            if send is not None:
                peer_task = consumers[(send.peer, rank, send.tag)]
                arrival = now + costs.transfer_time(rank, send.peer, task)
                transfers.append(TransferRecord(rank, task, send.peer, peer_task, now, arrival))
                push(arrival, _ARRIVE, send.peer, peer_task)

    if any(state.remaining for state in states):
        raise _deadlock(layout, policies, states, ready, now, records)
    records.sort(key=lambda record: (record.start, record.rank))
    makespan = max((record.end for record in records), default=0.0)
    return SimulationResult(
        layout=layout,
        records=tuple(records),
        transfers=tuple(transfers),
        makespan=makespan,
        busy_time=tuple(busy),
        peak_stored_activations=tuple(state.peak_stored_activations for state in states),
    )


def receive_index(layout: PipelineLayout) -> dict[tuple[int, int, int], Task]:
    """(receiving rank, sending rank, tag) -> the task that consumes the message, from the RECV
    actions the IR's lowering gives every task of every rank."""
    index = {}
    for rank in range(layout.pp_size):
        for task in layout.tasks():
            receive = receive_of(layout, rank, task)
            if receive is not None:
                index[(rank, receive.peer, receive.tag)] = task
    return index


def simulate_schedule(name: str, layout: PipelineLayout, costs: TaskCosts | None = None) -> SimulationResult:
    """Simulate the static order `name` (a SCHEDULES key) on every rank."""
    return simulate(layout, static_policies(layout, name), costs)


def _waits_for(layout: PipelineLayout, state: RankState, task: Task) -> str:
    own_forward = Task(TaskKind.FORWARD, task.chunk, task.microbatch)
    if not task.is_forward and own_forward not in state.completed:
        return f"its own forward {own_forward}, not run yet"
    source = layout.input_source(state.rank, task)
    if source is None:
        return "nothing (its input is local)"
    peer_rank, peer_chunk = source
    what = "activation" if task.is_forward else "gradient"
    return f"the {what} from {Task(task.kind, peer_chunk, task.microbatch)} on rank {peer_rank}, not run yet"


def _render_order(done: Sequence[Task], pending: Sequence[Task], context: int = 12) -> str:
    """`done` then `pending`, the first pending task in brackets; long lists keep `context` tasks each side."""
    before = [str(task) for task in done]
    after = [str(task) for task in pending[1:]]
    if len(before) > context:
        before = [f"...({len(before) - context} earlier)"] + before[-context:]
    if len(after) > context:
        after = after[:context] + [f"...({len(after) - context} more)"]
    return " ".join(before + [f"[{pending[0]}]"] + after)


def _deadlock(
    layout: PipelineLayout,
    policies: Sequence[Policy],
    states: Sequence[RankState],
    ready: Sequence[set[Task]],
    now: float,
    records: Sequence[TaskRecord],
) -> SimulationDeadlock:
    lines = [
        f"pipeline deadlock at t={now:.3f} ms: no rank can make progress "
        f"(pp_size={layout.pp_size}, num_chunks={layout.num_chunks}, num_microbatches={layout.num_microbatches})"
    ]
    blocked: dict[int, Task | None] = {}
    for rank, (policy, state) in enumerate(zip(policies, states)):
        pending_of = getattr(policy, "pending", None)
        pending = list(pending_of(state)) if pending_of is not None else sorted(state.remaining)
        if not pending:
            blocked[rank] = None
            if state.remaining:
                lines.append(f"rank {rank}: {format_schedule(state.executed)} -- its policy offers none of "
                             f"the {len(state.remaining)} remaining task(s): {format_schedule(sorted(state.remaining))}")
            else:
                lines.append(f"rank {rank}: done ({len(state.executed)} tasks)")
            continue
        blocked[rank] = pending[0]
        ready_now = format_schedule(sorted(ready[rank]))
        if pending[0] in ready[rank]:
            reason = f"its policy chose nothing although {ready_now} ready"
        else:
            reason = f"{pending[0]} waits for {_waits_for(layout, state, pending[0])}"
            if ready[rank] and pending_of is None:
                reason += f"; its policy chose none of the ready {ready_now}"
        lines.append(f"rank {rank}: {_render_order(state.executed, pending)} -- {reason}")
    return SimulationDeadlock("\n".join(lines), time=now, blocked=blocked, records=records)


# ----------------------------------------------------------------------------------- chrome trace


# ---------------------------------------------------------------------------------------------- cli


def parse_slow_rank(text: str) -> tuple[int, float]:
    try:
        rank, factor = text.split(":")
        return int(rank), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:FACTOR such as 2:1.5, got {text!r}") from None


def parse_link_latency(text: str) -> tuple[tuple[int, int], float]:
    try:
        src, dst, milliseconds = text.split(":")
        return (int(src), int(dst)), float(milliseconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SRC:DST:MS such as 1:2:0.5, got {text!r}") from None


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """The layout and cost-model flags (milliseconds, GB/s) every simulator command line takes."""
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size (ranks)")
    parser.add_argument("--chunks", type=int, default=1,
                        help="model chunks (virtual stages) per rank (default %(default)s)")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per iteration")
    parser.add_argument("--forward-ms", type=float, default=1.0,
                        help="forward of one chunk on one microbatch, in ms (default %(default)s)")
    parser.add_argument("--backward-ms", type=float, default=2.0,
                        help="backward of one chunk on one microbatch, in ms (default %(default)s)")
    parser.add_argument("--p2p-ms", type=float, default=0.0,
                        help="latency of every link between ranks, in ms (default %(default)s)")
    parser.add_argument("--link-ms", type=parse_link_latency, action="append", default=[], metavar="SRC:DST:MS",
                        help="latency of one link, overriding --p2p-ms (repeatable)")
    parser.add_argument("--message-bytes", type=float, default=0.0, help="bytes per activation/gradient message")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="link bandwidth in GB/s")
    parser.add_argument("--slow-rank", type=parse_slow_rank, action="append", default=[], metavar="RANK:FACTOR",
                        help="multiply a rank's compute time, e.g. 2:1.5 (repeatable)")
    parser.add_argument("--jitter", type=float, default=0.0, help="relative compute jitter in [0, 1]")
    parser.add_argument("--link-jitter", type=float, default=0.0, help="relative transfer jitter in [0, 1]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter draws (default %(default)s)")


def simulation_from_args(args: argparse.Namespace) -> tuple[PipelineLayout, CostModel]:
    """The layout and cost model the flags of add_simulation_arguments describe; ValueError
    (ScheduleError included) with what to change."""
    layout = PipelineLayout(args.pp, args.chunks, args.microbatches)
    for rank, _ in args.slow_rank:
        if not 0 <= rank < args.pp:
            raise ScheduleError(f"--slow-rank names rank {rank}, but --pp {args.pp} has ranks 0..{args.pp - 1}")
    costs = CostModel(forward_time=args.forward_ms, backward_time=args.backward_ms, p2p_latency=args.p2p_ms,
                      link_latency=dict(args.link_ms), message_bytes=args.message_bytes,
                      bandwidth_gbs=args.bandwidth_gbs, rank_slowdown=dict(args.slow_rank), jitter=args.jitter,
                      link_jitter=args.link_jitter, seed=args.seed)
    return layout, costs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.app.simulator",
        description="Simulate a pipeline schedule on per-task costs (no model, no torch).",
    )
    add_simulation_arguments(parser)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default=None,
                        help="static order (default: 1f1b with one chunk, interleaved with more)")
    parser.add_argument("--chrome-trace", metavar="PATH", help="write a Chrome trace JSON here")
    parser.add_argument("--print-schedule", action="store_true", help="print each rank's static order")
    return parser


def _report(name: str, result: SimulationResult, costs: CostModel) -> str:
    layout = result.layout
    lines = [
        f"schedule {name}: pp={layout.pp_size} chunks={layout.num_chunks} microbatches={layout.num_microbatches}"
        f" | forward {costs.forward_time:g} ms, backward {costs.backward_time:g} ms, p2p {costs.p2p_latency:g} ms",
        f"{'rank':>4}  {'tasks':>5}  {'busy ms':>9}  {'idle ms':>9}  {'bubble':>7}  {'peak activations':>16}",
    ]
    for rank in range(layout.pp_size):
        busy = result.busy_time[rank]
        lines.append(
            f"{rank:>4}  {len(result.rank_records(rank)):>5}  {busy:>9.3f}  {result.makespan - busy:>9.3f}"
            f"  {result.bubble_fractions[rank]:>6.1%}  {result.peak_stored_activations[rank]:>16}"
        )
    mean_bubble = sum(result.bubble_fractions) / layout.pp_size
    # What 1F1B (v=1) and interleaved 1F1B reach with uniform costs and free links.
    tasks_per_rank = layout.num_chunks * layout.num_microbatches
    ideal = (layout.pp_size - 1) / (tasks_per_rank + layout.pp_size - 1)
    lines.append(f"makespan {result.makespan:.3f} ms | mean bubble {mean_bubble:.1%}"
                 f" | uniform-cost ideal (p-1)/(v*m+p-1) = {ideal:.1%}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    name = args.schedule or ("1f1b" if args.chunks == 1 else "interleaved")
    try:
        layout, costs = simulation_from_args(args)
        policies = static_policies(layout, name)
    except ValueError as error:  # ScheduleError and bad costs: the message already says what to change
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.print_schedule:
        for rank, policy in enumerate(policies):
            print(f"rank {rank}: {format_schedule(policy.order)}")
    try:
        result = simulate(layout, policies, costs)
    except SimulationDeadlock as deadlock:
        print(str(deadlock), file=sys.stderr)
        return 1
    print(_report(name, result, costs))
    if args.chrome_trace:
        write_chrome_trace(result, args.chrome_trace)
        print(f"chrome trace: {args.chrome_trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
