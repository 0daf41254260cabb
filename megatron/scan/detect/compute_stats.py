"""The compute comparison reduced to a few numbers per rank and iteration, made where the rows are.

compute.peer_comparison judges each rank by (1) its busy total per iteration against its stage
peers' totals, (2) its typical call against its peers' calls and (3) its tasks one by one (the
evidence: how many were slow, which were slowest). (1) needs only each rank's own totals; (2) and
(3) need, per task or call, the peers' median, which every rank of a stage shares. So:

* round 1, every node (`node_report`): per stage, the task keys all its ranks there ran, and
  which ranks have compute and layer rows;
* rank 0 (`compute_plan`), from the reports and the reference ranks' rows
  (megatron.scan.detect.reference): the stages, the task keys every member ran, and in a stage
  larger than its reference, the reference's median per task and per call; the task noise;
* round 2, every node (`rank_statistics`): its ranks' totals, typical-call series and task
  evidence against the plan's medians;
* rank 0 (`reference_statistics`): the reference ranks' own, each against the other reference
  ranks (leave-one-out, as every rank of a small stage always was).

A stage of up to REFERENCE_PEERS ranks is all reference: rank 0 holds its rows and compares them
as before. `compute_statistics` runs both rounds in one process over a whole job's input (the
full analysis), with the same functions, so the full and per-node analyses name the same ranks.

The statistics (`merge_statistics` of the parts) are tables of numpy columns:
* series: one row per (rank, iteration): log busy total over the stage's shared tasks (nan in an
  iteration not every peer ran), log busy total over all its tasks, log typical-call ratio (nan:
  none);
* ranks: one row per rank: task instances compared, how many were past the slow bar, the median
  task log ratio, median forward and backward busy ns (what-if replay and the report's heatmap);
* worst: each rank's WORST_TASKS slowest task instances (iteration, kind, chunk, microbatch,
  log ratio)."""
from __future__ import annotations

import numpy as np

from megatron.scan.detect.model import DetectionInput, table_rows, unique_rows
from megatron.scan.detect.reference import reference_ranks, stage_members
from megatron.scan.detect.typical import group_median
from megatron.scan.speed import log_ratio_to_peers

_MAD = 1.4826
# A task counts as slow past Z_INSTANCE pair-noise widths (or 2%) above its reference.
Z_INSTANCE = 2.0
WORST_TASKS = 5
SERIES_COLUMNS = ("rank", "iteration", "tasks", "total", "all_total", "typical")
RANK_COLUMNS = ("rank", "instances", "slow", "task_median", "forward_busy", "backward_busy")
WORST_COLUMNS = ("rank", "iteration", "kind", "chunk", "microbatch", "ratio")
# Packed task key: iteration << 32 | kind << 31 | chunk << 20 | microbatch (a layer call's:
# iteration << 32 | kind << 31 | layer).
_CHUNKS, _MICROBATCHES = 1 << 11, 1 << 20


def task_keys(t: dict[str, np.ndarray]) -> np.ndarray:
    """One int64 per task instance of a compute table, equal across ranks for the same task."""
    chunk, microbatch = t["chunk"].astype(np.int64), t["microbatch"].astype(np.int64)
    if len(chunk) and (chunk.max() >= _CHUNKS or microbatch.max() >= _MICROBATCHES or min(chunk.min(), microbatch.min()) < 0):
        raise ValueError(f"task numbers out of range: chunks 0-{_CHUNKS - 1}, microbatches 0-{_MICROBATCHES - 1}")
    return (t["iteration"].astype(np.int64) << 32) | (t["kind"].astype(np.int64) << 31) | (chunk << 20) | microbatch


def _layer_keys(t: dict[str, np.ndarray]) -> np.ndarray:
    return ((t["iteration"].astype(np.int64) << 32) | (t["kind"].astype(np.int64) << 31)
            | t["layer"].astype(np.int64))


def _stage_ids(data: DetectionInput) -> tuple[list[tuple], np.ndarray]:
    """(stages in sorted order, stage index per rank number; -1: no role)."""
    stages = sorted({role.stage for role in data.roles.values()})
    top = max(max(data.roles, default=0), int(data.compute["rank"].max()) if len(data.compute["rank"]) else 0)
    stage_of = np.full(top + 1, -1, dtype=np.int64)
    for rank, role in data.roles.items():
        stage_of[rank] = stages.index(role.stage)
    return stages, stage_of


def node_report(part: DetectionInput) -> dict:
    """Round 1 on a node (or over a whole job): per stage, the task keys every one of its ranks
    in `part` ran; the ranks with compute rows and those with layer rows."""
    t = part.compute
    stages, stage_of = _stage_ids(part)
    rank = t["rank"].astype(np.int64)
    pairs = unique_rows(np.stack([stage_of[rank], task_keys(t), rank], axis=1))[0] if len(rank) else np.zeros((0, 3), np.int64)
    members = unique_rows(pairs[:, [0, 2]])[0] if len(pairs) else np.zeros((0, 2), np.int64)
    shared = {}
    for s in np.unique(pairs[:, 0]):
        keys, counts = np.unique(pairs[pairs[:, 0] == s, 1], return_counts=True)
        shared[stages[int(s)]] = keys[counts == int(np.sum(members[:, 0] == s))]
    return {"ranks": np.unique(rank), "layer_ranks": np.unique(part.layers["rank"]).astype(np.int64),
            "shared": shared}


def compute_plan(reports: list[dict], data: DetectionInput, *, z_instance: float) -> dict:
    """Rank 0's plan from the nodes' reports and `data` (the job's roles and at least the
    reference ranks' compute and layer rows): per stage its members, shared task keys, whether its
    typical call is a layer's, its reference ranks and, where they are a sample, their median log
    busy per task and per call; the task noise and the bar past which a task counts as slow."""
    ranks = np.unique(np.concatenate([r["ranks"] for r in reports])) if reports else np.zeros(0, np.int64)
    layer_ranks = set(np.concatenate([r["layer_ranks"] for r in reports]).tolist()) if reports else set()
    reference = reference_ranks(data.roles)
    own = np.isin(data.compute["rank"], reference)
    t = table_rows(data.compute, own)
    stages: dict[tuple, dict] = {}
    for stage, members in sorted(stage_members(data.roles).items()):
        members = members[np.isin(members, ranks)]  # those with compute rows
        if not len(members):
            continue
        shared = None
        for report in reports:
            if stage in report["shared"]:
                keys = report["shared"][stage]
                shared = keys if shared is None else np.intersect1d(shared, keys, assume_unique=True)
        entry = {"members": members, "shared": shared if shared is not None else np.zeros(0, np.int64),
                 "layers": bool(layer_ranks) and all(int(r) in layer_ranks for r in members),
                 "reference": members[np.isin(members, reference)]}
        if len(entry["reference"]) < len(members):  # a sample: the nodes compare with its medians
            rows = np.isin(t["rank"], entry["reference"])
            entry["task_median"] = group_median(np.log(np.maximum(t["busy"][rows], 1).astype(np.float64)),
                                                task_keys(table_rows(t, rows)))
            entry["call_median"] = _call_medians(data, entry)
        stages[stage] = entry
    noise = task_noise(t)
    return {"stages": stages, "noise": noise, "slow_bar": max(z_instance * noise * np.sqrt(2.0), np.log(1.02))}


def task_noise(t: dict[str, np.ndarray]) -> float:
    """Spread of a task instance around its own rank's median of the same (kind, chunk): a
    constant slowdown of a rank shifts its median, not this spread, so the slow rank cannot
    inflate it (over the reference ranks' tasks)."""
    log_busy = np.log(np.maximum(t["busy"], 1).astype(np.float64))
    if len(log_busy) < 3:
        return 0.1
    _, inverse = unique_rows(np.stack([t["rank"], t["kind"], t["chunk"]], axis=1))
    groups, medians = group_median(log_busy, inverse)  # every group has rows: groups == arange
    residual = log_busy - medians[np.searchsorted(groups, inverse)]
    return max(_MAD * float(np.median(np.abs(residual))), 0.01)


def _cells(data: DetectionInput, ranks: np.ndarray, layers: bool, rows: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, cell key, median log busy) of each rank's calls of one kind per iteration: layer
    calls (per layer and direction) or forward/backward tasks (per chunk and microbatch). `rows`:
    the table's rows of `ranks`, where known."""
    t = data.layers if layers else data.compute
    rows = np.isin(t["rank"], ranks) if rows is None else rows
    if not rows.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    part = table_rows(t, rows)
    key = _layer_keys(part) if layers else task_keys(part)
    pairs, inverse = unique_rows(np.stack([part["rank"].astype(np.int64), key], axis=1))
    groups, medians = group_median(np.log(np.maximum(part["busy"], 1).astype(np.float64)), inverse)
    return pairs[groups, 0], pairs[groups, 1], medians


def _call_medians(data: DetectionInput, entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """(cell keys, median over the stage's reference ranks of their cells)."""
    _, key, value = _cells(data, entry["reference"], entry["layers"])
    return group_median(value, key)


def _lookup(table: tuple[np.ndarray, np.ndarray], keys: np.ndarray) -> np.ndarray:
    """The table's value per key (nan where the key is not in it)."""
    known, values = table
    at = np.clip(np.searchsorted(known, keys), 0, max(len(known) - 1, 0))
    found = (known[at] == keys) if len(known) else np.zeros(len(keys), dtype=bool)
    return np.where(found, values[at] if len(known) else np.nan, np.nan)


def rank_statistics(part: DetectionInput, plan: dict) -> dict[str, dict[str, np.ndarray]]:
    """Round 2 on a node (or over a whole job): the statistics of `part`'s ranks. Ranks of a
    sampled stage that are not reference ranks are compared here with the plan's medians; for
    the others only their totals and busy medians (rank 0 compares them: reference_statistics)."""
    out = [_totals(part, plan)]
    sampled = [entry for entry in plan["stages"].values() if "task_median" in entry]
    t, layers = part.compute, part.layers
    top = max([int(t["rank"].max()) if len(t["rank"]) else 0, int(layers["rank"].max()) if len(layers["rank"]) else 0])
    which = np.full(top + 1, -1, dtype=np.int64)  # rank -> the sampled stage it is compared in here
    for i, entry in enumerate(sampled):
        compared = entry["members"][~np.isin(entry["members"], entry["reference"])]
        which[compared[compared <= top]] = i
    task_stage, layer_stage = which[t["rank"].astype(np.int64)], which[layers["rank"].astype(np.int64)]
    for i, entry in enumerate(sampled):
        rows = task_stage == i
        if rows.any():
            out.append(_against_medians(part, entry, rows, layer_stage == i if entry["layers"] else rows,
                                        plan["slow_bar"]))
    return merge_statistics(out)


def _totals(part: DetectionInput, plan: dict) -> dict[str, dict[str, np.ndarray]]:
    """Per (rank, iteration): log busy total over its stage's shared tasks and over all its tasks;
    per rank: median forward and backward busy."""
    t = part.compute
    rank, busy = t["rank"].astype(np.int64), t["busy"]
    if not len(rank):
        return merge_statistics([])
    key = task_keys(t)
    stages, stage_of = _stage_ids(part)
    shared = np.zeros(len(rank), dtype=bool)
    for s, stage in enumerate(stages):
        entry = plan["stages"].get(stage)
        if entry is not None:
            rows = stage_of[rank] == s
            shared[rows] = np.isin(key[rows], entry["shared"])
    cells, inverse = unique_rows(np.stack([rank, t["iteration"].astype(np.int64)], axis=1))
    all_total = np.log(np.maximum(np.bincount(inverse, weights=busy.astype(np.float64), minlength=len(cells)), 1.0))
    log_busy = np.log(np.maximum(busy, 1).astype(np.float64))
    summed = np.bincount(inverse[shared], weights=np.exp(log_busy[shared]), minlength=len(cells))
    counted = np.bincount(inverse[shared], minlength=len(cells))
    total = np.where(counted > 0, np.log(np.where(counted > 0, summed, 1.0)), np.nan)
    series = {"rank": cells[:, 0], "iteration": cells[:, 1], "tasks": np.bincount(inverse, minlength=len(cells)),
              "total": total, "all_total": all_total,
              "typical": np.full(len(cells), np.nan)}
    ranks = np.unique(rank)
    kind = t["kind"].astype(np.int64)
    medians = np.full(len(ranks) * 2, np.nan)
    groups, values = group_median(busy.astype(np.float64), np.searchsorted(ranks, rank) * 2 + np.clip(kind, 0, 1))
    medians[groups] = values
    table = {"rank": ranks, "instances": np.zeros(len(ranks), np.int64), "slow": np.zeros(len(ranks), np.int64),
             "task_median": np.full(len(ranks), np.nan), "forward_busy": medians[0::2], "backward_busy": medians[1::2]}
    return {"series": series, "ranks": table, "worst": _empty(WORST_COLUMNS)}


def _against_medians(part: DetectionInput, entry: dict, rows: np.ndarray, cell_rows: np.ndarray,
                     slow_bar: float) -> dict:
    """The ranks of the task `rows` (not reference ranks) against the reference's median per task
    and per call (`cell_rows`: their rows of the table the calls come from)."""
    t = part.compute
    sub = table_rows(t, rows)
    ranks = np.unique(sub["rank"]).astype(np.int64)
    ratio = np.log(np.maximum(sub["busy"], 1).astype(np.float64)) - _lookup(entry["task_median"], task_keys(sub))
    evidence = _evidence(sub, ratio, ranks, slow_bar)
    rank, key, value = _cells(part, ranks, entry["layers"], cell_rows)
    typical = value - _lookup(entry["call_median"], key)
    cell, per_iteration = group_median(typical, np.searchsorted(ranks, rank) * (1 << 31) + (key >> 32))
    return {"series": _typical_series(ranks, cell, per_iteration), "ranks": evidence["ranks"], "worst": evidence["worst"]}


def _typical_series(ranks: np.ndarray, cell: np.ndarray, per_iteration: np.ndarray) -> dict[str, np.ndarray]:
    """Series rows of typical-call ratios from group_median's (rank index << 31 | iteration) ids."""
    nothing = np.full(len(cell), np.nan)
    return {"rank": ranks[cell >> 31], "iteration": cell & ((1 << 31) - 1), "tasks": np.zeros(len(cell), np.int64),
            "total": nothing, "all_total": nothing, "typical": per_iteration}


def _evidence(t: dict[str, np.ndarray], ratio: np.ndarray, ranks: np.ndarray, slow_bar: float) -> dict:
    """Per rank: task instances compared (ratio not nan), those past `slow_bar`, the median
    ratio; and its WORST_TASKS highest ratios with their tasks."""
    valid = ~np.isnan(ratio)
    col = np.searchsorted(ranks, t["rank"][valid])
    r = ratio[valid]
    instances = np.bincount(col, minlength=len(ranks))
    slow = np.bincount(col[r > slow_bar], minlength=len(ranks))
    median = np.full(len(ranks), np.nan)
    groups, values = group_median(r, col)
    median[groups] = values
    order = np.lexsort((-r, col))  # by rank, slowest first
    first = np.searchsorted(col[order], np.arange(len(ranks)))
    position = np.arange(len(order)) - first[col[order]]
    top = order[position < WORST_TASKS]
    worst = {"rank": ranks[col[top]], **{c: t[c][valid][top].astype(np.int64) for c in ("iteration", "kind", "chunk", "microbatch")},
             "ratio": r[top]}
    table = {"rank": ranks, "instances": instances, "slow": slow, "task_median": median,
             "forward_busy": np.full(len(ranks), np.nan), "backward_busy": np.full(len(ranks), np.nan)}
    return {"ranks": table, "worst": worst}


def reference_statistics(data: DetectionInput, plan: dict) -> dict[str, dict[str, np.ndarray]]:
    """On rank 0: each stage's reference ranks against each other (the median of the others at
    each task and call), from their rows in `data`."""
    t = data.compute
    out = []
    for entry in plan["stages"].values():
        ranks = entry["reference"]
        if len(entry["members"]) < 2:
            continue  # no peer: judged against its own history (compute.peer_comparison)
        rows = np.isin(t["rank"], ranks)
        sub = table_rows(t, rows)
        keys, inverse = np.unique(task_keys(sub), return_inverse=True)
        col = np.searchsorted(ranks, sub["rank"])
        matrix = np.full((len(keys), len(ranks)), np.nan)  # [task instance, rank] log busy
        matrix[inverse, col] = np.log(np.maximum(sub["busy"], 1).astype(np.float64))
        ratios = log_ratio_to_peers(matrix)
        evidence = _evidence(sub, ratios[inverse, col], ranks, plan["slow_bar"])
        rank, key, value = _cells(data, ranks, entry["layers"])
        cells, cell_of = np.unique(key, return_inverse=True)
        grid = np.full((len(cells), len(ranks)), np.nan)  # [iteration and call, rank] median log busy
        grid[cell_of, np.searchsorted(ranks, rank)] = value
        typical = log_ratio_to_peers(grid)[cell_of, np.searchsorted(ranks, rank)]
        cell, per_iteration = group_median(typical, np.searchsorted(ranks, rank) * (1 << 31) + (key >> 32))
        out.append({"series": _typical_series(ranks, cell, per_iteration), "ranks": evidence["ranks"], "worst": evidence["worst"]})
    return merge_statistics(out)


def _empty(columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {c: np.zeros(0) for c in columns}


def merge_statistics(parts: list[dict]) -> dict[str, dict[str, np.ndarray]]:
    """One table per kind from several parts' (nodes', rank 0's): rows of one (rank, iteration)
    or rank from different parts combine, each column taking the part's value where it has one
    (a rank's totals come from its node, its comparison from its node or from rank 0)."""
    out = {}
    for name, columns, keys in (("series", SERIES_COLUMNS, ("rank", "iteration")), ("ranks", RANK_COLUMNS, ("rank",)),
                                ("worst", WORST_COLUMNS, None)):
        tables = [p[name] for p in parts if len(p[name]["rank"])]
        cat = {c: np.concatenate([tb[c] for tb in tables]) if tables else np.zeros(0) for c in columns}
        if keys is None or not len(cat["rank"]):
            out[name] = cat
            continue
        index, inverse = unique_rows(np.stack([cat[k].astype(np.int64) for k in keys], axis=1))
        merged = {k: index[:, i] for i, k in enumerate(keys)}
        for c in columns:
            if c in keys:
                continue
            values = np.full(len(index), np.nan)
            given = ~np.isnan(cat[c].astype(np.float64))
            if c in ("instances", "slow", "tasks"):  # counts: 0 where no part compared the rank
                values = np.zeros(len(index), np.int64)
                np.add.at(values, inverse, cat[c].astype(np.int64))
            else:
                values[inverse[given]] = cat[c][given]
            merged[c] = values
        out[name] = merged
    return out


def compute_statistics(data: DetectionInput, *, z_instance: float) -> tuple[dict, dict]:
    """Both rounds over a whole job's input in one process: (plan, statistics)."""
    plan = compute_plan([node_report(data)], data, z_instance=z_instance)
    stats = merge_statistics([rank_statistics(data, plan), reference_statistics(data, plan)])
    return plan, stats


def busy_medians(data: DetectionInput) -> dict[tuple[int, int], float]:
    """(rank, kind: 0 forward, 1 backward) -> median busy ns of one task: from the nodes'
    statistics where they made them, else from the rows."""
    if data.compute_stats is not None:
        table = data.compute_stats["statistics"]["ranks"]
        out = {}
        for kind, column in ((0, "forward_busy"), (1, "backward_busy")):
            known = ~np.isnan(table[column])
            out.update(zip(((int(r), kind) for r in table["rank"][known]), table[column][known].tolist()))
        return out
    t = data.compute
    keep = np.isin(t["kind"], (0, 1))
    pairs, inverse = unique_rows(np.stack([t["rank"][keep], t["kind"][keep]], axis=1).astype(np.int64))
    groups, medians = group_median(t["busy"][keep].astype(np.float64), inverse)
    return {(int(pairs[g, 0]), int(pairs[g, 1])): float(m) for g, m in zip(groups, medians)}
