"""Dry-run simulator: deadlock freedom of the static orders, bubble and memory numbers, deadlock
reports, cost model, the Policy interface, Chrome traces and the command line."""

import json
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

from megatron.app.schedule import SCHEDULES, ZERO_BUBBLE_SCHEDULES, PipelineLayout, Task, TaskKind, parse_schedule
from megatron.app.simulator import (
    CostModel,
    Policy,
    PolicyError,
    RankState,
    SimulationDeadlock,
    StaticOrderPolicy,
    main,
    simulate,
    simulate_schedule,
    static_policies,
    to_chrome_trace,
    write_chrome_trace,
)

F, B = TaskKind.FORWARD, TaskKind.BACKWARD


def _runnable(name, layout):
    if name == "1f1b":
        return layout.num_chunks == 1
    if name in ("interleaved", *ZERO_BUBBLE_SCHEDULES) and layout.num_chunks > 1:
        return layout.num_microbatches % layout.pp_size == 0
    return True


def _check_timeline(result, costs):
    """Every task ran once; each rank ran one task at a time; no task started before its input arrived."""
    layout = result.layout
    assert len(result.records) == layout.pp_size * len(list(layout.tasks()))
    by_key = {(r.rank, r.task): r for r in result.records}
    assert len(by_key) == len(result.records)
    for rank in range(layout.pp_size):
        records = result.rank_records(rank)
        for earlier, later in zip(records, records[1:]):
            assert earlier.end <= later.start + 1e-9
        for record in records:
            if record.task.prerequisite is not None:  # B or I after its own F, W after its own I
                assert by_key[(rank, record.task.prerequisite)].end <= record.start + 1e-9
            source = layout.input_source(rank, record.task)
            if source is not None:
                producer = by_key[(source[0], Task(record.task.kind, source[1], record.task.microbatch))]
                delay = costs.transfer_time(source[0], rank, producer.task)
                assert producer.end + delay <= record.start + 1e-9


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_static_orders_are_deadlock_free(name):
    costs = CostModel(forward_time=1.0, backward_time=2.0, p2p_latency=0.3, jitter=0.5, link_jitter=0.5, seed=7)
    simulated = 0
    for pp_size in (1, 2, 3, 4, 5, 8):
        for num_chunks in (1, 2, 3, 4):
            for num_microbatches in sorted({1, 2, 3, pp_size, pp_size + 1, 2 * pp_size, 3 * pp_size}):
                layout = PipelineLayout(pp_size, num_chunks, num_microbatches,
                                        split_backward=name in ZERO_BUBBLE_SCHEDULES)
                if not _runnable(name, layout):
                    continue
                result = simulate_schedule(name, layout, costs)
                _check_timeline(result, costs)
                for rank in range(pp_size):
                    assert result.order(rank) == list(static_policies(layout, name)[rank].order)
                simulated += 1
    assert simulated >= 25


@pytest.mark.parametrize("pp_size, num_microbatches", [(2, 2), (2, 7), (4, 8), (4, 16), (8, 8), (8, 32)])
@pytest.mark.parametrize("forward_time, backward_time", [(1.0, 1.0), (1.0, 2.0)])
def test_one_f_one_b_bubble_matches_analytic(pp_size, num_microbatches, forward_time, backward_time):
    layout = PipelineLayout(pp_size, 1, num_microbatches)
    result = simulate_schedule("1f1b", layout, CostModel(forward_time=forward_time, backward_time=backward_time))
    expected = (pp_size - 1) / (num_microbatches + pp_size - 1)
    assert result.bubble_fractions == pytest.approx([expected] * pp_size, rel=1e-12)
    assert result.makespan == pytest.approx((num_microbatches + pp_size - 1) * (forward_time + backward_time))


@pytest.mark.parametrize("pp_size, num_chunks, num_microbatches", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 16)])
def test_interleaved_bubble_matches_analytic(pp_size, num_chunks, num_microbatches):
    # With per-chunk costs, every rank idles (pp_size - 1) forward+backward pairs of one chunk.
    layout = PipelineLayout(pp_size, num_chunks, num_microbatches)
    result = simulate_schedule("interleaved", layout, CostModel(forward_time=1.0, backward_time=2.0))
    expected = (pp_size - 1) / (num_chunks * num_microbatches + pp_size - 1)
    assert result.bubble_fractions == pytest.approx([expected] * pp_size, rel=1e-12)


@pytest.mark.parametrize("pp_size, num_chunks, num_microbatches", [(4, 2, 8), (4, 4, 8), (8, 2, 16), (2, 3, 4)])
def test_interleaved_reduces_the_bubble(pp_size, num_chunks, num_microbatches):
    # Same total model cost: each of num_chunks chunks is 1/num_chunks of the stage.
    one_chunk = simulate_schedule("1f1b", PipelineLayout(pp_size, 1, num_microbatches), CostModel())
    costs = CostModel(forward_time=1.0 / num_chunks, backward_time=2.0 / num_chunks)
    interleaved = simulate_schedule("interleaved", PipelineLayout(pp_size, num_chunks, num_microbatches), costs)
    assert max(interleaved.bubble_fractions) < min(one_chunk.bubble_fractions)
    assert interleaved.makespan < one_chunk.makespan


def test_interleaved_small_literal_case_is_deadlock_free():
    layout = PipelineLayout(2, 2, 4)
    orders = [
        parse_schedule("F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3"),
        parse_schedule("F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3"),
    ]
    result = simulate(layout, static_policies(layout, orders), CostModel(forward_time=1, backward_time=1))
    assert [result.order(r) for r in range(2)] == orders
    assert result.makespan == pytest.approx(18.0)  # 16 busy + 2 idle per rank


def test_peak_stored_activations():
    layout = PipelineLayout(4, 1, 8)
    assert simulate_schedule("1f1b", layout).peak_stored_activations == (4, 3, 2, 1)  # pp_size - rank
    assert simulate_schedule("gpipe", layout).peak_stored_activations == (8, 8, 8, 8)
    interleaved = simulate_schedule("interleaved", PipelineLayout(4, 2, 8))
    assert interleaved.peak_stored_activations == (11, 9, 7, 5)  # warmup (p-r-1)*2 + (v-1)*p, plus one


def test_inconsistent_orders_raise_deadlock_with_blocked_task_marked():
    layout = PipelineLayout(2, 1, 2)
    # Each order is valid on its own; together rank 0 waits for a gradient that rank 1 will only send
    # after a forward that rank 0 has not run.
    orders = [parse_schedule("F0.0 B0.0 F0.1 B0.1"), parse_schedule("F0.0 F0.1 B0.0 B0.1")]
    with pytest.raises(SimulationDeadlock) as caught:
        simulate(layout, static_policies(layout, orders), CostModel(forward_time=1, backward_time=2))
    message = str(caught.value)
    assert "pipeline deadlock at t=2.000 ms" in message
    assert "rank 0: F0.0 [B0.0] F0.1 B0.1 -- B0.0 waits for the gradient from B0.0 on rank 1, not run yet" in message
    assert "rank 1: F0.0 [F0.1] B0.0 B0.1 -- F0.1 waits for the activation from F0.1 on rank 0, not run yet" in message
    assert caught.value.blocked == {0: Task(B, 0, 0), 1: Task(F, 0, 1)}
    assert [(r.rank, str(r.task)) for r in caught.value.records] == [(0, "F0.0"), (1, "F0.0")]


def test_deadlock_report_shortens_long_orders():
    layout = PipelineLayout(2, 1, 40)
    rank0 = parse_schedule(" ".join(f"F0.{m} B0.{m}" for m in range(40)))
    rank1 = parse_schedule(" ".join([f"F0.{m}" for m in range(40)] + [f"B0.{m}" for m in range(40)]))
    with pytest.raises(SimulationDeadlock, match=r"rank 1: F0\.0 \[F0\.1\] F0\.2 F0\.3 (F0\.\d+ ){10}\.\.\.\(66 more\) -- F0\.1 waits"):
        simulate(layout, static_policies(layout, [rank0, rank1]))


def test_slow_rank_lengthens_makespan():
    layout = PipelineLayout(4, 1, 8)
    base = simulate_schedule("1f1b", layout, CostModel())
    slow = simulate_schedule("1f1b", layout, CostModel(rank_slowdown={2: 1.5}))
    assert slow.makespan > base.makespan
    assert slow.busy_time[2] == pytest.approx(1.5 * base.busy_time[2])
    assert slow.bubble_fractions[2] < min(slow.bubble_fractions[r] for r in (0, 1, 3))  # the others wait for it


def test_latency_bandwidth_and_per_stage_costs():
    layout = PipelineLayout(2, 1, 1)
    costs = CostModel(forward_time=1, backward_time=2, p2p_latency=0.5, message_bytes=2e6, bandwidth_gbs=4.0,
                      link_latency={(1, 0): 1.0}, stage_forward_time={(1, 0): 3.0})
    assert costs.transfer_time(0, 1, Task(F, 0, 0)) == pytest.approx(1.0)  # 0.5 ms + 2 MB at 4 GB/s
    assert costs.transfer_time(1, 0, Task(B, 0, 0)) == pytest.approx(1.5)
    assert costs.transfer_time(1, 1, Task(F, 0, 0)) == 0.0
    result = simulate_schedule("1f1b", layout, costs)
    # F on rank 0 [0,1], message 1 ms, F on rank 1 [2,5], B [5,7], gradient 1.5 ms, B on rank 0 [8.5,10.5].
    assert [(str(r.task), r.rank, r.start, r.end) for r in result.records] == [
        ("F0.0", 0, 0.0, 1.0), ("F0.0", 1, 2.0, 5.0), ("B0.0", 1, 5.0, 7.0), ("B0.0", 0, 8.5, 10.5)]
    assert [(t.src_rank, t.dst_rank, t.send_time, t.arrival_time) for t in result.transfers] == [
        (0, 1, 1.0, 2.0), (1, 0, 7.0, 8.5)]


def test_jitter_is_seeded_and_bounded():
    layout = PipelineLayout(4, 2, 8)
    plain = simulate_schedule("interleaved", layout, CostModel())
    first = simulate_schedule("interleaved", layout, CostModel(jitter=0.2, seed=1))
    again = simulate_schedule("interleaved", layout, CostModel(jitter=0.2, seed=1))
    other = simulate_schedule("interleaved", layout, CostModel(jitter=0.2, seed=2))
    assert first == again
    assert first.makespan != other.makespan
    assert first.makespan != plain.makespan
    for record in first.records:
        nominal = 1.0 if record.task.kind is F else 2.0
        assert 0.8 * nominal <= record.end - record.start <= 1.2 * nominal


@pytest.mark.parametrize("kwargs, message", [
    (dict(forward_time=-1), "forward_time must be >= 0, got -1"),
    (dict(rank_slowdown={1: 0}), "slowdown of rank 1 must be > 0"),
    (dict(jitter=1.5), r"jitter is relative and must be in \[0, 1\], got 1.5"),
    (dict(bandwidth_gbs=0), "bandwidth of all links must be > 0 GB/s"),
])
def test_cost_model_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**kwargs)


# ------------------------------------------------------------------------------- dynamic policies


class BackwardFirst:
    """A dynamic policy: any ready backward first (frees memory), else the lowest ready forward."""

    def choose(self, state: RankState, ready: Sequence[Task]) -> Task | None:
        backwards = [task for task in ready if task.kind is B]
        return min(backwards or ready, key=lambda task: (task.microbatch, task.chunk), default=None)


class CappedForwards:
    """Declines forwards while `cap` activations are stored, as a memory-budget policy would."""

    def __init__(self, cap: int):
        self.cap = cap

    def choose(self, state: RankState, ready: Sequence[Task]) -> Task | None:
        for task in ready:
            if task.kind is B or state.stored_activations < self.cap:
                return task
        return None


def test_dynamic_policy_runs_any_ready_task():
    layout = PipelineLayout(4, 2, 8)
    costs = CostModel(p2p_latency=0.2, jitter=0.3, seed=3)
    assert isinstance(BackwardFirst(), Policy)
    result = simulate(layout, [BackwardFirst() for _ in range(4)], costs)
    _check_timeline(result, costs)
    static = simulate_schedule("interleaved", layout, costs)
    assert result.order(0) != static.order(0)


def test_memory_capped_policy_respects_its_cap():
    layout = PipelineLayout(4, 1, 8)
    result = simulate(layout, [CappedForwards(cap=4 - rank) for rank in range(4)], CostModel())
    assert result.peak_stored_activations == (4, 3, 2, 1)
    # A cap too small for the pipeline's depth stalls it; the report says what each rank waits for.
    with pytest.raises(SimulationDeadlock, match=r"rank 0: \[B0\.0\] .*its policy chose none of the ready F0\.0"):
        simulate(layout, [CappedForwards(cap=0) for _ in range(4)], CostModel())


def test_policy_choosing_a_task_that_is_not_ready_is_an_error():
    class Eager:
        def choose(self, state, ready):
            return Task(B, 0, 0)

    with pytest.raises(PolicyError, match=r"policy of rank 0 chose B0\.0 at t=0\.000 ms, which is not ready \(ready: F0\.0 F0\.1\)"):
        simulate(PipelineLayout(2, 1, 2), [Eager(), Eager()])


def test_static_policy_validates_its_order():
    with pytest.raises(ValueError, match=r"rank 1: schedule is missing 1 task\(s\): B0\.1"):
        StaticOrderPolicy(parse_schedule("F0.0 F0.1 B0.0"), layout=PipelineLayout(2, 1, 2), pp_rank=1)


# ----------------------------------------------------------------------------------- chrome trace


def test_chrome_trace_has_one_slice_per_task(tmp_path):
    layout = PipelineLayout(4, 2, 8)
    result = simulate_schedule("interleaved", layout, CostModel(p2p_latency=0.1))
    path = tmp_path / "trace.json"
    write_chrome_trace(result, path)
    assert os.listdir(tmp_path) == ["trace.json"]  # the temporary file was renamed, not left behind
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(to_chrome_trace(result)))
    slices = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    assert len(slices) == len(result.records) == 4 * 2 * 2 * 8
    assert {(event["pid"], event["name"]) for event in slices} == {(r.rank, str(r.task)) for r in result.records}
    assert {event["pid"] for event in slices} == {0, 1, 2, 3}
    first = next(event for event in slices if event["pid"] == 1 and event["name"] == "F1.3")
    record = next(r for r in result.records if r.rank == 1 and str(r.task) == "F1.3")
    assert first["ts"] == pytest.approx(record.start * 1000) and first["dur"] == pytest.approx(1000.0)
    assert first["args"] == {"chunk": 1, "microbatch": 3, "virtual_stage": 5}
    flows = [event for event in trace["traceEvents"] if event["ph"] in "sf"]
    assert len(flows) == 2 * len(result.transfers)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == 0]
    assert max(e["args"]["count"] for e in counters) == result.peak_stored_activations[0]
    assert counters[-1]["args"]["count"] == 0


# -------------------------------------------------------------------------------------------- cli


def test_cli_prints_schedule_and_table(capsys, tmp_path):
    trace = tmp_path / "out.json"
    code = main(["--pp", "4", "--chunks", "2", "--microbatches", "8", "--schedule", "interleaved",
                 "--p2p-ms", "0.1", "--slow-rank", "2:1.5", "--jitter", "0.1", "--seed", "0",
                 "--chrome-trace", str(trace), "--print-schedule"])
    output = capsys.readouterr().out
    assert code == 0
    assert "rank 0: F0.0 F0.1 F0.2 F0.3 F1.0" in output
    assert "rank  tasks    busy ms    idle ms   bubble  peak activations" in output
    assert "makespan" in output and "uniform-cost ideal (p-1)/(v*m+p-1) = 15.8%" in output
    assert len([e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]) == 128


def test_cli_reports_bad_configuration(capsys):
    assert main(["--pp", "4", "--chunks", "2", "--microbatches", "6"]) == 2
    assert "error: interleaved schedule needs num_microbatches (6) to be a multiple of pp_size (4)" in (
        capsys.readouterr().err)
    assert main(["--pp", "2", "--microbatches", "4", "--slow-rank", "5:2"]) == 2
    assert "--slow-rank names rank 5, but --pp 2 has ranks 0..1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--pp", "2", "--microbatches", "4", "--slow-rank", "fast"])
    assert "expected RANK:FACTOR such as 2:1.5" in capsys.readouterr().err


def test_module_runs_without_torch():
    code = (
        "import sys; import megatron.app.simulator as s; "
        "assert 'torch' not in sys.modules, 'simulator imported torch'; "
        "sys.exit(s.main(['--pp', '2', '--microbatches', '4']))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert "schedule 1f1b: pp=2 chunks=1 microbatches=4" in completed.stdout
