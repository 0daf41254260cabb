"""Seeded random pipelines and cost models for the simulator's tests (MegaDPP's policies and the
one engine's equivalence with the old ones draw the same cases)."""
from __future__ import annotations

import random

from megatron.app.schedule import PipelineLayout
from megatron.app.simulator import CostModel


def random_case(seed: int) -> tuple[PipelineLayout, CostModel]:
    rng = random.Random(seed)
    pp, chunks = rng.choice([1, 2, 3, 4, 6]), rng.choice([1, 1, 2, 3])
    layout = PipelineLayout(pp, chunks, rng.choice([1, 2, 3, 4, 5, 8, 12]))
    costs = CostModel(forward_time=rng.uniform(0.2, 3), backward_time=rng.uniform(0.2, 5),
                      p2p_latency=rng.uniform(0, 3), jitter=rng.uniform(0, 1), link_jitter=rng.uniform(0, 1),
                      rank_slowdown={rng.randrange(pp): rng.uniform(1, 4)},
                      link_latency={(rng.randrange(pp), rng.randrange(pp)): rng.uniform(0, 10)}, seed=seed)
    return layout, costs
