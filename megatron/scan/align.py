"""Clock alignment. Each rank's times are already wall clock (through its per-window reference
pair); what remains is each host's wall-clock error, and its monotonic drift since the window
start. Ranks on one host read one clock, so the unknowns are one offset (and, where it pays, a
drift) per (host, window); the host of the lowest rank keeps its raw clock and the others are
fitted against it, so a job on one host is never moved. The anchors: all participants of a
synchronous collective finish it together, and P2P messages whose receiver was waiting tie
pipeline stages; the fit is robust (Huber, reweighted) least squares with the per-instance
finish time eliminated. Two guards follow (align_check): a fit that breaks causality (a receive
before its send, an all-reduce finished before a member started it) is replaced by the raw clocks
if they break none, else by the middle of the causality bounds; and a correction that leaves the
collective finish spread or the causality violations worse than the raw clocks is dropped (that
host keeps its raw clock in that window). Traces without host identities: one clock per rank."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron.app.progress import Progress
from megatron.scan.align_check import Causality, Judge
from megatron.scan.align_shift import apply, cells, clock_bases, correction_ns, shift_at, tables_of
from megatron.scan.align_solve import (IRLS_STEPS, Problem, balanced_link_weights, components as connected, huber_loss,
                                      one_clock)
from megatron.scan.keys import unique_rows
from megatron.scan.load import GlobalTrace
from megatron.scan.match import Collectives, P2PLinks

_F_THRESHOLD = 10.0  # drift terms are kept only when they explain clearly more than noise


@dataclass(kw_only=True)
class RankAlignment:
    rank: int
    host: str = ""
    offset_us: dict[int, float] = field(default_factory=dict)  # window -> correction subtracted (its host's)
    drift_ppm: dict[int, float] = field(default_factory=dict)
    residual_us: float = float("nan")  # RMS of this rank's anchor residuals after the fit
    anchors: int = 0

    def as_dict(self) -> dict:
        return {"rank": self.rank, "host": self.host, "anchors": self.anchors,
                "residual_rms_us": _round(self.residual_us),
                "offset_us": {str(w): _round(v) for w, v in self.offset_us.items()},
                "drift_ppm": {str(w): _round(v) for w, v in self.drift_ppm.items()}}


@dataclass(kw_only=True)
class HostAlignment:
    host: str  # hostname/boot_id, or "rank N" for a trace without host identities
    ranks: list[int]
    offset_us: dict[int, float] = field(default_factory=dict)
    drift_ppm: dict[int, float] = field(default_factory=dict)
    reference: bool = False  # its raw clock is the one the others are aligned to
    kept_raw: list[int] = field(default_factory=list)  # windows whose fitted correction was dropped

    def as_dict(self) -> dict:
        return {"host": self.host, "ranks": self.ranks, "reference": self.reference, "kept_raw_windows": self.kept_raw,
                "offset_us": {str(w): _round(v) for w, v in self.offset_us.items()},
                "drift_ppm": {str(w): _round(v) for w, v in self.drift_ppm.items()}}


@dataclass(kw_only=True)
class Alignment:
    ranks: dict[int, RankAlignment]
    model: dict[str, int]  # "offset" / "offset+drift" -> number of (window) components using it
    anchors: int
    unanchored: list[int]  # ranks with no anchor at all (kept on their wall clock)
    p2p_anchors: int = 0  # P2P messages used as anchors (receiver was waiting)
    clock_domains: str = "host"  # "host": one clock per host; "rank" (old traces) or "mixed"
    hosts: list[HostAlignment] = field(default_factory=list)
    before: dict | None = None  # figures on the raw clocks (align_check.Judge.figures)
    after: dict | None = None  # and on the aligned ones
    notes: list[str] = field(default_factory=list)
    # Judge.measures on the raw clocks and on the aligned ones, what `before` and `after` summarize
    measures: tuple | None = None

    def as_dict(self) -> dict:
        return {"clock_domains": self.clock_domains, "notes": self.notes, "anchors": self.anchors,
                "p2p_anchors": self.p2p_anchors, "models": self.model, "unanchored_ranks": self.unanchored,
                "before": self.before, "after": self.after, "hosts": [h.as_dict() for h in self.hosts],
                "ranks": [self.ranks[r].as_dict() for r in sorted(self.ranks)]}


def _round(value: float) -> float | None:
    return None if value != value else round(float(value), 3)


@dataclass(kw_only=True)
class ClockDomains:
    """Which ranks read one clock. Domains are numbered by their lowest rank, so domain 0 is the
    host of the lowest rank: the reference."""

    of_rank: np.ndarray  # rank -> domain
    labels: list[str]
    members: list[list[int]]
    mode: str
    note: str = ""


def clock_domains(trace: GlobalTrace) -> ClockDomains:
    of_rank = np.full(max(trace.ranks, default=-1) + 1, -1, dtype=np.int64)
    keys: dict[str, int] = {}
    labels: list[str] = []
    members: list[list[int]] = []
    missing = []
    for rank in sorted(trace.ranks):
        host = trace.ranks[rank].get("host_id")
        if not host:
            missing.append(rank)
        key = host or f"rank {rank}"  # a host identity always holds a '/', never equals this
        if key not in keys:
            keys[key] = len(labels)
            labels.append(key)
            members.append([])
        of_rank[rank] = keys[key]
        members[keys[key]].append(rank)
    mode, note = "host", ""
    if missing and len(missing) == len(trace.ranks):
        mode = "rank"
        note = ("the trace headers carry no host identity (written before MegaScan recorded it): each rank's clock "
                "is fitted on its own, as if every rank were on a host of its own")
    elif missing:
        mode = "mixed"
        note = f"ranks {missing} carry no host identity: each is fitted as a host of its own"
    return ClockDomains(of_rank=of_rank, labels=labels, members=members, mode=mode, note=note)


@dataclass(kw_only=True)
class _Fit:
    """Corrections per (domain, window) -> (offset µs, drift ppm), and per-rank anchor residuals."""

    corrections: dict[tuple[int, int], tuple[float, float]]
    squares: np.ndarray
    counts: np.ndarray
    models: dict[str, int]
    references: set[tuple[int, int]] = field(default_factory=set)  # (domain, window) kept on its raw clock
    scales: dict[tuple[int, int], float] = field(default_factory=dict)  # robust residual scale of its fit, µs


def align(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks | None = None, *,
          allow_drift: bool = True, fitted: dict[tuple[int, int], tuple[float, float]] | None = None,
          progress: Progress | None = None, whole: bool = True) -> Alignment:
    """Estimate per-(host, window) corrections and apply them to trace.columns start/end in place.

    `fitted`: {(rank, window): (offset µs, drift ppm)} from an earlier fit of the same files (online
    detection reading a growing directory whole, as it does a restarted job's). Anchors tie clocks only within a window,
    so a window that every rank has in `fitted` is not fitted again: its corrections are reused and
    only the new windows cost a fit.

    Pass 1 uses collective anchors. Pass 2 adds P2P messages whose receiver was already waiting
    when (by pass 1's clocks) the send was posted: such a receive finishes as the message lands,
    so send end and receive end are a 2-member anchor. Messages flow both ways between stages, so
    the transfer latency cancels; these anchors tie pipeline stages together far more densely than
    the one or two collectives per iteration that span stages. `progress` counts the solver steps.
    `whole` False: the trace is some windows of a larger one (online detection builds a growing
    directory's windows apart), so the guard that keeps every clock raw when the whole trace's
    figures end worse is left to the caller, who has them all (Alignment.measures)."""
    c = trace.columns
    domains = clock_domains(trace)
    bases = clock_bases(trace, domains.of_rank, len(domains.labels))
    anchor_instances = collectives.synchronous & ~collectives.op_mismatch & (collectives.members >= 2)
    rows = np.flatnonzero(collectives.row_instance >= 0)
    rows = rows[anchor_instances[collectives.row_instance[rows]]]
    known = _known_windows(trace, fitted or {})
    rows = rows[~np.isin(c["window"][rows], known)]
    instance = collectives.row_instance[rows]
    # The fits of the first pass by component, for the drifting windows' second fit below.
    first_pass: dict[tuple, tuple] = {}
    fit, drift_windows = _fit(trace, domains, bases, rows, instance, allow_drift, progress=progress, memo=first_pass)
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
        tables = tables_of(bases, fit.corrections)
        send_end = c["end"][send] - correction_ns(trace, domains.of_rank, tables, send, c["end"][send])
        recv_start = c["start"][recv] - correction_ns(trace, domains.of_rank, tables, recv, c["start"][recv])
        waited = recv_start < send_end
        weight = balanced_link_weights(c["rank"][send], c["rank"][recv], c["window"][send]) * waited
        used = weight > 0
        if used.any():
            drifting = np.isin(c["window"][rows], drift_windows)
            # The drifting windows' fit again, alone (the first pass's, taken from it: the same
            # anchors of the same windows), then the others with their P2P anchors, into the same fit.
            fit, _ = _fit(trace, domains, bases, rows[drifting], instance[drifting], allow_drift, progress=progress,
                          memo=first_pass)
            ids = (int(instance.max()) + 1 if len(instance) else 0) + np.arange(int(used.sum()))
            steady = rows[~drifting]
            prior = np.concatenate([np.ones(len(steady)), weight[used], weight[used]])
            refined = np.concatenate([steady, send[used], recv[used]])
            refined_instance = np.concatenate([instance[~drifting], ids, ids])
            fit, _ = _fit(trace, domains, bases, refined, refined_instance, False, prior, progress=progress, into=fit)
            rows = np.concatenate([rows[drifting], refined])
            p2p_anchors = int(used.sum())
    for (rank, window), correction in (fitted or {}).items():
        if window in known and 0 <= rank < len(domains.of_rank) and domains.of_rank[rank] >= 0:
            fit.corrections[(int(domains.of_rank[rank]), window)] = correction
    # Causality holds under any load, the anchors' model does not: a fit that breaks it is replaced.
    known_windows = set(known.tolist())
    fitted_now = {w for (_, w) in fit.corrections if w not in known_windows}
    drift_only = tables_of(bases, {key: (0.0, drift) for key, (_, drift) in fit.corrections.items()})
    notes = Causality(trace, collectives, p2p, domains.of_rank).respect(
        fit.corrections, fit.references, lambda rows, times: correction_ns(trace, domains.of_rank, drift_only, rows, times),
        domains.labels, fitted_now, fit.scales)
    # Never worse than the raw clocks: the figures are judged on the raw times, before applying.
    judge = Judge(trace, collectives, p2p)
    shifts: dict[tuple, np.ndarray] = {}  # the judged rows' shift of the corrections (often asked twice)
    judged_cells = cells(trace, domains.of_rank, bases.shape[1], judge.rows)  # millions of rows: looked up once

    def shift_of(corrections: dict[tuple[int, int], tuple[float, float]]) -> np.ndarray:
        key = tuple(sorted(corrections.items()))
        if key not in shifts:
            shifts[key] = shift_at(tables_of(bases, corrections), judged_cells, judge.times)
        return shifts[key]

    kept_raw, kept_notes = judge.keep_raw_where_worse(fit.corrections, fitted_now, shift_of, domains.of_rank,
                                                      domains.labels, whole)
    tables = tables_of(bases, fit.corrections)
    shift = shift_of(fit.corrections)
    shifts.clear()
    before, after = judge.figures(np.zeros_like(shift)), judge.figures(shift)
    apply(trace, domains.of_rank, tables)
    alignment = _report(trace, domains, fit, kept_raw, rows, p2p_anchors, before, after,
                        ([domains.note] if domains.note else []) + notes + kept_notes)
    alignment.measures = (judge.measures(np.zeros_like(shift)), judge.measures(shift))
    return alignment


def _report(trace: GlobalTrace, domains: ClockDomains, fit: _Fit, kept_raw: set[tuple[int, int]], rows: np.ndarray,
            p2p_anchors: int, before: dict, after: dict, notes: list[str]) -> Alignment:
    references = {d for d, _ in fit.references}
    hosts = [HostAlignment(host=label, ranks=members, reference=d in references)
             for d, (label, members) in enumerate(zip(domains.labels, domains.members))]
    for (d, window), (offset, drift) in sorted(fit.corrections.items()):
        hosts[d].offset_us[window], hosts[d].drift_ppm[window] = offset, drift
    for d, window in sorted(kept_raw):
        hosts[d].kept_raw.append(window)
    ranks = {}
    for rank in trace.ranks:
        host = hosts[domains.of_rank[rank]]
        anchors = int(fit.counts[rank]) if rank < len(fit.counts) else 0
        residual = float(np.sqrt(fit.squares[rank] / anchors)) if anchors else float("nan")
        ranks[rank] = RankAlignment(rank=rank, host=host.host, offset_us=dict(host.offset_us),
                                    drift_ppm=dict(host.drift_ppm), residual_us=residual, anchors=anchors)
    unanchored = sorted(rank for rank, entry in ranks.items() if entry.anchors == 0 and not entry.offset_us)
    return Alignment(ranks=ranks, model=fit.models, anchors=int(len(rows)), unanchored=unanchored,
                     p2p_anchors=p2p_anchors, clock_domains=domains.mode, hosts=hosts, before=before, after=after,
                     notes=notes)


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


def _fit(trace: GlobalTrace, domains: ClockDomains, bases: np.ndarray, rows: np.ndarray, instance: np.ndarray,
         allow_drift: bool, prior: np.ndarray | None = None, progress: Progress | None = None,
         into: _Fit | None = None, memo: dict[tuple, tuple] | None = None) -> tuple[_Fit, np.ndarray]:
    """Fit every connected component of (domain, window) nodes linked by the anchors given as event
    rows and their anchor instance ids (finish times: the rows' end). Returns the fit and the
    windows of components fitted with drift. `into`: a fit of other windows, added to. `memo`:
    each component's solution by its nodes and number of anchors, kept and reused (a component
    lies in one window, so a later fit with all of that window's anchors, unweighted, poses the
    same problem; align's second pass refits the drifting windows so)."""
    c = trace.columns
    size = max(trace.ranks, default=0) + 1
    fit = into or _Fit(corrections={}, squares=np.zeros(size), counts=np.zeros(size, dtype=np.int64),
                       models={"offset": 0, "offset+drift": 0})
    drift_windows: set[int] = set()
    if not len(rows):
        return fit, np.zeros(0, dtype=np.int64)
    prior = np.ones(len(rows)) if prior is None else prior
    end, rank = c["end"][rows], c["rank"][rows].astype(np.int64)
    windows = bases.shape[1]
    node_key = domains.of_rank[rank] * windows + c["window"][rows]
    node_keys, node = unique_rows(node_key[:, None])
    node_keys = node_keys[:, 0]
    node_start = bases[node_keys // windows, node_keys % windows]
    _, inst_index = unique_rows(instance[:, None])
    # An instance whose members all read one clock (a TP group inside a host: most anchors of a
    # job with host identities) ties that clock only to itself: its residuals are the same
    # whatever the corrections. It is left out of the fits, and of their robust scale, which is
    # then the scatter of the anchors that do tie clocks; its residuals still count per rank.
    # (An instance spans nodes where some member's node is not the one a member left written.)
    one = np.empty(int(inst_index.max()) + 1, dtype=np.int64)
    one[inst_index] = node
    spans = (np.bincount(inst_index, weights=node != one[inst_index], minlength=len(one)) > 0)[inst_index]
    if not spans.all():
        alone = ~spans
        # Centered on one member's finish (integer ns first: wall ns do not fit a float's precision).
        member_end = np.empty(len(one), dtype=np.int64)
        member_end[inst_index[alone]] = end[alone]
        _one_clock(fit, node_keys, windows, node[alone], inst_index[alone],
                   (end[alone] - member_end[inst_index[alone]]) / 1e3, prior[alone], rank[alone],
                   skip=np.unique(node[spans]))
        node, instance, inst_index, end, prior, rank = (a[spans] for a in (node, instance, inst_index, end, prior, rank))
        if not len(node):
            return fit, np.zeros(0, dtype=np.int64)
    # Center each instance in integer ns first: absolute wall ns do not fit a float's precision.
    inst_min = np.full(len(one), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(inst_min, inst_index, end)
    d_us = (end - inst_min[inst_index]) / 1e3
    tau_s = (end - node_start[node]) / 1e9
    component = connected(node, instance, len(node_keys))
    components = np.unique(component[node])
    members = [np.flatnonzero(component == comp) for comp in components]
    anchors = np.bincount(component[node], minlength=int(component.max()) + 1)
    keys = [(tuple(node_keys[comp_nodes].tolist()), int(anchors[comp])) for comp, comp_nodes in zip(components, members)]
    tick = None
    if progress is not None:  # counted in solver steps: the fits of large components take seconds
        progress.add_total(IRLS_STEPS * int(sum(2 if allow_drift and len(comp_nodes) > 1 else 1
                                                for comp_nodes, key in zip(members, keys)
                                                if memo is None or key not in memo)))
        tick = progress.update
    for comp, comp_nodes, key in zip(components, members, keys):
        n = len(comp_nodes)
        if memo is not None and key in memo:
            x, r, sigma, use_drift, observed = memo[key]
        else:
            mask = component[node] == comp
            local = np.full(len(node_keys), -1)
            local[comp_nodes] = np.arange(n)
            x, r, sigma, use_drift, observed = _fit_component(
                node_keys[comp_nodes], local[node[mask]], instance[mask], d_us[mask], tau_s[mask], prior[mask],
                rank[mask], allow_drift, tick)
            if memo is not None:
                memo[key] = (x, r, sigma, use_drift, observed)
        fit.models["offset+drift" if use_drift else "offset"] += 1
        if use_drift:
            drift_windows.update(int(k % windows) for k in node_keys[comp_nodes])
        reference = int(np.argmin(node_keys[comp_nodes]))
        fit.references.add(divmod(int(node_keys[comp_nodes[reference]]), windows))
        for i, global_node in enumerate(comp_nodes):
            domain, window = divmod(int(node_keys[global_node]), windows)
            fit.corrections[(domain, window)] = (float(x[i]), float(x[i + n]) if use_drift else 0.0)
            fit.scales[(domain, window)] = sigma
        np.add.at(fit.squares, observed, r * r)
        np.add.at(fit.counts, observed, 1)
    return fit, np.array(sorted(drift_windows), dtype=np.int64)


def _one_clock(fit: _Fit, node_keys: np.ndarray, windows: int, node: np.ndarray, instance: np.ndarray, d_us: np.ndarray,
               prior: np.ndarray, rank: np.ndarray, skip: np.ndarray) -> None:
    """Anchors of instances whose members share one node: their residuals counted per rank; a
    node with no other anchor (not in `skip`) is a component of its own, kept on its raw clock."""
    r, alone, scales = one_clock(node, instance, d_us, prior, skip)
    fit.squares += np.bincount(rank, weights=r * r, minlength=len(fit.squares))[:len(fit.squares)]
    fit.counts += np.bincount(rank, minlength=len(fit.counts))[:len(fit.counts)]
    for key, scale in zip(node_keys[alone].tolist(), scales.tolist()):
        domain, window = divmod(int(key), windows)
        fit.corrections[(domain, window)] = (0.0, 0.0)
        fit.scales[(domain, window)] = scale
        fit.references.add((domain, window))
        fit.models["offset"] += 1


def _fit_component(keys: np.ndarray, local: np.ndarray, instance: np.ndarray, d_us: np.ndarray, tau_s: np.ndarray,
                   prior: np.ndarray, rank: np.ndarray, allow_drift: bool, tick) -> tuple:
    """One connected component's fit: its nodes' sorted keys, each anchor's node among them
    (`local`) and instance, finish time and drift time. Returns the corrections (offsets, then
    drifts when kept) with the gauge applied, the residuals, the robust scale, whether drift was
    kept, and each residual's rank."""
    n = len(keys)
    problem = Problem(local, instance, d_us, tau_s, n, prior)
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
    # Gauge: the component's lowest domain (the host of its lowest rank; node keys sort by
    # domain) keeps its raw clock, and every other host is measured against it. A host is
    # moved only by what the anchors say about it, and a lone host not at all.
    reference = int(np.argmin(keys))
    x = x.copy()
    x[:n] -= x[reference]
    if use_drift:
        x[n:] -= x[n + reference]
    return x, r, sigma, use_drift, rank[problem.order]
