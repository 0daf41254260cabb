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
A job's input that grows window by window (online detection, detect.incremental) has each
window's part made once (`window_part`) and the parts joined at each analysis
(`windows_statistics`), with the same numbers.

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
from megatron.scan.detect.task_evidence import finish_statistics, merge_statistics, ratios as task_ratios
from megatron.scan.detect.typical import group_median
from megatron.scan.speed import log_ratio_to_peers

_MAD = 1.4826
# A task counts as slow past Z_INSTANCE pair-noise widths (or 2%) above its reference.
Z_INSTANCE = 2.0
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
    layer_ranks = np.concatenate([r["layer_ranks"] for r in reports]) if reports else np.zeros(0, np.int64)
    t = _reference_rows(data)
    stages = plan_stages(data.roles, ranks, layer_ranks)
    for stage, entry in stages.items():
        shared = None
        for report in reports:
            if stage in report["shared"]:
                keys = report["shared"][stage]
                shared = keys if shared is None else np.intersect1d(shared, keys, assume_unique=True)
        entry["shared"] = shared if shared is not None else np.zeros(0, np.int64)
        if len(entry["reference"]) < len(entry["members"]):  # a sample: the nodes compare with its medians
            _sample_medians(entry, t, data)
    return {"stages": stages, **_slow_bar(task_noise(t), z_instance)}


def plan_stages(roles: dict, ranks: np.ndarray, layer_ranks: np.ndarray) -> dict[tuple, dict]:
    """Per stage (sorted) with compute rows: its members (`ranks`: those with compute rows),
    whether its typical call is a layer's (every member has layer rows: `layer_ranks`), its
    reference ranks."""
    reference = reference_ranks(roles)
    layer_ranks = set(np.asarray(layer_ranks).tolist())
    stages: dict[tuple, dict] = {}
    for stage, members in sorted(stage_members(roles).items()):
        members = members[np.isin(members, ranks)]  # those with compute rows
        if len(members):
            stages[stage] = {"members": members, "layers": bool(layer_ranks) and all(int(r) in layer_ranks for r in members),
                             "reference": members[np.isin(members, reference)]}
    return stages


def _reference_rows(data: DetectionInput) -> dict[str, np.ndarray]:
    return table_rows(data.compute, np.isin(data.compute["rank"], reference_ranks(data.roles)))


def _sample_medians(entry: dict, t: dict[str, np.ndarray], data: DetectionInput) -> None:
    """The reference's median log busy per task (from its compute rows in `t`) and per call."""
    rows = np.isin(t["rank"], entry["reference"])
    entry["task_median"] = group_median(np.log(np.maximum(t["busy"][rows], 1).astype(np.float64)),
                                        task_keys(table_rows(t, rows)))
    entry["call_median"] = _call_medians(data, entry)


def _slow_bar(noise: float, z_instance: float) -> dict:
    return {"noise": noise, "slow_bar": max(z_instance * noise * np.sqrt(2.0), np.log(1.02))}


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
    return finish_statistics([_rank_part(part, plan)], plan["slow_bar"], busy=_busy_table(part.compute))


def _rank_part(part: DetectionInput, plan: dict) -> dict:
    """rank_statistics before the slow bar and the medians over every iteration: the series
    (each row one rank and iteration) and, per sampled stage, the task ratios (task_evidence.ratios)."""
    out = {"series": [_total_series(part, plan)], "groups": {}}
    sampled = [(stage, entry) for stage, entry in plan["stages"].items() if "task_median" in entry]
    t, layers = part.compute, part.layers
    top = max([int(t["rank"].max()) if len(t["rank"]) else 0, int(layers["rank"].max()) if len(layers["rank"]) else 0])
    which = np.full(top + 1, -1, dtype=np.int64)  # rank -> the sampled stage it is compared in here
    for i, (_, entry) in enumerate(sampled):
        compared = entry["members"][~np.isin(entry["members"], entry["reference"])]
        which[compared[compared <= top]] = i
    task_stage, layer_stage = which[t["rank"].astype(np.int64)], which[layers["rank"].astype(np.int64)]
    for i, (stage, entry) in enumerate(sampled):
        rows = task_stage == i
        if rows.any():
            series, ratios = _against_medians(part, entry, rows, layer_stage == i if entry["layers"] else rows)
            out["series"].append(series)
            out["groups"][(0, stage)] = ratios
    return out


def _total_series(part: DetectionInput, plan: dict) -> dict[str, np.ndarray] | None:
    """Per (rank, iteration): log busy total over its stage's shared tasks and over all its tasks."""
    t = part.compute
    rank, busy = t["rank"].astype(np.int64), t["busy"]
    if not len(rank):
        return None
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
    return {"rank": cells[:, 0], "iteration": cells[:, 1], "tasks": np.bincount(inverse, minlength=len(cells)),
            "total": total, "all_total": all_total, "typical": np.full(len(cells), np.nan)}


def _busy_table(t: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Per rank of the compute table `t`: median forward and backward busy (what-if replay and
    the report's heatmap), over every iteration."""
    rank, busy = t["rank"].astype(np.int64), t["busy"]
    if not len(rank):
        return None
    ranks = np.unique(rank)
    backward = t["kind"].astype(np.int64) > 0
    medians = np.full((2, len(ranks)), np.nan)
    for k, rows in enumerate((~backward, backward)):  # a direction's rows come in rank order (runs)
        groups, values = group_median(busy[rows].astype(np.float64), np.searchsorted(ranks, rank[rows]))
        medians[k, groups] = values
    return {"rank": ranks, "instances": np.zeros(len(ranks), np.int64), "slow": np.zeros(len(ranks), np.int64),
            "task_median": np.full(len(ranks), np.nan), "forward_busy": medians[0], "backward_busy": medians[1]}


def _against_medians(part: DetectionInput, entry: dict, rows: np.ndarray, cell_rows: np.ndarray) -> tuple[dict, dict]:
    """The ranks of the task `rows` (not reference ranks) against the reference's median per task
    and per call (`cell_rows`: their rows of the table the calls come from): (typical series, task ratios)."""
    t = part.compute
    sub = table_rows(t, rows)
    ranks = np.unique(sub["rank"]).astype(np.int64)
    ratio = np.log(np.maximum(sub["busy"], 1).astype(np.float64)) - _lookup(entry["task_median"], task_keys(sub))
    rank, key, value = _cells(part, ranks, entry["layers"], cell_rows)
    typical = value - _lookup(entry["call_median"], key)
    cell, per_iteration = group_median(typical, np.searchsorted(ranks, rank) * (1 << 31) + (key >> 32))
    return _typical_series(ranks, cell, per_iteration), task_ratios(sub, ratio, ranks)


def _typical_series(ranks: np.ndarray, cell: np.ndarray, per_iteration: np.ndarray) -> dict[str, np.ndarray]:
    """Series rows of typical-call ratios from group_median's (rank index << 31 | iteration) ids."""
    nothing = np.full(len(cell), np.nan)
    return {"rank": ranks[cell >> 31], "iteration": cell & ((1 << 31) - 1), "tasks": np.zeros(len(cell), np.int64),
            "total": nothing, "all_total": nothing, "typical": per_iteration}


def reference_statistics(data: DetectionInput, plan: dict) -> dict[str, dict[str, np.ndarray]]:
    """On rank 0: each stage's reference ranks against each other (the median of the others at
    each task and call), from their rows in `data`."""
    return finish_statistics([_reference_part(data, plan)], plan["slow_bar"])


def _reference_part(data: DetectionInput, plan: dict) -> dict:
    """reference_statistics before the slow bar and the medians over every iteration (as _rank_part)."""
    t = data.compute
    out = {"series": [], "groups": {}}
    for stage, entry in plan["stages"].items():
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
        rank, key, value = _cells(data, ranks, entry["layers"])
        cells, cell_of = np.unique(key, return_inverse=True)
        grid = np.full((len(cells), len(ranks)), np.nan)  # [iteration and call, rank] median log busy
        grid[cell_of, np.searchsorted(ranks, rank)] = value
        typical = log_ratio_to_peers(grid)[cell_of, np.searchsorted(ranks, rank)]
        cell, per_iteration = group_median(typical, np.searchsorted(ranks, rank) * (1 << 31) + (key >> 32))
        out["series"].append(_typical_series(ranks, cell, per_iteration))
        out["groups"][(1, stage)] = task_ratios(sub, ratios[inverse, col], ranks)
    return out


def compute_statistics(data: DetectionInput, *, z_instance: float) -> tuple[dict, dict]:
    """Both rounds over a whole job's input in one process: (plan, statistics)."""
    plan = compute_plan([node_report(data)], data, z_instance=z_instance)
    stats = merge_statistics([rank_statistics(data, plan), reference_statistics(data, plan)])
    return plan, stats


def window_part(part: DetectionInput, stages: dict[tuple, dict]) -> dict:
    """What some windows of a growing job's input (`part`: their tables) add to its statistics,
    for `stages` (plan_stages of the whole job so far): per stage the tasks every member ran, and
    the series and task ratios of _rank_part and _reference_part against a plan of these windows
    alone. A task and a call name their iteration, which lies in one window, so their reference
    medians are these windows' own; what spans windows (the task noise, the slow bar, medians
    over every iteration) is left to `windows_statistics`."""
    t = part.compute
    shared: dict[tuple, np.ndarray] = {}
    if len(t["rank"]):
        stages_here, stage_of = _stage_ids(part)
        rank = t["rank"].astype(np.int64)
        pairs = unique_rows(np.stack([stage_of[rank], task_keys(t), rank], axis=1))[0]
        for s in np.unique(pairs[:, 0]).tolist():
            if s >= 0 and stages_here[s] in stages:
                keys, counts = np.unique(pairs[pairs[:, 0] == s, 1], return_counts=True)
                shared[stages_here[s]] = keys[counts == len(stages[stages_here[s]]["members"])]
    # The whole job's reference ranks (a part of windows some ranks lack has fewer roles)
    references = np.concatenate([np.zeros(0, np.int64)] + [entry["reference"] for entry in stages.values()])
    reference = table_rows(t, np.isin(t["rank"], references))
    plan = {"stages": {}, "slow_bar": np.nan}
    for stage, entry in stages.items():
        entry = plan["stages"][stage] = {**entry, "shared": shared.get(stage, np.zeros(0, np.int64))}
        if len(entry["reference"]) < len(entry["members"]):
            _sample_medians(entry, reference, part)
    own, others = _rank_part(part, plan), _reference_part(part, plan)
    return {"shared": shared, "series": own["series"] + others["series"], "groups": {**own["groups"], **others["groups"]}}


def windows_statistics(parts: list[dict], data: DetectionInput, stages: dict[tuple, dict], *,
                       z_instance: float) -> tuple[dict, dict]:
    """compute_statistics(data) from its windows' window_part (made for the same `stages`):
    (plan without the reference medians, which only the parts use; statistics)."""
    joined_stages = {stage: {**entry, "shared": np.sort(np.concatenate(
        [np.zeros(0, np.int64)] + [p["shared"][stage] for p in parts if stage in p["shared"]]))}
        for stage, entry in stages.items()}
    plan = {"stages": joined_stages, **_slow_bar(task_noise(_reference_rows(data)), z_instance)}
    return plan, finish_statistics(parts, plan["slow_bar"], busy=_busy_table(data.compute))


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
