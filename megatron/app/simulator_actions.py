"""The simulator over action lists: each pipeline rank runs its list of IR actions
(megatron.app.actions) in order on the cost model, as the runtime executor does. A RECV posts a
receive and costs nothing; a compute action waits for the message its RECV posted; a SEND puts its
message on the link (it arrives after the transfer time); step actions cost nothing here. Static
orders lowered by `lower`, and the lists a runtime executor recorded (`executor.last_actions`,
dynamic orders included), run here alike. Pure Python; no torch."""
from __future__ import annotations

import heapq
from collections.abc import Sequence

from megatron.app.actions import Action, Op, check_matching, lower
from megatron.app.schedule import PipelineLayout, Task, build_schedule
from megatron.app.simulator import (CostModel, SimulationDeadlock, SimulationResult, TaskCosts, TaskRecord,
                                    TransferRecord)

__all__ = ["simulate_actions", "simulate_lowered"]


def simulate_actions(layout: PipelineLayout, programs: Sequence[Sequence[Action]],
                     costs: TaskCosts | None = None) -> SimulationResult:
    """Run one action list per pipeline rank. Raises ValueError when a SEND and a RECV do not
    match (tags, peers), SimulationDeadlock when no rank can progress."""
    costs = CostModel() if costs is None else costs
    if len(programs) != layout.pp_size:
        raise ValueError(f"need one action list per rank: got {len(programs)} for pp_size {layout.pp_size}")
    check_matching(layout, programs)
    consumers = {(rank, action.peer, action.tag): action.task
                 for rank, program in enumerate(programs) for action in program if action.op is Op.RECV}
    size = layout.pp_size
    position = [0] * size
    free_at = [0.0] * size  # when each rank's compute stream is next free
    posted: list[dict[Task, tuple[int, int]]] = [{} for _ in range(size)]  # consumer -> (src, tag)
    arrived: dict[tuple[int, int, int], float] = {}  # (dst, src, tag) -> arrival time
    records: list[TaskRecord] = []
    transfers: list[TransferRecord] = []
    busy = [0.0] * size
    stored, peak = [0] * size, [0] * size
    wakeups: list[float] = []

    def advance(rank: int, now: float) -> bool:
        """Run `rank`'s actions from its position as far as it can at `now`; True if it moved."""
        moved = False
        program = programs[rank]
        while position[rank] < len(program):
            action = program[position[rank]]
            start = max(now, free_at[rank])
            if action.op is Op.RECV:
                posted[rank][action.task] = (action.peer, action.tag)
            elif action.op is Op.SEND:
                if free_at[rank] > now:  # its output exists once the producing compute has ended
                    heapq.heappush(wakeups, free_at[rank])
                    return moved
                arrival = now + costs.transfer_time(rank, action.peer, action.task)
                key = (action.peer, rank, action.tag)
                arrived[key] = arrival
                transfers.append(TransferRecord(rank, action.task, action.peer, consumers[key], now, arrival))
                heapq.heappush(wakeups, arrival)
            elif action.is_compute:
                source = posted[rank].get(action.task)
                if source is not None:
                    arrival = arrived.get((rank, *source))
                    if arrival is None or arrival > now:
                        return moved
                if start > now:
                    heapq.heappush(wakeups, start)
                    return moved
                end = now + costs.compute_time(rank, action.task)
                records.append(TaskRecord(rank, action.task, now, end))
                busy[rank] += end - now
                free_at[rank] = end
                heapq.heappush(wakeups, end)
                if action.task.is_forward:
                    stored[rank] += 1
                    peak[rank] = max(peak[rank], stored[rank])
                else:
                    stored[rank] -= 1
            elif free_at[rank] > now:  # a step action waits for the compute before it
                heapq.heappush(wakeups, free_at[rank])
                return moved
            position[rank] += 1
            moved = True
        return moved

    now = 0.0
    while True:
        while any(advance(rank, now) for rank in range(size)):
            pass
        if all(position[rank] == len(programs[rank]) for rank in range(size)):
            break
        while wakeups and wakeups[0] <= now:
            heapq.heappop(wakeups)
        if not wakeups:
            raise _deadlock(layout, programs, position, now, records)
        now = heapq.heappop(wakeups)
    records.sort(key=lambda record: (record.start, record.rank))
    return SimulationResult(layout=layout, records=tuple(records), transfers=tuple(transfers),
                            makespan=max((record.end for record in records), default=0.0),
                            busy_time=tuple(busy), peak_stored_activations=tuple(peak))


def simulate_lowered(name: str, layout: PipelineLayout, costs: TaskCosts | None = None) -> SimulationResult:
    """The static order `name` on every rank, lowered to actions and run as lists."""
    programs = [lower(layout, rank, build_schedule(name, layout, rank)) for rank in range(layout.pp_size)]
    return simulate_actions(layout, programs, costs)


def _deadlock(layout: PipelineLayout, programs: Sequence[Sequence[Action]], position: Sequence[int], now: float,
              records: Sequence[TaskRecord]) -> SimulationDeadlock:
    lines = [f"pipeline deadlock at t={now:.3f} ms: no rank can make progress "
             f"(pp_size={layout.pp_size}, num_chunks={layout.num_chunks}, num_microbatches={layout.num_microbatches})"]
    blocked: dict[int, Task | None] = {}
    for rank, program in enumerate(programs):
        if position[rank] == len(program):
            blocked[rank] = None
            lines.append(f"rank {rank}: done")
            continue
        action = program[position[rank]]
        blocked[rank] = action.task
        done = " ".join(str(a) for a in program[max(0, position[rank] - 6):position[rank]])
        lines.append(f"rank {rank}: ... {done} [{action}] -- waits for its input")
    return SimulationDeadlock("\n".join(lines), time=now, blocked=blocked, records=records)
