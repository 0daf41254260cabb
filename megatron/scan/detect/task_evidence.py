"""The compute statistics' tables (compute_stats): their columns, each rank's task evidence from
its task ratios, and the joining of parts made apart (nodes', windows', rank 0's)."""
from __future__ import annotations

import numpy as np

from megatron.scan.detect.typical import group_median
from megatron.scan.keys import unique_rows

WORST_TASKS = 5
SERIES_COLUMNS = ("rank", "iteration", "tasks", "total", "all_total", "typical")
RANK_COLUMNS = ("rank", "instances", "slow", "task_median", "forward_busy", "backward_busy")
WORST_COLUMNS = ("rank", "iteration", "kind", "chunk", "microbatch", "ratio")


def ratios(t: dict[str, np.ndarray], ratio: np.ndarray, ranks: np.ndarray) -> dict:
    """What evidence() needs of the task rows `t` and their log ratios (nan: not compared) of
    `ranks`: each compared task's rank and ratio, and each rank's WORST_TASKS highest with their
    tasks (the same ones whatever the slow bar; a rank's highest over several parts are among
    the parts' highest)."""
    valid = ~np.isnan(ratio)
    rank, r = t["rank"][valid].astype(np.int64), ratio[valid]
    col = np.searchsorted(ranks, rank)
    top = highest(col, r, len(ranks))
    worst = {"rank": ranks[col[top]], **{c: t[c][valid][top].astype(np.int64) for c in ("iteration", "kind", "chunk", "microbatch")},
             "ratio": r[top]}
    return {"ranks": ranks, "rank": rank, "ratio": r, "worst": worst}


def highest(col: np.ndarray, r: np.ndarray, ranks: int) -> np.ndarray:
    """Rows of each rank's WORST_TASKS highest `r` (`col`: the rank's index), by rank, highest
    first (ties in row order)."""
    order = np.lexsort((-r, col))
    first = np.searchsorted(col[order], np.arange(ranks))
    position = np.arange(len(order)) - first[col[order]]
    return order[position < WORST_TASKS]


def joined(parts: list[dict]) -> dict:
    """ratios() of several parts (windows of one job) as one, in the parts' order."""
    if len(parts) == 1:
        return parts[0]
    ranks = np.unique(np.concatenate([p["ranks"] for p in parts]))
    return {"ranks": ranks, "rank": np.concatenate([p["rank"] for p in parts]),
            "ratio": np.concatenate([p["ratio"] for p in parts]),
            "worst": {c: np.concatenate([p["worst"][c] for p in parts]) for c in WORST_COLUMNS}}


def evidence(ratios: dict, slow_bar: float) -> dict:
    """Per rank: task instances compared, those past `slow_bar`, the median ratio; and its
    WORST_TASKS highest ratios with their tasks."""
    ranks, r = ratios["ranks"], ratios["ratio"]
    col = np.searchsorted(ranks, ratios["rank"])
    instances = np.bincount(col, minlength=len(ranks))
    slow = np.bincount(col[r > slow_bar], minlength=len(ranks))
    median = np.full(len(ranks), np.nan)
    groups, values = group_median(r, col)
    median[groups] = values
    worst = ratios["worst"]
    top = highest(np.searchsorted(ranks, worst["rank"]), worst["ratio"], len(ranks))
    table = {"rank": ranks, "instances": instances, "slow": slow, "task_median": median,
             "forward_busy": np.full(len(ranks), np.nan), "backward_busy": np.full(len(ranks), np.nan)}
    return {"ranks": table, "worst": {c: worst[c][top] for c in WORST_COLUMNS}}


def finish_statistics(parts: list[dict], slow_bar: float, busy: dict | None = None) -> dict[str, dict[str, np.ndarray]]:
    """The statistics from parts made by compute_stats' rank and reference parts (of one input, or of the
    windows of a growing one, each rank's task ratios spread over them): each group's (a sampled
    stage's compared ranks, a stage's reference ranks) ratios joined and judged against
    `slow_bar`; `busy`: a ranks table of each rank's median busy times."""
    series = [table for p in parts for table in p["series"] if table is not None and len(table["rank"])]
    out = [{"series": {c: np.concatenate([tb[c] for tb in series]) for c in SERIES_COLUMNS} if series
            else empty_table(SERIES_COLUMNS), "ranks": busy if busy is not None else empty_table(RANK_COLUMNS),
            "worst": empty_table(WORST_COLUMNS)}]
    for key in sorted({key for p in parts for key in p["groups"]}):
        group = [p["groups"][key] for p in parts if key in p["groups"]]
        out.append({"series": empty_table(SERIES_COLUMNS), **evidence(joined(group), slow_bar)})
    return merge_statistics(out)


def empty_table(columns: tuple[str, ...]) -> dict[str, np.ndarray]:
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
