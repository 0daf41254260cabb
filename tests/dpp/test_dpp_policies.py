"""DPP policies in the simulator: no deadlock and the memory budget kept under random compute and
communication delays (seeded, many cases); choice rules; peak activations of each policy vs 1F1B."""
from __future__ import annotations

import random

import pytest

from megatron.app.schedule import PipelineLayout, Task
from megatron.app.simulator import CostModel, RankState, simulate, simulate_schedule, static_policies
from megatron.dpp.policy import (DppPolicy, default_budget, dpp_policies, minimum_budget,
                                 static_peak_activations)
from simulation_cases import random_case


@pytest.mark.parametrize("policy", ["adaptive", "dfc", "bfc"])
def test_random_delays_never_deadlock_and_keep_the_budget(policy):
    for seed in range(250):
        layout, costs = random_case(seed)
        rng = random.Random(seed * 7 + 1)
        budget = rng.choice([None, minimum_budget(layout), default_budget("adaptive", layout),
                             rng.randint(minimum_budget(layout), layout.num_chunks * layout.num_microbatches)])
        result = simulate(layout, dpp_policies(layout, policy, budget), costs)  # raises on deadlock
        assert len(result.records) == 2 * layout.pp_size * layout.num_chunks * layout.num_microbatches
        if budget is not None:
            assert max(result.peak_stored_activations) <= budget, (seed, layout, budget)


def test_adaptive_default_budget_is_kept_under_jitter():
    for seed in range(100):
        layout, costs = random_case(seed)
        budget = default_budget("adaptive", layout)
        result = simulate(layout, dpp_policies(layout, "adaptive"), costs)
        assert max(result.peak_stored_activations) <= budget


def _state(layout, executed, stored):
    return RankState(rank=0, layout=layout, executed=[Task.parse(t) for t in executed], stored_activations=stored)


def test_choice_rules():
    layout = PipelineLayout(2, 2, 4)
    ready = [Task.parse(t) for t in ("F0.2", "F1.0", "B1.1")]
    executed = ["F0.0", "F0.1", "F1.1"]
    assert str(DppPolicy("dfc", layout).choose(_state(layout, executed, 3), ready)) == "B1.1"
    assert str(DppPolicy("bfc", layout).choose(_state(layout, executed, 3), ready)) == "F0.2"
    assert str(DppPolicy("adaptive", layout, 8).choose(_state(layout, executed, 3), ready)) == "B1.1"
    forwards = [Task.parse("F0.2"), Task.parse("F1.0")]
    assert str(DppPolicy("adaptive", layout, 8).choose(_state(layout, executed, 3), forwards)) == "F0.2"
    # At the budget a new microbatch (F0.2) is not admitted; F1.0 belongs to a started one and is.
    assert str(DppPolicy("adaptive", layout, 4).choose(_state(layout, executed, 3), forwards)) == "F1.0"
    assert DppPolicy("adaptive", layout, 4).choose(_state(layout, executed, 3), [Task.parse("F0.2")]) is None


def test_budget_below_minimum_is_refused():
    with pytest.raises(ValueError, match="below the minimum 2"):
        DppPolicy("adaptive", PipelineLayout(4, 2, 8), 1)


def test_peak_activations_ordering():
    """dfc runs backwards first and stores less than breadth-first bfc (which stores every microbatch,
    like GPipe); 1F1B stores the least; adaptive stays at its budget."""
    layout = PipelineLayout(4, 1, 8)
    peaks = {"1f1b": simulate_schedule("1f1b", layout).peak_stored_activations}
    for policy in ("dfc", "bfc", "adaptive"):
        peaks[policy] = simulate(layout, dpp_policies(layout, policy)).peak_stored_activations
    assert peaks["1f1b"] == (4, 3, 2, 1)
    assert peaks["bfc"] == (8, 8, 8, 8)
    assert all(a <= b <= c for a, b, c in zip(peaks["1f1b"], peaks["dfc"], peaks["bfc"]))
    assert sum(peaks["dfc"]) < sum(peaks["bfc"])
    assert max(peaks["adaptive"]) <= default_budget("adaptive", layout) == 8
    budget = static_peak_activations(layout)
    for policy in ("dfc", "bfc", "adaptive"):
        assert max(simulate(layout, dpp_policies(layout, policy, budget)).peak_stored_activations) <= budget


def test_dynamic_policy_absorbs_a_slow_link_better_than_1f1b():
    layout = PipelineLayout(4, 1, 8)
    costs = CostModel(link_latency={(1, 2): 3.0, (2, 1): 3.0})
    static = simulate(layout, static_policies(layout, "1f1b"), costs).makespan
    dynamic = simulate(layout, dpp_policies(layout, "adaptive"), costs).makespan
    assert dynamic < 0.9 * static, (dynamic, static)


def test_simulate_cli_compares_policies_with_static(capsys):
    from megatron.dpp.simulate import main

    assert main(["--pp", "4", "--microbatches", "8", "--link-ms", "1:2:3", "--seeds", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:]}
    assert set(rows) == {"1f1b", "adaptive", "dfc", "bfc"}
    assert rows["1f1b"][3] == "1.00x" and float(rows["adaptive"][3].rstrip("x")) < 0.9
    assert main(["--pp", "4", "--chunks", "2", "--microbatches", "8", "--budget", "1"]) == 2
    assert "below the minimum 2" in capsys.readouterr().err


# --- split backwards (--dpp-split-backward): W fills idle time ----------------------------------


@pytest.mark.parametrize("policy", ["adaptive", "dfc", "bfc"])
def test_split_backwards_never_deadlock_keep_the_budget_and_run_every_w(policy):
    for seed in range(150):
        layout, costs = random_case(seed)
        layout = PipelineLayout(layout.pp_size, layout.num_chunks, layout.num_microbatches, split_backward=True)
        budget = random.Random(seed).choice([None, minimum_budget(layout), default_budget("adaptive", layout)])
        result = simulate(layout, dpp_policies(layout, policy, budget), costs)  # raises on deadlock
        for rank in range(layout.pp_size):
            assert sorted(result.order(rank)) == sorted(layout.tasks())
        if budget is not None:
            assert max(result.peak_stored_activations) <= budget, (seed, layout, budget)


def test_w_runs_only_when_no_forward_or_input_gradient_may_run_oldest_first():
    layout = PipelineLayout(2, 1, 4, split_backward=True)
    executed = ["F0.0", "F0.1", "F0.2", "I0.1", "I0.0"]  # I0.1 ran before I0.0: its W is the older
    policy = DppPolicy("adaptive", layout, 8)
    waiting = [Task.parse("W0.0"), Task.parse("W0.1")]
    assert str(policy.choose(_state(layout, executed, 3), [Task.parse("F0.3"), *waiting])) == "F0.3"
    assert str(policy.choose(_state(layout, executed, 3), [Task.parse("I0.2"), *waiting])) == "I0.2"
    assert str(policy.choose(_state(layout, executed, 3), waiting)) == "W0.1"
    # At the budget a new microbatch's forward is not admitted, so a W runs (and frees its slot).
    assert str(DppPolicy("adaptive", layout, 3).choose(_state(layout, executed, 3),
                                                       [Task.parse("F0.3"), *waiting])) == "W0.1"


def test_split_backwards_absorb_a_slow_link_beyond_the_goal():
    """The issue's goal, in the simulator: DPP with W at least 1.15x 1F1B with one slow link."""
    costs = CostModel(link_latency={(1, 2): 2.0, (2, 1): 2.0})
    for pp, microbatches in ((4, 8), (2, 4)):
        static = simulate(PipelineLayout(pp, 1, microbatches), static_policies(PipelineLayout(pp, 1, microbatches),
                                                                                "1f1b"), costs).makespan
        split = PipelineLayout(pp, 1, microbatches, split_backward=True)
        with_w = simulate(split, dpp_policies(split, "adaptive"), costs).makespan
        without = simulate(PipelineLayout(pp, 1, microbatches), dpp_policies(PipelineLayout(pp, 1, microbatches),
                                                                             "adaptive"), costs).makespan
        assert static / with_w >= 1.15 and with_w < without, (pp, static, without, with_w)


def test_simulate_cli_with_split_backwards(capsys):
    from megatron.dpp.simulate import main

    assert main(["--pp", "4", "--microbatches", "8", "--link-ms", "1:2:2", "--link-ms", "2:1:2", "--seeds", "1",
                 "--split-backward"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"1f1b", "zb-h1", "zb-h2", "adaptive", "dfc", "bfc", "adaptive+W", "dfc+W", "bfc+W"}
    assert float(rows["adaptive+W"][1]) < float(rows["adaptive"][1]) < float(rows["1f1b"][1])
