"""The arithmetic of straggler mitigation: shares, hysteresis, layer splits, microbatch plans."""
from __future__ import annotations

import itertools
import random

import pytest

from megatron.app.data import MicrobatchSource
from megatron.app.microbatches import MicrobatchPlan
from megatron.mitigation.balance import Rebalancer, plan_cost, plan_shares, snap, split_layers, stage_cost


def _best_by_search(total, times, bubble, granularity):
    """Every split into multiples of `granularity` (>= one unit each): the minimum slowest cost."""
    units = total // granularity
    best = None
    for cut in itertools.combinations(range(1, units), len(times) - 1):
        shares = [b - a for a, b in zip((0, *cut), (*cut, units))]
        cost = plan_cost([s * granularity for s in shares], times, bubble)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_shares_are_optimal_and_add_up(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3, 4])
    granularity = rng.choice([1, 2])
    total = granularity * rng.randint(replicas, 12)
    times = [rng.uniform(0.2, 1.0) for _ in range(replicas)]
    bubble = rng.choice([0.0, 1.0, 3.0])
    shares = plan_shares(total, times, bubble=bubble, granularity=granularity)
    assert sum(shares) == total and all(s >= granularity and s % granularity == 0 for s in shares)
    assert plan_cost(shares, times, bubble) == pytest.approx(_best_by_search(total, times, bubble, granularity))


def test_one_half_speed_replica_of_four():
    # 64 microbatches, replica 3 at half speed: it gets about half as many as each other one.
    shares = plan_shares(64, [1.0, 1.0, 1.0, 2.0])
    assert shares[3] == 9 and sum(shares) == 64
    # The ideal is 64 / 3.5 = 18.3 microbatch-times; the plan is within one microbatch of it.
    assert plan_cost(shares, [1.0, 1.0, 1.0, 2.0], 0.0) <= 64 / 3.5 + 1
    assert plan_shares(64, [1.0] * 4) == (16,) * 4


def test_snap_ignores_noise_but_not_a_straggler():
    assert snap([1.0, 0.95, 1.05, 1.08], 0.1) == (1.025,) * 4
    assert snap([1.0, 0.98, 1.02, 2.0], 0.1) == (1.01, 1.01, 1.01, 2.0)
    assert snap([1.0, 2.0], 0.1) == (1.0, 2.0)  # two replicas: the fast one keeps its time too


def test_rebalancer_waits_for_patience_and_comes_back():
    r = Rebalancer(4, 16, threshold=0.1, patience=2, window=3)
    healthy = [1.0, 1.02, 0.97, 1.01]
    slow = [1.0, 1.02, 0.97, 2.0]
    assert all(r.observe(healthy) is None for _ in range(10))
    assert r.shares == (16,) * 4
    decisions = [r.observe(slow) for _ in range(5)]
    changed = [d for d in decisions if d is not None]
    # The window median turns slow at the second slow iteration; two agreeing decisions later it acts.
    assert len(changed) == 1 and decisions.index(changed[0]) == 2
    assert changed[0].shares[3] < 16 and sum(changed[0].shares) == 64
    assert changed[0].predicted_after < changed[0].predicted_before * 0.9
    # Noise around the slow rank's speed does not move work again ...
    rng = random.Random(0)
    for _ in range(20):
        assert r.observe([1.0 * rng.uniform(0.95, 1.05), 1.0, 1.0, 2.0 * rng.uniform(0.95, 1.05)]) is None
    # ... and a recovered rank brings the even split back.
    back = [r.observe(healthy) for _ in range(6)]
    assert [d.shares for d in back if d is not None] == [(16,) * 4]


def test_one_noisy_iteration_is_not_a_straggler():
    r = Rebalancer(4, 16, threshold=0.1, patience=3, window=5)
    for i in range(40):
        times = [1.0, 1.0, 1.0, 1.0]
        times[i % 4] = 3.0  # a different replica is slow each iteration
        assert r.observe(times) is None


def test_layer_split_moves_layers_off_the_slow_stage():
    assert split_layers(8, [1.0, 1.0]) == (4, 4)
    assert split_layers(8, [1.0, 2.0]) in {(5, 3), (6, 2)}
    assert stage_cost(split_layers(8, [1.0, 2.0]), [1.0, 2.0]) == 6.0
    assert split_layers(4, [1.0, 100.0, 1.0, 1.0]) == (1, 1, 1, 1)  # every stage keeps a layer
    assert split_layers(8, [1.0, 3.0], unit=2) == (6, 2)  # two virtual chunks per stage: even counts


def test_plan_covers_the_global_batch_exactly_once():
    plan = MicrobatchPlan(shares=(5, 5, 4, 2), nominal=4)
    assert [plan.first(d) for d in range(4)] == [0, 5, 10, 14]
    source = MicrobatchSource(list(range(10_000)), global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    iteration = 3
    planned = [i for d in range(4) for mb in range(plan.count(d))
               for i in source.global_sample_indices(iteration, plan.first(d) + mb)]
    even = [i for d in range(4) for mb in range(4) for i in source.sample_indices(iteration, d, mb)]
    assert planned == even == list(range(iteration * 32, (iteration + 1) * 32))
    with pytest.raises(ValueError, match="add up"):
        MicrobatchPlan(shares=(5, 5, 4, 1), nominal=4)
    with pytest.raises(ValueError, match="at least one"):
        MicrobatchPlan(shares=(8, 8, 0, 0), nominal=4)


def test_a_change_that_does_not_pay_holds_off_and_one_that_hurts_is_undone():
    slow = [1.0, 1.0, 1.0, 2.0]
    # Predicted to help, but iterations take as long as before: the next change waits longer.
    r = Rebalancer(4, 16, threshold=0.1, patience=1, window=2)
    decisions = [r.observe(slow, iteration_time=1.0) for _ in range(2)]
    assert decisions[-1] is not None and r.shares[3] < 16
    assert [r.observe(slow, iteration_time=1.0) for _ in range(2)] == [None, None]
    assert r.failures == 1 and r.hold_off == 3  # 2 windows, one measurement of which has passed
    # Predicted to help, but iterations got 30% slower: undone at once, back to the previous plan.
    r = Rebalancer(4, 16, threshold=0.1, patience=1, window=2)
    [r.observe(slow, iteration_time=1.0) for _ in range(2)]
    r.observe(slow, iteration_time=1.3)
    undo = r.observe(slow, iteration_time=1.3)
    assert undo is not None and undo.shares == (16,) * 4 and undo.undone == (1.0, 1.3)
    assert r.hold_off == 4
    # A change that delivers resets the count.
    r = Rebalancer(4, 16, threshold=0.1, patience=1, window=2)
    [r.observe(slow, iteration_time=1.0) for _ in range(2)]
    assert [r.observe(slow, iteration_time=0.6) for _ in range(2)] == [None, None]
    assert r.failures == 0 and r.hold_off == 0
