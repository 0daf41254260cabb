"""Clock corrections as [clock domain, window] tables, and the shift they make of event times (see
align.py): what the fit's corrections do to a trace, to its rows and to the figures judged."""
from __future__ import annotations

import numpy as np

from megatron.scan.keys import group_middles
from megatron.scan.load import GlobalTrace

Tables = tuple[np.ndarray, np.ndarray, np.ndarray]  # offset µs, drift ppm, drift origin wall ns


def clock_bases(trace: GlobalTrace, of_rank: np.ndarray, domains: int) -> np.ndarray:
    """[domain, window] -> the wall ns a drift is measured from: the earliest start of that window
    among the domain's ranks (`of_rank`: each rank's domain; they read one clock, so one origin
    serves them all)."""
    windows = max([len(metas) for metas in trace.windows.values()] + [int(trace.columns["window"].max()) + 1
                                                                       if len(trace) else 1])
    base = np.full((domains, windows), np.iinfo(np.int64).max, dtype=np.int64)
    for rank, metas in trace.windows.items():
        d = of_rank[rank]
        for window, meta in enumerate(metas):
            base[d, window] = min(base[d, window], meta["clock"]["start"]["wall_ns"])
    base[base == np.iinfo(np.int64).max] = 0
    return base


def tables_of(bases: np.ndarray, corrections: dict[tuple[int, int], tuple[float, float]]) -> Tables:
    """[domain, window] tables of offset (µs), drift (ppm) and drift origin (wall ns)."""
    offset = np.zeros(bases.shape)
    drift = np.zeros(bases.shape)
    if corrections:
        # A window without anchors on this host keeps the host's typical correction: the median
        # of its windows' offsets, for every domain at once (one sort, not a median per domain).
        domain, typical = group_middles(
            np.fromiter((d for d, _ in corrections), dtype=np.int64, count=len(corrections)),
            np.fromiter((v for v, _ in corrections.values()), dtype=np.float64, count=len(corrections)))
        offset[domain, :] = typical[:, None]
    for (domain, window), (value, rate) in corrections.items():
        if window < bases.shape[1]:
            offset[domain, window], drift[domain, window] = value, rate
    return offset, drift, bases


def cells(trace: GlobalTrace, of_rank: np.ndarray, windows: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Each row's (domain, window) cell of the [domain, window] tables, as a flat index."""
    c = trace.columns
    if rows is None:
        return of_rank[c["rank"]].astype(np.int64) * windows + c["window"]
    return of_rank[c["rank"][rows]].astype(np.int64) * windows + c["window"][rows]


def correction_ns(trace: GlobalTrace, of_rank: np.ndarray, tables: Tables, rows: np.ndarray,
                  times: np.ndarray) -> np.ndarray:
    """What to subtract from `times` (of event `rows`) to put them on the aligned clock."""
    return shift_at(tables, cells(trace, of_rank, tables[2].shape[1], rows), times)


def shift_at(tables: Tables, cell: np.ndarray, times: np.ndarray) -> np.ndarray:
    """shift_ns at `times` of the rows in `cell` (flat [domain, window] indices): a clock with no
    drift in a window shifts all its times alike, one rounding per cell, not per row."""
    offset, drift, base = (t.ravel() for t in tables)
    out = np.round(offset * 1e3).astype(np.int64)[cell]  # offset + 0 x tau: the offset itself
    drifting = drift != 0
    if drifting.any():
        rows = np.flatnonzero(drifting[cell])
        out[rows] = shift_ns(offset[cell[rows]], drift[cell[rows]], base[cell[rows]], times[rows])
    return out


def shift_ns(offset_us: np.ndarray, drift_ppm: np.ndarray, base_ns: np.ndarray, times: np.ndarray) -> np.ndarray:
    """A clock's correction at `times` (ns): its offset plus its drift since the window's origin."""
    tau_s = (times - base_ns) / 1e9
    return np.round((offset_us + drift_ppm * tau_s) * 1e3).astype(np.int64)


def apply(trace: GlobalTrace, of_rank: np.ndarray, tables: Tables) -> None:
    """correction_ns over every row, in place, each row's cell looked up once for both times."""
    c = trace.columns
    if not len(trace):
        return
    cell = cells(trace, of_rank, tables[2].shape[1])
    for column in ("start", "end"):
        c[column] -= shift_at(tables, cell, c[column])
