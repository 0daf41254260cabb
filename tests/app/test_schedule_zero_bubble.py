"""Zero-bubble orders (megatron.app.schedule_zero_bubble): valid for every layout, deadlock-free on any
costs, gradients accumulated in 1F1B's order, zb-h1 within 1F1B's memory, and the makespans.

Measured on uniform costs (forward 1, backward 2 split I 1 + W 1, free links; with 2 chunks the
per-chunk costs are halved so the rank's model is the same size):

  pp=4 m=8:  1f1b 33, interleaved(2) 28.5, zb-h1 27 (1.22x 1f1b), zb-h2 27, zb-h1(2) 25.5, zb-h2(2) 25.5
  pp=4 m=16: 1f1b 57, interleaved(2) 52.5, zb-h1 51, zb-h2 51, zb-h1(2) 49.5, zb-h2(2) 49.5

(`python -m megatron.app.simulator --pp 4 --microbatches 8 --schedule zb-h1`; unhalved 2-chunk
costs: interleaved 57, zb-h1 51, zb-h2 51.) The split 1F1B order (I W where B was) makes 30: its
gradient leaves after I; zb-h1's later ranks also hold W's back for the drain (27)."""

import random

import pytest

from megatron.app import schedule_zero_bubble
from megatron.app.schedule import (
    ZERO_BUBBLE_SCHEDULES,
    PipelineLayout,
    ScheduleError,
    Task,
    TaskKind,
    build_schedule,
    validate_schedule,
)
from megatron.app.simulator import CostModel, main, simulate, simulate_schedule, static_policies

I, W = TaskKind.INPUT_GRAD, TaskKind.WEIGHT_GRAD
UNIFORM = CostModel(forward_time=1.0, backward_time=2.0)


def _layouts(max_pp=6, max_chunks=3):
    """Split layouts zero-bubble orders accept: pp 1..max_pp, chunks 1..max_chunks, many microbatch counts."""
    for pp in range(1, max_pp + 1):
        for chunks in range(1, max_chunks + 1):
            counts = range(1, 3 * pp + 2) if chunks == 1 else range(pp, 4 * pp + 1, pp)
            for microbatches in counts:
                yield PipelineLayout(pp, chunks, microbatches, split_backward=True)


def _reference(layout):
    """The unsplit 1F1B (one chunk) or interleaved layout and name a zero-bubble order replaces."""
    name = "1f1b" if layout.num_chunks == 1 else "interleaved"
    return name, PipelineLayout(layout.pp_size, layout.num_chunks, layout.num_microbatches)


def _makespan(name, layout, costs=UNIFORM):
    return simulate_schedule(name, layout, costs).makespan


# ------------------------------------------------------------------------------------ the orders


@pytest.mark.parametrize("name", ZERO_BUBBLE_SCHEDULES)
def test_every_order_validates(name):
    checked = 0
    for layout in _layouts():
        for rank in range(layout.pp_size):
            order = build_schedule(name, layout, rank)
            validate_schedule(layout, rank, order)
            assert len(order) == 3 * layout.num_chunks * layout.num_microbatches
            checked += 1
    assert checked > 300


@pytest.mark.parametrize("name", ZERO_BUBBLE_SCHEDULES)
def test_input_and_weight_gradients_run_in_microbatch_order_per_chunk(name):
    # What keeps the weight-gradient sums in 1F1B's order (bit-identical gradients).
    for layout in _layouts(max_pp=5):
        for rank in range(layout.pp_size):
            order = build_schedule(name, layout, rank)
            for kind in (I, W):
                for chunk in range(layout.num_chunks):
                    microbatches = [t.microbatch for t in order if t.kind is kind and t.chunk == chunk]
                    assert microbatches == list(range(layout.num_microbatches)), (name, layout, rank, kind)


@pytest.mark.parametrize("name", ZERO_BUBBLE_SCHEDULES)
def test_forwards_follow_the_reference_forward_sequence(name):
    for layout in _layouts(max_pp=4):
        reference_name, unsplit = _reference(layout)
        for rank in range(layout.pp_size):
            order = build_schedule(name, layout, rank)
            reference = build_schedule(reference_name, unsplit, rank)
            assert [t for t in order if t.is_forward] == [t for t in reference if t.is_forward]


def _in_flight_peak(order):
    """Most forwards whose I (or B) had not run, along an order."""
    waiting = peak = 0
    for task in order:
        waiting += 1 if task.is_forward else -1 if task.takes_gradient else 0
        peak = max(peak, waiting)
    return peak


def test_zb_h1_stores_no_more_than_1f1b():
    """No rank stores more activations than 1F1B's busiest rank, and no rank keeps more forwards
    awaiting their gradient than 1F1B does on that rank."""
    for layout in _layouts():
        reference_name, unsplit = _reference(layout)
        reference = simulate_schedule(reference_name, unsplit, UNIFORM).peak_stored_activations
        peaks = simulate_schedule("zb-h1", layout, UNIFORM).peak_stored_activations
        assert max(peaks) <= max(reference), (layout, peaks, reference)
        for rank in range(layout.pp_size):
            assert _in_flight_peak(build_schedule("zb-h1", layout, rank)) <= reference[rank], (layout, rank)
        h2 = simulate_schedule("zb-h2", layout, UNIFORM).peak_stored_activations
        assert all(p <= c for p, c in zip(h2, schedule_zero_bubble.activation_caps("zb-h2", layout)))


def test_activation_caps():
    layout = PipelineLayout(4, 1, 8, split_backward=True)
    assert schedule_zero_bubble.activation_caps("zb-h1", layout) == [4, 4, 4, 4]  # 1F1B's rank 0: p
    assert schedule_zero_bubble.in_flight_caps("zb-h1", layout) == [4, 3, 2, 1]  # 1F1B's p - r
    assert schedule_zero_bubble.activation_caps("zb-h2", layout) == [7, 6, 5, 4]  # 2p - 1 - r
    assert schedule_zero_bubble.in_flight_caps("zb-h2", layout) == [None] * 4
    layout = PipelineLayout(4, 2, 8, split_backward=True)
    assert schedule_zero_bubble.activation_caps("zb-h1", layout) == [11] * 4  # interleaved's rank 0
    assert schedule_zero_bubble.in_flight_caps("zb-h1", layout) == [11, 9, 7, 5]  # interleaved's peaks
    assert schedule_zero_bubble.activation_caps("zb-h2", layout) == [14, 13, 12, 11]


def test_orders_are_built_once_per_layout():
    layout = PipelineLayout(3, 1, 6, split_backward=True)
    assert schedule_zero_bubble.orders("zb-h1", layout) is schedule_zero_bubble.orders("zb-h1", layout)
    assert [build_schedule("zb-h1", layout, r) for r in range(3)] == \
        [list(order) for order in schedule_zero_bubble.orders("zb-h1", layout)]


# ----------------------------------------------------------------------------------------- errors


def test_unsplit_layout_is_refused_with_what_to_change():
    with pytest.raises(ScheduleError, match=r"zb-h1 runs each backward as an input gradient I and a weight "
                                            r"gradient W.*split_backward=True"):
        build_schedule("zb-h1", PipelineLayout(4, 1, 8), 0)


def test_chunks_need_a_multiple_of_pp_microbatches():
    with pytest.raises(ScheduleError, match=r"zb-h2 with num_chunks=2 follows the interleaved order.*"
                                            r"num_microbatches \(6\).*pp_size \(4\): use 4 or 8 microbatches"):
        build_schedule("zb-h2", PipelineLayout(4, 2, 6, split_backward=True), 0)


def test_bad_rank_and_name():
    layout = PipelineLayout(2, 1, 4, split_backward=True)
    with pytest.raises(ScheduleError, match="pp_rank 2 out of range: pp_size is 2"):
        build_schedule("zb-h1", layout, 2)
    with pytest.raises(ScheduleError, match="unknown zero-bubble schedule 'zb-h3'"):
        schedule_zero_bubble.build("zb-h3", layout, 0)


# ------------------------------------------------------------------------------ other cost models


COST_MODELS = {
    "slow rank": CostModel(forward_time=1.0, backward_time=2.0, rank_slowdown={1: 1.7}),
    "slow link": CostModel(forward_time=1.0, backward_time=2.0, p2p_latency=0.1, link_latency={(0, 1): 2.5, (1, 0): 2.5}),
    "jitter": CostModel(forward_time=1.0, backward_time=2.0, p2p_latency=0.2, jitter=0.6, link_jitter=0.6, seed=3),
    "W 0.3": CostModel(forward_time=1.0, backward_time=2.0, weight_grad_fraction=0.3),
    "W 0.7": CostModel(forward_time=1.0, backward_time=2.5, weight_grad_fraction=0.7, p2p_latency=0.3),
    "W free": CostModel(forward_time=1.0, backward_time=2.0, weight_grad_fraction=0.0),
    "I free": CostModel(forward_time=0.5, backward_time=2.0, weight_grad_fraction=1.0),
}


@pytest.mark.parametrize("costs", COST_MODELS.values(), ids=COST_MODELS.keys())
@pytest.mark.parametrize("name", ZERO_BUBBLE_SCHEDULES)
def test_orders_run_without_deadlock_on_other_costs(name, costs):
    for layout in _layouts(max_pp=5):
        policies = static_policies(layout, name)
        result = simulate(layout, policies, costs)  # SimulationDeadlock would fail the test
        for rank in range(layout.pp_size):
            assert result.order(rank) == list(policies[rank].order)


@pytest.mark.parametrize("seed", range(12))
def test_orders_run_without_deadlock_on_random_costs(seed):
    # Each order is one the construction ran with every task after its inputs: whatever the costs,
    # the blocked task that ran first there would find its input's producer already run.
    rng = random.Random(seed)
    pp, chunks = rng.randint(2, 6), rng.randint(1, 3)
    layout = PipelineLayout(pp, chunks, pp * rng.randint(1, 4), split_backward=True)
    stages = [(r, c) for r in range(pp) for c in range(chunks)]
    costs = CostModel(
        stage_forward_time={stage: rng.uniform(0.1, 3.0) for stage in stages},
        stage_backward_time={stage: rng.uniform(0.1, 6.0) for stage in stages},
        link_latency={(a, b): rng.uniform(0.0, 4.0) for a in range(pp) for b in range(pp) if a != b},
        rank_slowdown={rng.randrange(pp): rng.uniform(0.5, 3.0)},
        weight_grad_fraction=rng.random(), jitter=rng.random(), link_jitter=rng.random(), seed=seed,
    )
    for name in ZERO_BUBBLE_SCHEDULES:
        result = simulate_schedule(name, layout, costs)
        assert len(result.records) == 3 * pp * chunks * layout.num_microbatches


# --------------------------------------------------------------------------------------- makespans


def test_pp4_m8_makespans():
    layout = PipelineLayout(4, 1, 8, split_backward=True)
    one_f_one_b = _makespan("1f1b", PipelineLayout(4, 1, 8))
    zb_h1, zb_h2 = _makespan("zb-h1", layout), _makespan("zb-h2", layout)
    assert one_f_one_b == 33.0
    assert zb_h1 <= one_f_one_b / 1.10 + 1e-9  # the goal: zb-h1 at least 1.10x 1F1B at pp=4, m=2p
    assert zb_h1 == 27.0 and zb_h2 == 27.0  # (p-1)F + m(F+B): no order does better on these costs  # (p-1)F + m(F+B): no order does better on these costs


def test_pp4_m16_makespans():
    layout = PipelineLayout(4, 1, 16, split_backward=True)
    assert _makespan("1f1b", PipelineLayout(4, 1, 16)) == 57.0
    assert _makespan("zb-h1", layout) == 51.0
    assert _makespan("zb-h2", layout) == 51.0


def test_zb_h2_memory_absorbs_a_slow_link():
    # A 2 ms link between ranks 1 and 2 (both ways): the W's zb-h2 may hold back cover the wait.
    costs = CostModel(forward_time=1.0, backward_time=2.0, link_latency={(1, 2): 2.0, (2, 1): 2.0})
    layout = PipelineLayout(4, 1, 8, split_backward=True)
    assert _makespan("1f1b", PipelineLayout(4, 1, 8), costs) == 49.0
    assert _makespan("zb-h1", layout, costs) == 41.0
    assert _makespan("zb-h2", layout, costs) == 32.0


def test_zb_h1_beats_interleaved_with_two_chunks():
    layout = PipelineLayout(4, 2, 8, split_backward=True)
    interleaved = _makespan("interleaved", PipelineLayout(4, 2, 8))
    assert interleaved == 57.0
    assert _makespan("zb-h1", layout) == 51.0  # the bound (p-1)F + v m (F+B)
    assert _makespan("zb-h2", layout) == 51.0


@pytest.mark.parametrize("name", ZERO_BUBBLE_SCHEDULES)
def test_zero_bubble_never_slower_than_its_reference_on_uniform_costs(name):
    for layout in _layouts(max_pp=5):
        reference_name, unsplit = _reference(layout)
        assert _makespan(name, layout) <= _makespan(reference_name, unsplit), layout


def test_zb_h2_reaches_the_lower_bound_on_uniform_costs():
    # The last rank starts after p-1 forwards and then has v*m forwards and backwards to run.
    checked = 0
    for layout in _layouts():
        if layout.num_microbatches >= layout.pp_size:
            bound = layout.pp_size - 1 + layout.num_chunks * layout.num_microbatches * 3.0
            assert _makespan("zb-h2", layout) == bound, layout
            checked += 1
    assert checked > 50


def test_zb_h1_defers_weight_gradients_on_the_later_ranks():
    # The later ranks, below 1F1B's busiest memory, hold W's back for the drain; that is what makes
    # zb-h1 faster than the split 1F1B order (I W where B was) on uniform costs.
    layout = PipelineLayout(4, 1, 8, split_backward=True)
    order = build_schedule("zb-h1", layout, 3)
    assert any(task.kind is I and order[i + 1] != Task(W, task.chunk, task.microbatch) for i, task in enumerate(order))
    assert order != build_schedule("1f1b", layout, 3)
    assert _makespan("zb-h1", layout) < _makespan("1f1b", layout) == 30.0


def test_each_order_takes_the_faster_of_forward_first_and_input_first():
    # The choice the module's docstring documents: zb-h1 runs a ready forward first, zb-h2 a ready I.
    faster = {name: 0 for name in ZERO_BUBBLE_SCHEDULES}
    for layout in _layouts(max_pp=5, max_chunks=2):
        for name in ZERO_BUBBLE_SCHEDULES:
            ours = simulate(layout, static_policies(layout, schedule_zero_bubble.orders(name, layout)), UNIFORM)
            other = schedule_zero_bubble.orders(name, layout, forward_first=name != "zb-h1")
            theirs = simulate(layout, static_policies(layout, other), UNIFORM)
            assert ours.makespan <= theirs.makespan, (name, layout)
            faster[name] += ours.makespan < theirs.makespan
    assert all(count > 0 for count in faster.values()), faster


# ---------------------------------------------------------------------------- the split 1F1B order


SPLIT_COSTS = {  # no jitter: it is drawn per task name, and I0.3 is not B0.3
    "uniform": dict(forward_time=1.0, backward_time=2.0),
    "slow rank": dict(forward_time=1.0, backward_time=2.0, rank_slowdown={2: 1.5}),
    "slow link": dict(forward_time=1.0, backward_time=3.0, p2p_latency=0.4, link_latency={(2, 1): 2.0}),
}


@pytest.mark.parametrize("costs", SPLIT_COSTS.values(), ids=SPLIT_COSTS.keys())
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "gpipe"])
def test_split_static_orders_are_never_slower_than_unsplit(name, costs):
    # The split order runs I then W where B ran; I's gradient goes out as I ends, before W, so
    # nothing starts later. With a free W (fraction 0) I is B and the makespans are equal.
    for pp, chunks, microbatches in [(3, 1, 6), (4, 1, 8), (4, 2, 8), (3, 3, 9)]:
        if name == "1f1b" and chunks > 1:
            continue
        unsplit = _makespan(name, PipelineLayout(pp, chunks, microbatches), CostModel(**costs))
        split = PipelineLayout(pp, chunks, microbatches, split_backward=True)
        assert _makespan(name, split, CostModel(**costs, weight_grad_fraction=0.0)) == pytest.approx(unsplit)
        for fraction in (0.3, 0.5, 1.0):
            assert _makespan(name, split, CostModel(**costs, weight_grad_fraction=fraction)) <= unsplit + 1e-9


def test_split_1f1b_on_uniform_costs():
    # W after I: the gradient leaves W earlier each step, but the steady state is bound by F + I + W.
    split = PipelineLayout(4, 1, 8, split_backward=True)
    assert _makespan("1f1b", split) == 30.0  # zb-h1, which defers W's on the later ranks: 27
    assert _makespan("1f1b", PipelineLayout(4, 1, 8)) == 33.0


# ------------------------------------------------------------------------------------ command line


def test_command_line(capsys):
    assert main(["--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"]) == 0
    output = capsys.readouterr().out
    assert "schedule zb-h1: pp=4 chunks=1 microbatches=8 | forward 1 ms, backward 2 ms (W 50%)" in output
    assert "makespan 27.000 ms | mean bubble 11.1% | uniform-cost lower bound (p-1)F/((p-1)F+v*m*(F+B)) = 11.1%" \
        in output
    assert main(["--pp", "4", "--microbatches", "8", "--schedule", "zb-h2", "--weight-grad-fraction", "0.25",
                 "--print-schedule"]) == 0
    output = capsys.readouterr().out
    assert "(W 25%)" in output and "rank 3: F0.0 I0.0" in output
    assert main(["--pp", "4", "--microbatches", "6", "--chunks", "2", "--schedule", "zb-h1"]) == 2
    assert "use 4 or 8 microbatches" in capsys.readouterr().err
