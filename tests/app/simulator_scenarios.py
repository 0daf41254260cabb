"""Simulator scenarios and their canonical outcomes: static orders, MegaDPP policies, hand-written
policies, deadlocks, action lists, Chrome traces and both command lines, each reduced to a
JSON-able value with exact float reprs. tests/app/test_simulator_equivalence.py compares the
outcomes with tests/app/data/simulator_reference.json, written from these same scenarios by the
two engines the simulator had before it ran everything as action lists."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron.app.actions import compute, eager_receives, lower, sends_after
from megatron.app.schedule import SCHEDULES, PipelineLayout, Task, TaskKind, build_schedule, parse_schedule
from megatron.app.simulator import (CostModel, PolicyError, SimulationDeadlock, main, simulate, simulate_schedule,
                                    static_policies, to_chrome_trace)
from megatron.app.simulator_actions import simulate_actions
from megatron.dpp.policy import POLICY_NAMES, default_budget, dpp_policies, minimum_budget
from megatron.dpp.simulate import main as dpp_main
from simulation_cases import random_case

REFERENCE = Path(__file__).resolve().parent / "data" / "simulator_reference.json"
F, B = TaskKind.FORWARD, TaskKind.BACKWARD


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _records(records) -> list:
    return [[r.rank, str(r.task), repr(r.start), repr(r.end)] for r in records]


def canonical_result(result, *, sorted_transfers: bool = False) -> dict:
    """Everything a result says; the transfers in their order (or sorted, for action lists, whose
    transfers at one instant the engine before listed in another order)."""
    transfers = [[t.src_rank, str(t.src_task), t.dst_rank, str(t.dst_task), repr(t.send_time), repr(t.arrival_time)]
                 for t in result.transfers]
    if sorted_transfers:
        transfers.sort()
    full = {"records": _records(result.records), "transfers": transfers, "busy": [repr(b) for b in result.busy_time],
            "peak": list(result.peak_stored_activations), "makespan": repr(result.makespan)}
    return {"makespan": repr(result.makespan), "sha256": _digest(full)}


def outcome(run: Callable[[], object], *, sorted_transfers: bool = False, trace: bool = False) -> dict:
    """The canonical result of `run`, or of the deadlock / policy error it raised."""
    try:
        result = run()
    except SimulationDeadlock as deadlock:
        records = _records(deadlock.records)
        if sorted_transfers:  # ...and their records, which it listed in the order its passes over the ranks went
            records = _records(sorted(deadlock.records, key=lambda record: (record.start, record.rank)))
        return {"deadlock": str(deadlock), "time": repr(deadlock.time),
                "blocked": {str(rank): str(task) for rank, task in sorted(deadlock.blocked.items())},
                "records": _digest(records)}
    except PolicyError as error:
        return {"policy_error": str(error)}
    value = canonical_result(result, sorted_transfers=sorted_transfers)
    if trace:
        value["chrome_trace"] = _digest(to_chrome_trace(result))
    return value


def _cli(entry, argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace.json"
        extra = ["--chrome-trace", str(trace)] if "--chrome-trace" in argv else []
        argv = [a for a in argv if a != "--chrome-trace"] + extra
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = entry(argv)
        written = _digest(json.loads(trace.read_text())) if trace.exists() else None
    return {"code": code, "stdout": out.getvalue().replace(str(trace), "TRACE"), "stderr": err.getvalue(),
            "trace": written}


def _runnable(name: str, layout: PipelineLayout) -> bool:
    if name == "1f1b":
        return layout.num_chunks == 1
    if name == "interleaved" and layout.num_chunks > 1:
        return layout.num_microbatches % layout.pp_size == 0
    return True


STATIC_COSTS = {
    "uniform": CostModel(),
    "zero": CostModel(forward_time=0.0, backward_time=0.0),
    "zero-forward": CostModel(forward_time=0.0, backward_time=1.0, p2p_latency=0.5),
    "jitter": CostModel(forward_time=1.0, backward_time=2.0, p2p_latency=0.3, jitter=0.5, link_jitter=0.5, seed=7),
    "slow-link": CostModel(rank_slowdown={1: 1.5}, link_latency={(0, 1): 2.0, (2, 1): 0.0}, message_bytes=1e6,
                           bandwidth_gbs=2.0),
}


# The orders the reference was written with (later schedules are compared in their own tests).
REFERENCE_SCHEDULES = ("1f1b", "gpipe", "interleaved")


def _static_layouts() -> Iterator[tuple[str, PipelineLayout]]:
    assert set(REFERENCE_SCHEDULES) <= set(SCHEDULES)
    for name in REFERENCE_SCHEDULES:
        for pp in (1, 2, 3, 4):
            for chunks in (1, 2, 3):
                for microbatches in sorted({1, pp + 1, 2 * pp}):
                    layout = PipelineLayout(pp, chunks, microbatches)
                    if _runnable(name, layout):
                        yield name, layout


def _lowered(name: str, layout: PipelineLayout, eager: bool) -> list:
    orders = [build_schedule(name, layout, rank) for rank in range(layout.pp_size)]
    if not eager:
        return [lower(layout, rank, order, step=True) for rank, order in enumerate(orders)]
    return [eager_receives(layout, rank, order)
            + [a for task in order for a in (compute(task), *sends_after(layout, rank, task, eager=True))]
            for rank, order in enumerate(orders)]


class BackwardFirst:
    """Any ready backward first, else the lowest ready forward."""

    def choose(self, state, ready):
        backwards = [task for task in ready if task.kind is B]
        return min(backwards or ready, key=lambda task: (task.microbatch, task.chunk), default=None)


class CappedForwards:
    """Declines forwards while `cap` activations are stored."""

    def __init__(self, cap: int):
        self.cap = cap

    def choose(self, state, ready):
        for task in ready:
            if task.kind is B or state.stored_activations < self.cap:
                return task
        return None


class Impatient:
    """Chooses a backward that is not ready."""

    def choose(self, state, ready):
        return Task(B, 0, 0)


class Recorder:
    """Logs every call (rank, time, ready, stored) so the calls themselves are compared."""

    def __init__(self, log: list):
        self.log = log

    def choose(self, state, ready):
        self.log.append([state.rank, repr(state.now), [str(t) for t in ready], state.stored_activations,
                         len(state.executed), len(state.completed)])
        return ready[-1] if ready else None


def _recorded(layout: PipelineLayout, costs: CostModel) -> dict:
    log: list = []
    value = outcome(lambda: simulate(layout, [Recorder(log) for _ in range(layout.pp_size)], costs))
    value["calls"] = _digest(log)
    return value


def scenarios() -> Iterator[tuple[str, Callable[[], dict]]]:
    """(identifier, a function computing the outcome), in a fixed order, each identifier once."""
    seen = set()
    for identifier, run in _all_scenarios():
        if identifier not in seen:
            seen.add(identifier)
            yield identifier, run


def _all_scenarios() -> Iterator[tuple[str, Callable[[], dict]]]:
    for name, layout in _static_layouts():
        key = f"{layout.pp_size}x{layout.num_chunks}x{layout.num_microbatches}"
        for cost_name, costs in STATIC_COSTS.items():
            yield (f"static/{name}/{key}/{cost_name}",
                   lambda n=name, l=layout, c=costs: outcome(lambda: simulate_schedule(n, l, c), trace=True))
            for eager in (False, True):
                yield (f"actions/{name}/{key}/{cost_name}/{'eager' if eager else 'lowered'}",
                       lambda n=name, l=layout, c=costs, e=eager: outcome(
                           lambda: simulate_actions(l, _lowered(n, l, e), c), sorted_transfers=True))
    for seed in range(30):
        layout, costs = random_case(seed)
        rng = random.Random(seed * 7 + 1)
        budgets = [None, minimum_budget(layout), default_budget("adaptive", layout),
                   rng.randint(minimum_budget(layout), layout.num_chunks * layout.num_microbatches)]
        for policy in POLICY_NAMES:
            for budget in budgets:
                yield (f"dpp/{seed}/{policy}/{budget}",
                       lambda l=layout, c=costs, p=policy, b=budget, t=seed < 5: outcome(
                           lambda: simulate(l, dpp_policies(l, p, b), c), trace=t))
        yield f"recorder/{seed}", lambda l=layout, c=costs: _recorded(l, c)
    for pp, chunks, microbatches in ((2, 1, 4), (4, 1, 8), (4, 2, 8), (3, 3, 6), (1, 2, 3)):
        layout = PipelineLayout(pp, chunks, microbatches)
        for cost_name, costs in STATIC_COSTS.items():
            key = f"{pp}x{chunks}x{microbatches}/{cost_name}"
            for policy in POLICY_NAMES:
                yield (f"dpp-ties/{key}/{policy}",
                       lambda l=layout, c=costs, p=policy: outcome(lambda: simulate(l, dpp_policies(l, p), c)))
            yield (f"backward-first/{key}", lambda l=layout, c=costs: outcome(
                lambda: simulate(l, [BackwardFirst() for _ in range(l.pp_size)], c)))
            for cap in (0, 1, 2, 4):
                yield (f"capped/{key}/{cap}", lambda l=layout, c=costs, k=cap: outcome(
                    lambda: simulate(l, [CappedForwards(k) for _ in range(l.pp_size)], c)))
            yield f"recorder/{key}", lambda l=layout, c=costs: _recorded(l, c)
    yield from _deadlocks()
    yield from _command_lines()


def _deadlocks() -> Iterator[tuple[str, Callable[[], dict]]]:
    two = PipelineLayout(2, 1, 2)
    crossed = [parse_schedule("F0.0 B0.0 F0.1 B0.1"), parse_schedule("F0.0 F0.1 B0.0 B0.1")]
    long_layout = PipelineLayout(2, 1, 40)
    long_orders = [parse_schedule(" ".join(f"F0.{m} B0.{m}" for m in range(40))),
                   parse_schedule(" ".join([f"F0.{m}" for m in range(40)] + [f"B0.{m}" for m in range(40)]))]
    three = PipelineLayout(3, 2, 3)
    gpipe_orders = [build_schedule("gpipe", three, rank) for rank in range(3)]
    # Rank 1 runs its first chunk's backwards before its second's: a gradient chain that loops back to it.
    swapped = [gpipe_orders[0], parse_schedule("F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B0.0 B0.1 B0.2 B1.0 B1.1 B1.2"),
               gpipe_orders[2]]
    costs = CostModel(forward_time=1, backward_time=2)
    yield "deadlock/crossed", lambda: outcome(lambda: simulate(two, static_policies(two, crossed), costs))
    yield "deadlock/long", lambda: outcome(lambda: simulate(long_layout, static_policies(long_layout, long_orders)))
    yield "deadlock/swapped", lambda: outcome(lambda: simulate(three, static_policies(three, swapped), costs))
    yield "deadlock/capped", lambda: outcome(lambda: simulate(PipelineLayout(4, 1, 8),
                                                              [CappedForwards(0) for _ in range(4)], CostModel()))
    yield "deadlock/impatient", lambda: outcome(lambda: simulate(two, [Impatient(), Impatient()]))
    for name, layout, orders in (("crossed", two, crossed), ("long", long_layout, long_orders),
                                 ("swapped", three, swapped)):
        programs = [lower(layout, rank, order) for rank, order in enumerate(orders)]
        yield f"deadlock/actions/{name}", lambda l=layout, p=programs: outcome(lambda: simulate_actions(l, p, costs),
                                                                               sorted_transfers=True)


def _command_lines() -> Iterator[tuple[str, Callable[[], dict]]]:
    simulator = [
        ["--pp", "4", "--chunks", "2", "--microbatches", "8", "--schedule", "interleaved", "--p2p-ms", "0.1",
         "--slow-rank", "2:1.5", "--jitter", "0.1", "--seed", "0", "--chrome-trace", "--print-schedule"],
        ["--pp", "2", "--microbatches", "4"],
        ["--pp", "3", "--chunks", "2", "--microbatches", "6", "--schedule", "gpipe", "--link-ms", "0:1:2",
         "--message-bytes", "1e6", "--bandwidth-gbs", "4", "--link-jitter", "0.3", "--chrome-trace"],
        ["--pp", "4", "--chunks", "2", "--microbatches", "6"],
    ]
    for index, argv in enumerate(simulator):
        yield f"cli/simulator/{index}", lambda a=argv: _cli(main, a)
    dpp = [
        ["--pp", "4", "--microbatches", "8", "--link-ms", "1:2:3", "--seeds", "2"],
        ["--pp", "4", "--chunks", "2", "--microbatches", "8", "--jitter", "0.3", "--link-jitter", "0.5",
         "--p2p-ms", "0.3", "--seeds", "5", "--chrome-trace"],
        ["--pp", "3", "--chunks", "3", "--microbatches", "5", "--seeds", "3", "--policy", "dfc", "--budget", "4"],
        ["--pp", "4", "--chunks", "2", "--microbatches", "8", "--budget", "1"],
    ]
    for index, argv in enumerate(dpp):
        yield f"cli/dpp/{index}", lambda a=argv: _cli(dpp_main, a)


def compute_outcomes() -> dict[str, dict]:
    return {identifier: run() for identifier, run in scenarios()}

