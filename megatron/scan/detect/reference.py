"""The reference ranks of a large job: the peers every rank of a stage is compared with, per task
and per call, when the stage is too large for one process to hold every rank's rows.

Up to REFERENCE_PEERS ranks per stage, all of a stage's ranks are the reference, and each rank
is compared with the median of all its peers (the others of its stage), as the analyzers always
did. A stage of more ranks is compared with REFERENCE_PEERS of them, spread evenly over its ranks
(so over its nodes: a slow node holds at most a few), and so are the job-wide medians taken over
rows (the spread of one task around its rank's median, the pooled P2P deliveries): rank 0 then
needs the rows of REFERENCE_PEERS ranks per stage, whatever the job's size, and every other rank's
comparison is made where its rows are (on its node, megatron.scan.detect.summary) and sent to
rank 0 as a few numbers per iteration. The full analysis of one process uses the same reference,
so both name the same ranks.

Why a sample is enough: every compared rank is measured against the same reference, so the
reference's own error shifts all their ratios alike. The median of 64 healthy ranks' log busy
times errs by about 1.25 / 8 of one task's spread; over the calls of an iteration and then the
iterations of a run it is far below the spread of healthy ranks' medians that names a rank."""
from __future__ import annotations

import numpy as np

from megatron.scan.detect.model import RankRole

REFERENCE_PEERS = 64


def stage_members(roles: dict[int, RankRole]) -> dict[tuple, np.ndarray]:
    """Each stage's ranks, sorted."""
    stages: dict[tuple, list[int]] = {}
    for rank, role in roles.items():
        stages.setdefault(role.stage, []).append(int(rank))
    return {stage: np.asarray(sorted(ranks), dtype=np.int64) for stage, ranks in stages.items()}


def reference_ranks(roles: dict[int, RankRole], peers: int | None = None) -> np.ndarray:
    """The sorted reference ranks: every rank of a stage of up to `peers` ranks, else one of each
    of `peers` equal blocks of its sorted ranks, at a position that moves by one from block to
    block (block i's i-th rank, modulo the block's length): one rank per block spreads them over
    the nodes, and the moving position over the ranks' places on a node (evenly spaced positions
    of a stage of 1,024 ranks in nodes of 8 would all be every node's first GPU)."""
    peers = REFERENCE_PEERS if peers is None else peers
    chosen = []
    for ranks in stage_members(roles).values():
        if len(ranks) <= peers:
            chosen.append(ranks)
        else:
            block = len(ranks) // peers
            i = np.arange(peers)
            chosen.append(ranks[i * block + i % block])
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def sampled(roles: dict[int, RankRole], peers: int | None = None) -> bool:
    """Whether some stage is compared with a sample of its ranks (more than `peers` ranks)."""
    peers = REFERENCE_PEERS if peers is None else peers
    return any(len(ranks) > peers for ranks in stage_members(roles).values())
