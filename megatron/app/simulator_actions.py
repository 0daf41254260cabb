"""The one simulator engine: each pipeline rank runs IR actions (megatron.app.actions) in order on
the cost model, as the runtime executor does. A RECV posts a receive and costs nothing; a compute
action starts once its rank is free and every message its RECVs posted has arrived; the SENDs
after a compute put their messages on the link as it ends (each arrives after its transfer time);
step actions cost nothing. A rank's actions come from an ActionSource: a fixed list (a static
order lowered by `lower`, MegaFBD's roles, what a runtime executor recorded) or one lowered as
the run goes (the policies of megatron.app.simulator). Pure Python; no torch.

Time advances from event to event. At each instant every compute that ends there ends first, its
SENDs go out (messages with no transfer time arrive at once), and then each rank that an event
touched, in rank order, takes its next actions: the engine's one rule, whatever the source."""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Protocol

from megatron.app.actions import Action, Op, check_matching, lower
from megatron.app.schedule import PipelineLayout, Task, build_schedule
from megatron.app.simulator_model import (CostModel, SimulationDeadlock, SimulationResult, TaskCosts, TaskRecord,
                                          TransferRecord)

__all__ = ["ActionSource", "FixedActions", "Engine", "simulate_actions", "simulate_lowered"]

_COMPLETE, _ARRIVE = 0, 1  # at one instant, completions before arrivals (only for determinism)


class ActionSource(Protocol):
    """One rank's actions, handed to the engine as it runs out of them."""

    def next_actions(self, now: float) -> Sequence[Action] | None:
        """The rank is free and has run every action it was given: its next actions, [] when it has
        none left, or None to wait until an event reaches it."""

    def completed(self, action: Action) -> None:
        """A compute action it gave has ended."""

    def arrived(self, task: Task) -> None:
        """A message for `task` has arrived (posted for yet or not)."""

    def receives(self) -> Iterable[Action]:
        """Every RECV it may give (they name the task that consumes each message)."""


class FixedActions:
    """A fixed action list as a source."""

    def __init__(self, actions: Sequence[Action]) -> None:
        self.actions = list(actions)
        self._handed = False

    def next_actions(self, now: float) -> Sequence[Action]:
        handed, self._handed = self._handed, True
        return [] if handed else self.actions

    def completed(self, action: Action) -> None:
        pass

    def arrived(self, task: Task) -> None:
        pass

    def receives(self) -> Iterable[Action]:
        return [action for action in self.actions if action.op is Op.RECV]


class Engine:
    """Runs one ActionSource per pipeline rank (`ranks`: the global rank of each, which the
    actions' peers name; None: ranks 0, 1, ...). Records, costs and results speak of pipeline
    ranks, the position of each source. `run()` returns whether every rank ran to its end."""

    def __init__(self, layout: PipelineLayout, sources: Sequence[ActionSource], costs: TaskCosts,
                 ranks: Sequence[int] | None = None) -> None:
        self.layout, self.sources, self.costs = layout, list(sources), costs
        self.ranks = list(range(len(sources)) if ranks is None else ranks)
        self.index = {rank: position for position, rank in enumerate(self.ranks)}
        size = len(self.sources)
        self.programs: list[list[Action]] = [[] for _ in range(size)]  # every action handed so far
        self.position = [0] * size
        self.exhausted = [False] * size
        self.running: list[tuple[Action, float] | None] = [None] * size  # the compute running, its start
        self.posted: list[dict[Task, list[tuple[int, int]]]] = [{} for _ in range(size)]  # task -> (src, tag)
        self.arrival: dict[tuple[int, int, int], float] = {}  # (dst, src, tag), global ranks -> arrival time
        self.consumers = {(self.ranks[position], action.peer, action.tag): action.task
                          for position, source in enumerate(self.sources) for action in source.receives()}
        self.records: list[TaskRecord] = []  # in completion order
        self.transfers: list[TransferRecord] = []
        self.busy = [0.0] * size
        self.stored, self.peak = [0] * size, [0] * size
        self.now = 0.0
        self._events: list[tuple[float, int, int, int, Action | Task]] = []
        self._sequence = 0

    # --- the loop ---------------------------------------------------------------------------
    def run(self) -> bool:
        touched = set(range(len(self.sources)))
        while True:
            for position in sorted(touched):
                self._advance(position)
            touched.clear()
            if not self._events:
                break
            self.now = self._events[0][0]
            while self._events and self._events[0][0] == self.now:
                _, kind, _, position, what = heapq.heappop(self._events)
                touched.add(position)
                if kind == _COMPLETE:
                    self._complete(position, what)
                else:
                    self.sources[position].arrived(what)
        return all(self.finished(position) for position in range(len(self.sources)))

    def finished(self, position: int) -> bool:
        return self.exhausted[position] and self.running[position] is None

    def input_here(self, position: int, task: Task) -> bool:
        """Every message posted for `task` on rank `position` has arrived by now."""
        me = self.ranks[position]
        for source, tag in self.posted[position].get(task, ()):
            arrival = self.arrival.get((me, source, tag))
            if arrival is None or arrival > self.now:
                return False
        return True

    def sorted_records(self) -> list[TaskRecord]:
        """The computes that ran, by start time, then rank."""
        return sorted(self.records, key=lambda record: (record.start, record.rank))

    def result(self) -> SimulationResult:
        records = self.sorted_records()
        return SimulationResult(layout=self.layout, records=tuple(records), transfers=tuple(self.transfers),
                                makespan=max((record.end for record in records), default=0.0),
                                busy_time=tuple(self.busy), peak_stored_activations=tuple(self.peak))

    # --- one rank ---------------------------------------------------------------------------
    def _push(self, time: float, kind: int, position: int, what: Action | Task) -> None:
        """An event: a compute action completes, or a message for a task arrives."""
        heapq.heappush(self._events, (time, kind, self._sequence, position, what))
        self._sequence += 1

    def _advance(self, position: int) -> None:
        """Run rank `position`'s actions as far as they go now."""
        if self.running[position] is not None:
            return
        program = self.programs[position]
        while True:
            if self.position[position] == len(program):
                if self.exhausted[position]:
                    return
                more = self.sources[position].next_actions(self.now)
                if more is None:
                    return
                if not more:
                    self.exhausted[position] = True
                    return
                program.extend(more)
                continue
            action = program[self.position[position]]
            if action.is_compute:
                if not self.input_here(position, action.task):
                    return
                self._start(position, action)
                self.position[position] += 1
                return
            self._communicate(position, action)
            self.position[position] += 1

    def _start(self, position: int, action: Action) -> None:
        self.running[position] = (action, self.now)
        if action.task.is_forward:
            self.stored[position] += 1
            self.peak[position] = max(self.peak[position], self.stored[position])
        self._push(self.now + self.costs.compute_time(position, action.task), _COMPLETE, position, action)

    def _complete(self, position: int, action: Action) -> None:
        _, start = self.running[position]
        self.running[position] = None
        self.records.append(TaskRecord(position, action.task, start, self.now))
        self.busy[position] += self.now - start
        if action.task.frees_activation:
            self.stored[position] -= 1
        self.sources[position].completed(action)
        program = self.programs[position]  # the communication after a compute goes out as it ends
        while self.position[position] < len(program) and not program[self.position[position]].is_compute:
            self._communicate(position, program[self.position[position]])
            self.position[position] += 1

    def _communicate(self, position: int, action: Action) -> None:
        me = self.ranks[position]
        if action.op is Op.RECV:
            self.posted[position].setdefault(action.task, []).append((action.peer, action.tag))
        elif action.op is Op.SEND:
            destination = self.index[action.peer]
            arrival = self.now + self.costs.transfer_time(position, destination, action.task)
            key = (action.peer, me, action.tag)
            self.arrival[key] = arrival
            consumer = self.consumers[key]
            self.transfers.append(TransferRecord(position, action.task, destination, consumer, self.now, arrival))
            self._push(arrival, _ARRIVE, destination, consumer)
        # Step actions (gradient reduction, optimizer step, weight hand-off) take no time here.


# --- action lists ---------------------------------------------------------------------------------
def simulate_actions(layout: PipelineLayout, programs: Sequence[Sequence[Action]], costs: TaskCosts | None = None,
                     *, ranks: Sequence[int] | None = None) -> SimulationResult:
    """Run one action list per pipeline rank; `ranks`: the global rank of each list, which the
    peers name (None: ranks 0, 1, ...). Raises ValueError when a SEND and a RECV do not match
    (tags, peers), SimulationDeadlock when no rank can progress."""
    costs = CostModel() if costs is None else costs
    if len(programs) != layout.pp_size:
        raise ValueError(f"need one action list per rank: got {len(programs)} for pp_size {layout.pp_size}")
    check_matching(layout, programs, ranks=ranks)
    engine = Engine(layout, [FixedActions(program) for program in programs], costs, ranks)
    if not engine.run():
        raise _deadlock(engine)
    return engine.result()


def simulate_lowered(name: str, layout: PipelineLayout, costs: TaskCosts | None = None) -> SimulationResult:
    """The static order `name` on every rank, lowered to actions and run as lists."""
    programs = [lower(layout, rank, build_schedule(name, layout, rank)) for rank in range(layout.pp_size)]
    return simulate_actions(layout, programs, costs)


def _deadlock(engine: Engine) -> SimulationDeadlock:
    layout = engine.layout
    lines = [f"pipeline deadlock at t={engine.now:.3f} ms: no rank can make progress "
             f"(pp_size={layout.pp_size}, num_chunks={layout.num_chunks}, num_microbatches={layout.num_microbatches})"]
    blocked: dict[int, Task | None] = {}
    for rank, program in enumerate(engine.programs):
        position = engine.position[rank]
        if engine.finished(rank):
            blocked[rank] = None
            lines.append(f"rank {rank}: done")
            continue
        action = program[position]
        blocked[rank] = action.task
        done = " ".join(str(a) for a in program[max(0, position - 6):position])
        lines.append(f"rank {rank}: ... {done} [{action}] -- waits for its input")
    return SimulationDeadlock("\n".join(lines), time=engine.now, blocked=blocked,
                              records=engine.sorted_records())
