"""Clock alignment. Each rank's times are already wall clock (through its per-window reference
pair); what remains is each host's wall-clock error, and its monotonic drift since the window
start. The anchor: all participants of a synchronous collective finish it together. For every
(rank, window) an offset (and, where it pays, a drift) is fitted jointly over all anchors by
robust (Huber, reweighted) least squares, with the per-instance finish time eliminated; P2P
messages whose receiver was waiting add 2-member anchors between pipeline stages."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.app.progress import Progress
from megatron.scan.load import GlobalTrace
from megatron.scan.align_solve import IRLS_STEPS, Problem, huber_loss
from megatron.scan.match import Collectives, P2PLinks

_F_THRESHOLD = 10.0  # drift terms are kept only when they explain clearly more than noise


@dataclass(kw_only=True)
class RankAlignment:
    rank: int
    offset_us: dict[int, float] = field(default_factory=dict)  # window -> correction subtracted
    drift_ppm: dict[int, float] = field(default_factory=dict)
    residual_us: float = float("nan")  # RMS of this rank's anchor residuals after the fit
    anchors: int = 0

    def as_dict(self) -> dict:
        return {"rank": self.rank, "anchors": self.anchors, "residual_rms_us": _round(self.residual_us),
                "offset_us": {str(w): _round(v) for w, v in self.offset_us.items()},
                "drift_ppm": {str(w): _round(v) for w, v in self.drift_ppm.items()}}


@dataclass(kw_only=True)
class Alignment:
    ranks: dict[int, RankAlignment]
    model: dict[str, int]  # "offset" / "offset+drift" -> number of (window) components using it
    anchors: int
    unanchored: list[int]  # ranks with no anchor at all (kept on their wall clock)
    p2p_anchors: int = 0  # P2P messages used as anchors (receiver was waiting)

    def as_dict(self) -> dict:
        return {"anchors": self.anchors, "p2p_anchors": self.p2p_anchors, "models": self.model,
                "unanchored_ranks": self.unanchored,
                "ranks": [self.ranks[r].as_dict() for r in sorted(self.ranks)]}


def _round(value: float) -> float | None:
    return None if value != value else round(float(value), 3)


def _components(nodes: np.ndarray, instance: np.ndarray, num_nodes: int) -> np.ndarray:
    """Connected components of nodes linked by shared instances (union-find)."""
    parent = np.arange(num_nodes)

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order = np.argsort(instance, kind="stable")
    inst_sorted, node_sorted = instance[order], nodes[order]
    firsts = np.flatnonzero(np.concatenate([[True], inst_sorted[1:] != inst_sorted[:-1]]))
    first_node = np.repeat(node_sorted[firsts], np.diff(np.append(firsts, len(order))))
    for a, b in set(zip(first_node.tolist(), node_sorted.tolist())):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
    return np.array([find(i) for i in range(num_nodes)])


def align(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks | None = None, *,
          allow_drift: bool = True, fitted: dict[tuple[int, int], tuple[float, float]] | None = None,
          progress: Progress | None = None) -> Alignment:
    """Estimate per-(rank, window) corrections and apply them to trace.columns start/end in place.

    `fitted`: {(rank, window): (offset µs, drift ppm)} from an earlier fit of the same files (online
    detection re-reads a growing directory every window). Anchors tie ranks only within a window,
    so a window that every rank has in `fitted` is not fitted again: its corrections are reused and
    only the new windows cost a fit.

    Pass 1 uses collective anchors. Pass 2 adds P2P messages whose receiver was already waiting
    when (by pass 1's clocks) the send was posted: such a receive finishes as the message lands,
    so send end and receive end are a 2-member anchor. Messages flow both ways between stages, so
    the transfer latency cancels; these anchors tie pipeline stages together far more densely than
    the one or two collectives per iteration that span stages. `progress` counts the solver steps."""
    c = trace.columns
    anchor_instances = collectives.synchronous & ~collectives.op_mismatch & (collectives.members >= 2)
    rows = np.flatnonzero(collectives.row_instance >= 0)
    rows = rows[anchor_instances[collectives.row_instance[rows]]]
    known = _known_windows(trace, fitted or {})
    rows = rows[~np.isin(c["window"][rows], known)]
    instance = collectives.row_instance[rows]
    report, models, drift_windows = _fit(trace, rows, instance, c["end"][rows], allow_drift, progress=progress)
    p2p_anchors = 0
    # Transfer latency is one-sided in an anchor; the per-link balancing cancels it on average
    # over the window, but not along time, where forward messages cluster early and backward ones
    # late, which a drift fit would take for drift. So P2P anchors refine offset-only fits, and a
    # window whose collectives already show drift keeps its collectives-only fit. Decided per
    # window (anchors never tie two windows), so a window's corrections do not depend on which
    # other windows are fitted with it: online detection, which fits only the new windows, gets
    # the same corrections as a fit of the whole directory.
    if p2p is not None and len(p2p):
        send, recv = p2p.send_rows, p2p.recv_rows
        new = ~np.isin(c["window"][send], known) & ~np.isin(c["window"][send], drift_windows)
        send, recv = send[new], recv[new]
        send_end = c["end"][send] - _correction_ns(trace, report, send, c["end"][send])
        recv_start = c["start"][recv] - _correction_ns(trace, report, recv, c["start"][recv])
        waited = recv_start < send_end
        weight = _balanced_link_weights(c["rank"][send], c["rank"][recv], c["window"][send]) * waited
        used = weight > 0
        if used.any():
            drifting = np.isin(c["window"][rows], drift_windows)
            # The drifting windows' fit again, alone (the same result as above), then the others
            # with their P2P anchors, into the same report.
            report, models, _ = _fit(trace, rows[drifting], instance[drifting], c["end"][rows[drifting]],
                                     allow_drift, progress=progress)
            ids = (int(instance.max()) + 1 if len(instance) else 0) + np.arange(int(used.sum()))
            steady = rows[~drifting]
            prior = np.concatenate([np.ones(len(steady)), weight[used], weight[used]])
            refined = np.concatenate([steady, send[used], recv[used]])
            refined_instance = np.concatenate([instance[~drifting], ids, ids])
            report, models, _ = _fit(trace, refined, refined_instance, c["end"][refined], False, prior,
                                     progress=progress, into=(report, models))
            rows = np.concatenate([rows[drifting], refined])
            p2p_anchors = int(used.sum())
    for (rank, window), (offset, drift) in (fitted or {}).items():
        if window in known and rank in report:
            report[rank].offset_us[window] = offset
            report[rank].drift_ppm[window] = drift
    _apply(trace, report)
    unanchored = sorted(rank for rank, entry in report.items() if entry.anchors == 0 and not entry.offset_us)
    return Alignment(ranks=report, model=models, anchors=int(len(rows)), unanchored=unanchored,
                     p2p_anchors=p2p_anchors)


def _known_windows(trace: GlobalTrace, fitted: dict[tuple[int, int], tuple[float, float]]) -> np.ndarray:
    """Windows that every rank of the trace has in `fitted`."""
    if not fitted:
        return np.zeros(0, dtype=np.int64)
    windows = {window for _, window in fitted}
    return np.array(sorted(w for w in windows if all((rank, w) in fitted for rank in trace.ranks)), dtype=np.int64)


def fitted_windows(alignment: Alignment, windows: int) -> dict[tuple[int, int], tuple[float, float]]:
    """The corrections of windows 0 .. windows-1 of `alignment`, to pass to a later align()."""
    return {(rank, window): (offset, entry.drift_ppm.get(window, 0.0))
            for rank, entry in alignment.ranks.items() for window, offset in entry.offset_us.items() if window < windows}


def _balanced_link_weights(src: np.ndarray, dst: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Weights giving both directions of a link (per window) the same total, so the unknown
    transfer latency cancels between them; a link used in one direction only gets weight 0."""
    low, high = np.minimum(src, dst).astype(np.int64), np.maximum(src, dst).astype(np.int64)
    forward = (src < dst).astype(np.int64)
    key = np.stack([low, high, window.astype(np.int64), forward], axis=1)
    if not len(key):
        return np.zeros(0)
    _, direction_id, direction_count = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    _, link_id = np.unique(key[:, :3], axis=0, return_inverse=True)
    direction_id, link_id = direction_id.reshape(-1), link_id.reshape(-1)
    directions = np.bincount(link_id, weights=np.ones(len(key)) / direction_count[direction_id])
    weight = 1.0 / direction_count[direction_id]
    weight[directions[link_id] < 1.5] = 0.0
    # Scale so that a link's anchors together weigh as much as its messages would unweighted.
    link_total = np.bincount(link_id)
    return weight * link_total[link_id] / 2.0


def _fit(trace: GlobalTrace, rows: np.ndarray, instance: np.ndarray, end: np.ndarray, allow_drift: bool,
         prior: np.ndarray | None = None, progress: Progress | None = None,
         into: tuple[dict[int, RankAlignment], dict[str, int]] | None = None
         ) -> tuple[dict[int, RankAlignment], dict[str, int], np.ndarray]:
    """Fit every connected component of (rank, window) nodes linked by the anchors given as event
    rows, their anchor instance ids and their finish times (wall ns). Returns the report, the
    number of components per model and the windows of components fitted with drift. `into`: a
    report and model counts from a fit of other windows, added to."""
    c = trace.columns
    report, models = into if into is not None else (
        {rank: RankAlignment(rank=rank) for rank in trace.ranks}, {"offset": 0, "offset+drift": 0})
    drift_windows: set[int] = set()
    if not len(rows):
        return report, models, np.zeros(0, dtype=np.int64)
    prior = np.ones(len(rows)) if prior is None else prior
    windows = int(c["window"].max()) + 1
    node_key = c["rank"][rows].astype(np.int64) * windows + c["window"][rows]
    node_keys, node = np.unique(node_key, return_inverse=True)
    window_start = {(r, w): meta["clock"]["start"]["wall_ns"]
                    for r, metas in trace.windows.items() for w, meta in enumerate(metas)}
    node_start = np.array([window_start[(int(k // windows), int(k % windows))] for k in node_keys], dtype=np.int64)
    # Center each instance in integer ns first: absolute wall ns do not fit a float's precision.
    _, inst_index = np.unique(instance, return_inverse=True)
    inst_min = np.full(inst_index.max() + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(inst_min, inst_index, end)
    d_us = (end - inst_min[inst_index]) / 1e3
    tau_s = (end - node_start[node]) / 1e9
    component = _components(node, instance, len(node_keys))
    components, comp_sizes = np.unique(component, return_counts=True)
    tick = None
    if progress is not None:  # counted in solver steps: the fits of large components take seconds
        progress.add_total(IRLS_STEPS * int(sum(2 if allow_drift and n > 1 else 1 for n in comp_sizes.tolist())))
        tick = progress.update
    for comp in components:
        comp_nodes = np.flatnonzero(component == comp)
        n = len(comp_nodes)
        local = np.full(len(node_keys), -1)
        local[comp_nodes] = np.arange(n)
        mask = component[node] == comp
        problem = Problem(local[node[mask]], instance[mask], d_us[mask], tau_s[mask], n, prior[mask])
        x, r, sigma = problem.fit(drift=False, tick=tick)
        use_drift = False
        if allow_drift and n > 1:
            # Drift is kept only if it lowers the robust loss far more than its extra unknowns
            # would by chance (an F-like test with both fits on the offset fit's scale).
            x1, r1, _ = problem.fit(drift=True, sigma=sigma, tick=tick)
            loss0, loss1 = huber_loss(r, sigma), huber_loss(r1, sigma)
            dof = len(problem.d) - len(problem.sizes) - 2 * n
            if dof > 0 and loss1 > 0 and (loss0 - loss1) / n / (loss1 / dof) > _F_THRESHOLD:
                x, r, use_drift = x1, r1, True
        models["offset+drift" if use_drift else "offset"] += 1
        if use_drift:
            drift_windows.update(int(k % windows) for k in node_keys[comp_nodes])
        # Robust gauge: the median clock of the component is taken as right, so one skewed host
        # is corrected alone instead of shifting every healthy rank by its share of the mean.
        x = x.copy()
        x[:n] -= np.median(x[:n])
        if use_drift:
            x[n:] -= np.median(x[n:])
        squares = np.bincount(problem.node, weights=r * r, minlength=n)
        counts = np.bincount(problem.node, minlength=n)
        for i, global_node in enumerate(comp_nodes):
            rank, window = int(node_keys[global_node] // windows), int(node_keys[global_node] % windows)
            entry = report[rank]
            entry.offset_us[window] = float(x[i])
            entry.drift_ppm[window] = float(x[i + n]) if use_drift else 0.0
            previous = 0.0 if entry.anchors == 0 else entry.residual_us ** 2 * entry.anchors
            entry.anchors += int(counts[i])
            entry.residual_us = float(np.sqrt((previous + squares[i]) / max(1, entry.anchors)))
    return report, models, np.array(sorted(drift_windows), dtype=np.int64)


def _tables(trace: GlobalTrace, report: dict[int, RankAlignment]):
    c = trace.columns
    ranks = max(trace.ranks) + 1
    windows = int(c["window"].max()) + 1
    offset = np.zeros((ranks, windows))
    drift = np.zeros((ranks, windows))
    base = np.zeros((ranks, windows), dtype=np.int64)
    for rank, entry in report.items():
        for window, meta in enumerate(trace.windows[rank][:windows]):
            base[rank, window] = meta["clock"]["start"]["wall_ns"]
        if entry.offset_us:
            # A window without anchors on this rank keeps the rank's typical correction.
            offset[rank, :] = float(np.median(list(entry.offset_us.values())))
            for window, value in entry.offset_us.items():
                offset[rank, window] = value
                drift[rank, window] = entry.drift_ppm.get(window, 0.0)
    return offset, drift, base


def _correction_ns(trace: GlobalTrace, report: dict[int, RankAlignment], rows: np.ndarray,
                   times: np.ndarray) -> np.ndarray:
    """What to subtract from `times` (of event `rows`) to put them on the aligned clock."""
    offset, drift, base = _tables(trace, report)
    rank, window = trace.columns["rank"][rows], trace.columns["window"][rows]
    tau_s = (times - base[rank, window]) / 1e9
    return np.round((offset[rank, window] + drift[rank, window] * tau_s) * 1e3).astype(np.int64)


def _apply(trace: GlobalTrace, report: dict[int, RankAlignment]) -> None:
    c = trace.columns
    if not len(trace):
        return
    every = np.arange(len(trace))
    for column in ("start", "end"):
        c[column] -= _correction_ns(trace, report, every, c[column])
