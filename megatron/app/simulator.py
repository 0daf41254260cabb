"""Dry-run pipeline simulator: runs one policy per rank (a static order or a dynamic chooser) on a
cost model, without torch, and reports the timeline, bubbles, stored activations, deadlocks and a
Chrome trace. `python -m megatron.app.simulator --help` for the command line. Each rank's choices
are lowered to IR actions as the run goes (megatron.app.lower_dynamic, as MegaDPP's runtime order
lowers them), and the action lists run on the one engine (megatron.app.simulator_actions), which
also runs action lists given whole."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from megatron.app.actions import Action
from megatron.app.lower_dynamic import DynamicLowering, RankState
from megatron.app.schedule import (
    SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    PipelineLayout,
    ScheduleError,
    Task,
    TaskKind,
    build_schedule,
    format_schedule,
    validate_schedule,
)
from megatron.app.simulator_actions import Engine
from megatron.app.simulator_model import (
    CostModel,
    PolicyError,
    SimulationDeadlock,
    SimulationResult,
    TaskCosts,
    TaskRecord,
    TransferRecord,
)
from megatron.app.simulator_trace import to_chrome_trace, write_chrome_trace

__all__ = [
    "CostModel",
    "TaskCosts",
    "RankState",
    "Policy",
    "StaticOrderPolicy",
    "static_policies",
    "PolicyProgram",
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


# --------------------------------------------------------------------------------------- policies


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


# ------------------------------------------------------------------------------------- simulation


class PolicyProgram:
    """A policy's rank as an action source of the engine: the receives of the dynamic lowering
    first, then, each time the rank is free, the policy's choice among the ready tasks, lowered to
    its compute and communication. The ready tasks are kept as messages arrive and computes end:
    a task whose input is local, or has arrived, once its own forward (for a backward) is done."""

    def __init__(self, layout: PipelineLayout, rank: int, policy: Policy) -> None:
        self.policy = policy
        self.lowering = DynamicLowering(layout, rank)
        self.opened = False
        self.local = {task for task, receive in self.lowering.receive_of.items() if receive is None}
        self.arrived_for: set[Task] = set()  # tasks whose message is here, their forward done or not
        self.ready: set[Task] = {task for task in self.local if task.is_forward}

    @property
    def state(self) -> RankState:
        return self.lowering.state

    def next_actions(self, now: float) -> Sequence[Action] | None:
        if not self.opened:
            self.opened = True
            opening = self.lowering.opening()
            if opening:
                return opening
        state = self.state
        if not state.remaining:
            return []
        state.now = now
        ready = sorted(self.ready)
        choice = self.policy.choose(state, ready)
        if choice is None:
            return None
        if choice not in self.ready:
            raise PolicyError(
                f"policy of rank {state.rank} chose {choice} at t={now:.3f} ms, which is not ready "
                f"(ready: {format_schedule(ready) or 'none'})"
            )
        self.ready.discard(choice)
        return self.lowering.run(choice)

    def completed(self, action: Action) -> None:
        task = action.task
        self.lowering.finish(task)
        layout = self.state.layout
        if task.is_forward:
            follower = layout.gradient_task(task.chunk, task.microbatch)  # its B, or its I
            if follower in self.local or follower in self.arrived_for:
                self.ready.add(follower)
        elif task.kind is TaskKind.INPUT_GRAD:
            self.ready.add(Task(TaskKind.WEIGHT_GRAD, task.chunk, task.microbatch))  # W's input is local

    def arrived(self, task: Task) -> None:
        self.arrived_for.add(task)
        if task.prerequisite is None or task.prerequisite in self.state.completed:
            self.ready.add(task)

    def receives(self) -> Iterable[Action]:
        return self.lowering.receives()


def simulate(layout: PipelineLayout, policies: Sequence[Policy], costs: TaskCosts | None = None) -> SimulationResult:
    """Run one iteration. Each rank is one compute stream; sends are asynchronous, so an output reaches
    its consumer at producer end + transfer time. Raises SimulationDeadlock if no rank can progress."""
    costs = CostModel() if costs is None else costs
    if len(policies) != layout.pp_size:
        raise ValueError(f"need one policy per rank: got {len(policies)} for pp_size {layout.pp_size}")
    programs = [PolicyProgram(layout, rank, policy) for rank, policy in enumerate(policies)]
    engine = Engine(layout, programs, costs)
    if not engine.run():
        raise _deadlock(layout, policies, [program.state for program in programs],
                        [program.ready for program in programs], engine.now, engine.records)
    return engine.result()


def simulate_schedule(name: str, layout: PipelineLayout, costs: TaskCosts | None = None) -> SimulationResult:
    """Simulate the static order `name` (a SCHEDULES key) on every rank."""
    return simulate(layout, static_policies(layout, name), costs)


def _waits_for(layout: PipelineLayout, state: RankState, task: Task) -> str:
    before = task.prerequisite
    if before is not None and before not in state.completed:
        return f"its own {'forward' if before.is_forward else 'input gradient'} {before}, not run yet"
    source = layout.input_source(state.rank, task)
    if source is None:
        return "nothing (its input is local)"
    peer_rank, peer_chunk = source
    what = "activation" if task.is_forward else "gradient"
    producer = Task(task.kind, peer_chunk, task.microbatch) if task.is_forward else \
        layout.gradient_task(peer_chunk, task.microbatch)
    return f"the {what} from {producer} on rank {peer_rank}, not run yet"


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
    parser.add_argument("--weight-grad-fraction", type=float, default=0.5,
                        help="share of a backward's time that its weight gradient W takes when the backward is "
                             "split into I and W (zero-bubble schedules); I takes the rest (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter draws (default %(default)s)")


def simulation_from_args(args: argparse.Namespace) -> tuple[PipelineLayout, CostModel]:
    """The layout and cost model the flags of add_simulation_arguments describe; ValueError
    (ScheduleError included) with what to change. The backward is split into I and W when
    `args.schedule` (if the command line has one) is a zero-bubble schedule."""
    split = getattr(args, "schedule", None) in ZERO_BUBBLE_SCHEDULES
    layout = PipelineLayout(args.pp, args.chunks, args.microbatches, split_backward=split)
    for rank, _ in args.slow_rank:
        if not 0 <= rank < args.pp:
            raise ScheduleError(f"--slow-rank names rank {rank}, but --pp {args.pp} has ranks 0..{args.pp - 1}")
    costs = CostModel(forward_time=args.forward_ms, backward_time=args.backward_ms, p2p_latency=args.p2p_ms,
                      link_latency=dict(args.link_ms), message_bytes=args.message_bytes,
                      bandwidth_gbs=args.bandwidth_gbs, rank_slowdown=dict(args.slow_rank), jitter=args.jitter,
                      link_jitter=args.link_jitter, seed=args.seed, weight_grad_fraction=args.weight_grad_fraction)
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
    split = f" (W {costs.weight_grad_fraction:.0%})" if layout.split_backward else ""
    lines = [
        f"schedule {name}: pp={layout.pp_size} chunks={layout.num_chunks} microbatches={layout.num_microbatches}"
        f" | forward {costs.forward_time:g} ms, backward {costs.backward_time:g} ms{split}, p2p {costs.p2p_latency:g} ms",
        f"{'rank':>4}  {'tasks':>5}  {'busy ms':>9}  {'idle ms':>9}  {'bubble':>7}  {'peak activations':>16}",
    ]
    for rank in range(layout.pp_size):
        busy = result.busy_time[rank]
        lines.append(
            f"{rank:>4}  {len(result.rank_records(rank)):>5}  {busy:>9.3f}  {result.makespan - busy:>9.3f}"
            f"  {result.bubble_fractions[rank]:>6.1%}  {result.peak_stored_activations[rank]:>16}"
        )
    mean_bubble = sum(result.bubble_fractions) / layout.pp_size
    tasks_per_rank = layout.num_chunks * layout.num_microbatches
    if layout.split_backward:
        # No order does better with uniform costs and free links: the last rank's first forward
        # starts after p-1 others, and then it has v*m forwards and backwards to run.
        warmup = (layout.pp_size - 1) * costs.forward_time
        work = tasks_per_rank * (costs.forward_time + costs.backward_time)
        bound = warmup / (warmup + work) if warmup + work > 0 else 0.0
        ideal = f"uniform-cost lower bound (p-1)F/((p-1)F+v*m*(F+B)) = {bound:.1%}"
    else:  # what 1F1B (v=1) and interleaved 1F1B reach with uniform costs and free links
        ideal = f"uniform-cost ideal (p-1)/(v*m+p-1) = {(layout.pp_size - 1) / (tasks_per_rank + layout.pp_size - 1):.1%}"
    lines.append(f"makespan {result.makespan:.3f} ms | mean bubble {mean_bubble:.1%} | {ideal}")
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
