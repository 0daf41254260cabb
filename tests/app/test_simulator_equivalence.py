"""One engine runs every simulation, and its results are those of the two engines before it: over
1,500 scenarios (static orders, MegaDPP policies with every budget, hand-written policies and the
calls they receive, deadlocks, policy errors, action lists, Chrome traces and both command lines),
each outcome equals the one stored in tests/app/data/simulator_reference.json, which the policy
engine and the action-list engine wrote before they became one (tests/app/simulator_scenarios.py
lists the scenarios). The policy simulator's lowered lists, run as lists, give the same run."""
from __future__ import annotations

import json

import pytest

from megatron.app.actions import Op, compute_tasks, lower
from megatron.app.schedule import SCHEDULES, PipelineLayout
from megatron.app.simulator import CostModel, PolicyProgram, simulate, static_policies
from megatron.app.simulator_actions import Engine, simulate_actions
from megatron.dpp.policy import dpp_policies

from simulator_scenarios import REFERENCE, scenarios

GROUPS = ("static", "actions", "dpp", "dpp-ties", "recorder", "backward-first", "capped", "deadlock", "cli")


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("group", GROUPS)
def test_every_outcome_equals_the_one_before_the_engines_became_one(group, reference):
    compared = 0
    for identifier, run in scenarios():
        if identifier.split("/")[0] != group:
            continue
        assert run() == reference[identifier], identifier
        compared += 1
    assert compared == sum(1 for key in reference if key.split("/")[0] == group) > 0


def test_the_scenarios_are_the_reference_ones(reference):
    assert sorted(identifier for identifier, _ in scenarios()) == sorted(reference)


@pytest.mark.parametrize("policy", ["1f1b", "interleaved", "adaptive", "dfc", "bfc"])
def test_the_lists_the_policies_were_lowered_to_replay_to_the_same_run(policy):
    """What `simulate` ran is action lists: given back to the engine as fixed lists, they give the
    same records, transfers and memory peaks."""
    layout = PipelineLayout(4, 1 if policy == "1f1b" else 2, 8)
    costs = CostModel(p2p_latency=0.3, jitter=0.4, link_jitter=0.5, seed=3, rank_slowdown={2: 1.6})

    def policies():
        return static_policies(layout, policy) if policy in SCHEDULES else dpp_policies(layout, policy)

    engine = Engine(layout, [PolicyProgram(layout, rank, p) for rank, p in enumerate(policies())], costs)
    assert engine.run()
    assert all(program[0].op is Op.RECV or rank == 0 for rank, program in enumerate(engine.programs))
    replayed = simulate_actions(layout, engine.programs, costs)
    assert replayed == engine.result() == simulate(layout, policies(), costs)
    if policy in SCHEDULES:  # a static order's lists are `lower`'s, with every receive posted up front
        for rank, program in enumerate(engine.programs):
            assert compute_tasks(program) == compute_tasks(lower(layout, rank, policies()[rank].order))
