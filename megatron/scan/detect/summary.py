"""Detection that scales out on the job itself: each node's first rank summarizes its ranks'
tables into the statistics the analyzers need, and rank 0 combines the nodes' summaries into one
DetectionInput, so that rank 0 never reads every rank's events.

What a node summary holds:
* compute, layer, P2P (messages its ranks received), iteration and host rows of its ranks: one
  row per task, layer call, message or iteration, already reduced from the trace's spans;
* the collective instances whose members are all on the node (TP groups of up to 8 ranks live
  on one node; they are most of a job's collectives), resolved there: who arrived last and by how
  much, summed per (rank, iteration) (collective.resolve_arrivals);
* the raw rows of the instances that span nodes (DP and model-parallel groups: a few per rank and
  iteration), which rank 0 resolves once every member's node has sent its rows.

combine() then gives the analyzers the same numbers as the full tables: detection on the
combined input names the same suspects (tests/scan/test_detect_summary.py checks it on synthetic
jobs and across processes; benchmarks/detection_scale.py at 256 and 1,024 ranks).
`summarize_on_job` runs it over torch.distributed: a gather within each node, then one among the
nodes' first ranks."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from megatron.scan.detect.collective import LATE_COLUMNS, merge_stats, one_stage_rows, resolve_arrivals
from megatron.scan.detect.model import DetectionInput

_PER_RANK = ("compute", "iteration_time", "layers", "host")


def _rows(table: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    return {name: column[keep] for name, column in table.items()}


def restrict(data: DetectionInput, ranks) -> DetectionInput:
    """The part of `data` a set of ranks would have recorded: their rows of every table (P2P
    messages by receiver; collective rows of their own participations)."""
    ranks = np.asarray(sorted(int(r) for r in ranks), dtype=np.int64)
    part = {name: _rows(getattr(data, name), np.isin(getattr(data, name)["rank"], ranks)) for name in _PER_RANK}
    return replace(data, **part, p2p=_rows(data.p2p, np.isin(data.p2p["dst"], ranks)),
                   collectives=_rows(data.collectives, np.isin(data.collectives["rank"], ranks)),
                   roles={r: data.roles[r] for r in ranks.tolist() if r in data.roles},
                   gpu={r: g for r, g in data.gpu.items() if r in set(ranks.tolist())}, arrivals=None)


def split_by_node(data: DetectionInput, ranks_per_node: int) -> list[DetectionInput]:
    """restrict() for every node of consecutive `ranks_per_node` ranks, with one sort per table
    (what each node's ranks would have recorded; for simulating the per-node path in one process)."""
    world = max(data.roles) + 1 if data.roles else 0
    firsts = np.arange(0, world + ranks_per_node, ranks_per_node)
    nodes = len(firsts) - 1

    def pieces(table: dict[str, np.ndarray], column: str) -> list[dict[str, np.ndarray]]:
        order = np.argsort(table[column], kind="stable")
        bounds = np.searchsorted(table[column][order], firsts)
        return [{name: values[order[bounds[i]:bounds[i + 1]]] for name, values in table.items()}
                for i in range(nodes)]

    tables = {name: pieces(getattr(data, name), "rank") for name in (*_PER_RANK, "collectives")}
    p2p = pieces(data.p2p, "dst")
    parts = []
    for i in range(nodes):
        ranks = range(int(firsts[i]), int(firsts[i + 1]))
        parts.append(replace(data, **{name: tables[name][i] for name in tables}, p2p=p2p[i],
                             roles={r: data.roles[r] for r in ranks if r in data.roles},
                             gpu={r: data.gpu[r] for r in ranks if r in data.gpu}, arrivals=None))
    return parts


def merge(parts: list[DetectionInput]) -> DetectionInput:
    """Disjoint parts (by rank) of one job's input, as one (their collective rows concatenated)."""
    first = parts[0]

    def cat(name: str) -> dict[str, np.ndarray]:
        return {column: np.concatenate([getattr(p, name)[column] for p in parts])
                for column in getattr(first, name)}

    roles = {r: role for p in parts for r, role in p.roles.items()}
    gpu = {r: g for p in parts for r, g in p.gpu.items()}
    return replace(first, roles=roles, gpu=gpu, arrivals=None, p2p=cat("p2p"), collectives=cat("collectives"),
                   **{name: cat(name) for name in _PER_RANK})


def node_summary(part: DetectionInput) -> dict[str, Any]:
    """A node's summary of its ranks' input `part` (see restrict/merge): an instance resolved
    here has every member on the node, so the node's roles tell whether it lies in one stage."""
    c = part.collectives
    if len(c["instance"]):
        _, inverse, counts = np.unique(c["instance"], return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        size = np.zeros(len(counts), dtype=np.int64)
        size[inverse] = c["group_size"]
        local = (counts == size)[inverse]  # every member of the instance is on this node
    else:
        local = np.zeros(0, dtype=bool)
    stats, late, instances = resolve_arrivals(c, local & one_stage_rows(part, c))
    return {"part": replace(part, collectives=_rows(c, ~local), arrivals=None),
            "arrivals": {"stats": stats, "late": late, "instances": instances}}


def combine(summaries: list[dict[str, Any]]) -> DetectionInput:
    """Rank 0's DetectionInput from every node's summary: the analyzers read it as the full one."""
    data = merge([s["part"] for s in summaries])
    arrivals = [s["arrivals"] for s in summaries]
    return replace(data, arrivals={
        "stats": merge_stats([a["stats"] for a in arrivals]),
        "late": {c: np.concatenate([a["late"][c] for a in arrivals]) for c in LATE_COLUMNS},
        "instances": sum(int(a["instances"]) for a in arrivals)})


def summary_bytes(summary: dict[str, Any]) -> int:
    """The array bytes a node summary carries (what its first rank sends to rank 0)."""
    part = summary["part"]
    tables = [getattr(part, name) for name in (*_PER_RANK, "p2p", "collectives")]
    tables += [summary["arrivals"]["stats"], summary["arrivals"]["late"]]
    return int(sum(column.nbytes for table in tables for column in table.values()))


def summarize_on_job(local: DetectionInput, ranks_per_node: int, *, groups: tuple | None = None) -> DetectionInput | None:
    """Over the job's torch.distributed (every rank calls it, with its own tables `local`): each
    node's first rank gathers its ranks' tables and summarizes them, rank 0 gathers the summaries
    and returns the combined input (None on other ranks). Nodes are `ranks_per_node` consecutive
    ranks (torchrun's order). `groups`: (this rank's node group, the nodes' first ranks' group)
    from node_groups(), made once per job (every rank must create every group)."""
    import torch.distributed as dist

    node_group, leaders = groups if groups is not None else node_groups(ranks_per_node)
    rank = dist.get_rank()
    leader = rank % ranks_per_node == 0
    parts: list | None = [None] * dist.get_world_size(node_group) if leader else None
    dist.gather_object(local, parts, group=node_group, group_dst=0)
    summary = node_summary(merge(parts)) if leader else None
    if not leader:
        return None
    gathered: list | None = [None] * dist.get_world_size(leaders) if rank == 0 else None
    dist.gather_object(summary, gathered, group=leaders, group_dst=0)
    return combine(gathered) if rank == 0 else None


def node_groups(ranks_per_node: int) -> tuple:
    """(this rank's node group, the group of every node's first rank); collective over the job."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world % ranks_per_node:
        raise ValueError(f"ranks_per_node {ranks_per_node} does not divide the world size {world}")
    mine = None
    for first in range(0, world, ranks_per_node):
        group = dist.new_group(list(range(first, first + ranks_per_node)))
        if first <= dist.get_rank() < first + ranks_per_node:
            mine = group
    leaders = dist.new_group(list(range(0, world, ranks_per_node)))
    return mine, leaders
