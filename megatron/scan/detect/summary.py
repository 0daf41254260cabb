"""Detection that scales out on the job itself: each node's first rank reduces its ranks' tables
to the statistics the analyzers need, and rank 0 combines the nodes' answers into one
DetectionInput, so that rank 0 reads a few numbers per rank and iteration (plus the rows of the
reference ranks, a fixed number per stage: megatron.scan.detect.reference) instead of every
rank's events.

Three rounds, each a gather among the nodes' first ranks after a broadcast from rank 0:
1. `node_report`: its ranks' roles, iteration and host rows (one per rank and iteration); the
   collective instances whose members are all on the node (TP groups of up to 8 ranks live on one
   node; they are most of a job's collectives), resolved there (who arrived last and by how much,
   summed per rank and iteration: collective.resolve_arrivals), and the raw rows of the instances
   that span nodes (a few per rank and iteration); per stage, the task keys its ranks all ran;
   the P2P message classes it received.
2. rank 0 picks the reference ranks (`reference_of`); `reference_rows`: each node sends their
   task, layer and received-message rows.
3. rank 0 makes the plan (`make_plan`: the stages, the reference's medians per task and call, the
   task noise, the pooled P2P deliveries); `node_statistics`: each node compares its ranks with it
   (compute_stats.rank_statistics, p2p.reduce_links) and sends the results.
`combine` gives rank 0's analyzers an input they read as the full one: detection on it names the
same suspects as on every rank's rows (tests/scan/test_detect_scale.py on synthetic jobs and
across processes; benchmarks/detection_scale.py at 256 and 1,024 ranks). `summarize_on_job` runs
the rounds over torch.distributed: a gather within each node, then the rounds among the nodes'
first ranks. `summarize_in_process` runs them in one process over a job's nodes (the benchmark).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from megatron.scan.detect import compute_stats
from megatron.scan.detect.collective import merge_resolved, one_stage_rows, resolve_arrivals
from megatron.scan.detect.model import DetectionInput, table_rows
from megatron.scan.detect.p2p import MANY_LINKS, link_classes, link_plan, merge_link_stats, reduce_links
from megatron.scan.detect.reference import reference_ranks, sampled

_PER_RANK = ("compute", "iteration_time", "layers", "host")


def restrict(data: DetectionInput, ranks) -> DetectionInput:
    """The part of `data` a set of ranks would have recorded: their rows of every table (P2P
    messages by receiver; collective rows of their own participations)."""
    ranks = np.asarray(sorted(int(r) for r in ranks), dtype=np.int64)
    part = {name: table_rows(getattr(data, name), np.isin(getattr(data, name)["rank"], ranks)) for name in _PER_RANK}
    return replace(data, **part, p2p=table_rows(data.p2p, np.isin(data.p2p["dst"], ranks)),
                   collectives=table_rows(data.collectives, np.isin(data.collectives["rank"], ranks)),
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


def node_report(part: DetectionInput) -> dict[str, Any]:
    """Round 1 on a node, from its ranks' input `part` (see restrict/merge): an instance resolved
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
    nothing = {name: table_rows(getattr(part, name), np.zeros(len(getattr(part, name)["rank"]), dtype=bool))
               for name in ("compute", "layers")}
    kept = replace(part, collectives=table_rows(c, ~local), arrivals=None, **nothing,
                   p2p=table_rows(part.p2p, np.zeros(len(part.p2p["dst"]), dtype=bool)))
    return {"part": kept, "arrivals": {"stats": stats, "late": late, "instances": instances},
            "compute": compute_stats.node_report(part), "links": link_classes(part.p2p)}


def reference_of(reports: list[dict[str, Any]]) -> np.ndarray:
    """On rank 0: the reference ranks, from every rank's role."""
    return reference_ranks({r: role for report in reports for r, role in report["part"].roles.items()})


def reference_rows(part: DetectionInput, reference: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    """Round 2 on a node: the reference ranks' task and layer rows and the messages they received."""
    return {"compute": table_rows(part.compute, np.isin(part.compute["rank"], reference)),
            "layers": table_rows(part.layers, np.isin(part.layers["rank"], reference)),
            "p2p": table_rows(part.p2p, np.isin(part.p2p["dst"], reference))}


def make_plan(reports: list[dict[str, Any]], rows: list[dict]) -> tuple[DetectionInput, dict]:
    """On rank 0: the job's input as far as rank 0 holds it (every rank's small tables, the
    reference ranks' rows) and the plan the nodes compare their ranks with."""
    data = combine_reports(reports)
    data = replace(data, **{name: {c: np.concatenate([r[name][c] for r in rows]) for c in getattr(data, name)}
                            for name in ("compute", "layers", "p2p")})
    classes = np.unique(np.concatenate([r["links"] for r in reports]), axis=0)
    plan = {"compute": compute_stats.compute_plan([r["compute"] for r in reports], data, z_instance=compute_stats.Z_INSTANCE),
            "links": link_plan(data.p2p, classes)}
    return data, plan


def node_statistics(part: DetectionInput, plan: dict) -> dict[str, Any]:
    """Round 3 on a node: its ranks' compute statistics and the links its ranks received on."""
    return {"compute": compute_stats.rank_statistics(part, plan["compute"]), "links": reduce_links(part.p2p, plan["links"])}


def combine(data: DetectionInput, plan: dict, statistics: list[dict[str, Any]]) -> DetectionInput:
    """On rank 0: the input the analyzers read as the full one (make_plan's `data` with the
    nodes' statistics and the reference ranks' own comparison)."""
    compute = compute_stats.merge_statistics([*(s["compute"] for s in statistics),
                                              compute_stats.reference_statistics(data, plan["compute"])])
    links = merge_link_stats([s["links"] for s in statistics])
    links["spread"] = plan["links"]["spread"]
    # A job of few links and no sampled stage sent rank 0 every message (every rank is a reference
    # rank): its links are compared one with the others' messages there, as in the full analysis.
    few = len(links["links"]["src"]) < MANY_LINKS and not sampled(data.roles)
    return replace(data, compute_stats={"plan": plan["compute"], "statistics": compute},
                   link_stats=None if few else links)


def combine_reports(reports: list[dict[str, Any]]) -> DetectionInput:
    """Every node's round-1 tables as one input, the collectives resolved on the nodes merged."""
    data = merge([s["part"] for s in reports])
    return replace(data, arrivals=merge_resolved([s["arrivals"] for s in reports]))


def summarize_in_process(parts: list[DetectionInput], timer=None) -> tuple[DetectionInput, dict[str, float]]:
    """The three rounds in one process over every node's `parts`: (rank 0's input, what it cost:
    each round's slowest node, rank 0's own work, and the most bytes one node sent)."""
    import pickle
    import time

    cost = {"nodes_s": 0.0, "rank0_s": 0.0, "bytes": 0}
    sent = [0] * len(parts)

    def on_nodes(work, *args):
        out, slowest = [], 0.0
        for i, part in enumerate(parts):
            started = time.perf_counter()
            out.append(work(part, *args))
            slowest = max(slowest, time.perf_counter() - started)
            sent[i] += len(pickle.dumps(out[-1], protocol=pickle.HIGHEST_PROTOCOL))
        cost["nodes_s"] += slowest
        return out

    def on_rank0(work, *args):
        started = time.perf_counter()
        out = work(*args)
        cost["rank0_s"] += time.perf_counter() - started
        return out

    reports = on_nodes(node_report)
    reference = on_rank0(reference_of, reports)
    rows = on_nodes(reference_rows, reference)
    data, plan = on_rank0(make_plan, reports, rows)
    statistics = on_nodes(node_statistics, plan)
    combined = on_rank0(combine, data, plan, statistics)
    cost["bytes"] = max(sent, default=0)
    return combined, cost


def summarize_on_job(local: DetectionInput, ranks_per_node: int, *, groups: tuple | None = None) -> DetectionInput | None:
    """Over the job's torch.distributed (every rank calls it, with its own tables `local`): each
    node's first rank gathers its ranks' tables, then the three rounds run among the nodes'
    first ranks; rank 0 returns the combined input (None on other ranks). Nodes are
    `ranks_per_node` consecutive ranks (torchrun's order). `groups`: (this rank's node group, the
    nodes' first ranks' group) from node_groups(), made once per job (every rank must create
    every group)."""
    import torch.distributed as dist

    node_group, leaders = groups if groups is not None else node_groups(ranks_per_node)
    rank = dist.get_rank()
    parts: list | None = [None] * dist.get_world_size(node_group) if rank % ranks_per_node == 0 else None
    dist.gather_object(local, parts, group=node_group, group_dst=0)
    if rank % ranks_per_node:
        return None
    part = merge(parts)
    nodes = dist.get_world_size(leaders)

    def gather(obj):
        out: list | None = [None] * nodes if rank == 0 else None
        dist.gather_object(obj, out, group=leaders, group_dst=0)
        return out

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, group=leaders, group_src=0)
        return box[0]

    reports = gather(node_report(part))
    reference = broadcast(reference_of(reports) if rank == 0 else None)
    rows = gather(reference_rows(part, reference))
    data, plan = make_plan(reports, rows) if rank == 0 else (None, None)
    plan = broadcast(plan)
    statistics = gather(node_statistics(part, plan))
    return combine(data, plan, statistics) if rank == 0 else None


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
