"""The typical call of each rank against its peers': a device slower in every call (lower clocks
under a power cap or heat) moves it fully, host preemption (a few calls many times their length)
hardly at all. compute.peer_comparison judges it beside the busy totals, which catch bursts."""
from __future__ import annotations

import warnings

import numpy as np

from megatron.scan.detect.model import unique_rows
from megatron.scan.speed import log_ratio_to_peers


def group_median(values: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group ids, median of `values` in each), nan values left out. One sort of the group ids
    puts each group's values in a row of a padded matrix whose short rows sort at once; only
    groups so uneven that the padding would outgrow the values take a two-key sort (which cost
    0.75 s for the 2.6 million tasks of a 4,096-rank job, against 0.2 s)."""
    keep = ~np.isnan(values)
    values, groups = values[keep], groups[keep]
    if not len(values):
        return np.zeros(0, dtype=groups.dtype), np.zeros(0)
    # A group's values in any order: only their median is kept. A stable sort (timsort) finds the
    # runs of groups that come in order (tables in rank order, windows one after another) and is no
    # slower than a quicksort on the others.
    order = np.argsort(groups, kind="stable")
    g = groups[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    counts = np.diff(np.r_[starts, len(g)])
    width = int(counts.max())
    if width * len(starts) <= 4 * len(values) + 4096:
        row = np.repeat(np.arange(len(starts)), counts)
        padded = np.full((len(starts), width), np.inf)  # the padding sorts after every value
        padded[row, np.arange(len(g)) - starts[row]] = values[order]
        padded.sort(axis=1)
        rows = np.arange(len(starts))
        return g[starts], (padded[rows, (counts - 1) // 2] + padded[rows, counts // 2]) / 2
    order = np.lexsort((values, groups))
    v = values[order]
    return g[starts], (v[starts + (counts - 1) // 2] + v[starts + counts // 2]) / 2


def row_medians(series: list[np.ndarray]) -> np.ndarray:
    """np.median of each array (nan for an empty one), those of one length at once."""
    out = np.full(len(series), np.nan)
    by_length: dict[int, list[int]] = {}
    for i, values in enumerate(series):
        by_length.setdefault(len(values), []).append(i)
    for length, members in by_length.items():
        if length:
            out[members] = np.median(np.stack([series[i] for i in members]), axis=1)
    return out


def typical_ratios(rank: np.ndarray, iteration: np.ndarray, call: np.ndarray, busy: np.ndarray,
                   ranks: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The typical call, compared: per iteration and call (`call`: one id per kind of call that
    runs the same kernels, e.g. the backward of layer 3), each rank's median log busy time over
    its calls of that kind against the median of its peers' (`ranks`); per iteration, the median
    of those log ratios over the kinds of call. A device that is steadily slower runs every call
    slower and moves this fully; a rank preempted now and then on a busy host has a few long
    calls, which move the iteration's total but hardly its median call. rank -> (iterations,
    per-iteration log ratio)."""
    ranks = np.asarray(sorted(int(r) for r in ranks))
    sel = np.isin(rank, ranks)
    if not sel.any():
        return {}
    keys, key_of = unique_rows(np.column_stack([iteration[sel], call[sel]]))
    col = np.searchsorted(ranks, rank[sel])
    cell, medians = group_median(np.log(np.maximum(busy[sel], 1).astype(np.float64)), key_of * len(ranks) + col)
    matrix = np.full((len(keys), len(ranks)), np.nan)  # [iteration and call, rank] median log busy
    matrix[cell // len(ranks), cell % len(ranks)] = medians
    ratios = log_ratio_to_peers(matrix)  # nan: nothing to compare
    # Per iteration, every rank's median over its calls at once ([iteration, rank]; nan: none).
    iterations = np.unique(keys[:, 0])
    per_iteration = np.full((len(iterations), len(ranks)), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan columns: no call compared
        for i, iteration in enumerate(iterations):
            per_iteration[i] = np.nanmedian(ratios[keys[:, 0] == iteration], axis=0)
    out = {}
    for j, r in enumerate(ranks):
        valid = ~np.isnan(per_iteration[:, j])
        if valid.any():
            out[int(r)] = (iterations[valid], per_iteration[valid, j])
    return out
