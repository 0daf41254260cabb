"""Checks of a clock fit against what holds whatever the load. The anchors' model (participants
of a collective finish it together) fails where a busy rank observes a finish late, and a fit can
then move a correct clock. Causality does not fail: `Causality` bounds the difference of two
clocks' corrections by every message (received no earlier than sent) and every all-reduce-like
collective (finished nowhere before every member started), and replaces a fit that breaks a
bound. `Judge` measures, on the raw clocks and on the corrected ones, the collective finish
spread (per complete synchronous instance, latest minus earliest finish; median and p95) and the
P2P receives that end before their send started; a correction that makes any of them worse than
the raw clocks is dropped, and that host keeps its raw clock in that window."""
from __future__ import annotations

from typing import Callable

import numpy as np

from megatron.scan.load import GlobalTrace
from megatron.scan.match import Collectives, P2PLinks

# A window the fit made worse is repaired host by host (greedily, the host whose raw clock helps
# most first) when it has at most this many corrected hosts; above, the whole window keeps its
# raw clocks (each greedy step measures every host once).
GREEDY_HOSTS = 16
_FIGURES = ("causality_violations", "finish_spread_us_median", "finish_spread_us_p95")


def worse(after: dict, before: dict) -> list[str]:
    """The figures of `after` that are worse than `before` (none where there is nothing to measure)."""
    return [key for key in _FIGURES if after[key] is not None and before[key] is not None and after[key] > before[key]]


def _excess(after: dict, before: dict) -> float:
    """How much worse, summed over the figures relative to their raw value: orders repair steps."""
    total = 0.0
    for key in _FIGURES:
        if after[key] is not None and before[key] is not None:
            total += max(0.0, after[key] - before[key]) / max(float(before[key]), 1.0)
    return total


class Judge:
    """The rows whose times the figures read (collective finishes, send starts, receive ends),
    with their raw times; `figures(shift)` measures them with `shift` (ns) subtracted."""

    def __init__(self, trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks | None) -> None:
        c = trace.columns
        keep = collectives.complete & collectives.synchronous & (collectives.members >= 2)
        coll = np.flatnonzero(collectives.row_instance >= 0)
        coll = coll[keep[collectives.row_instance[coll]]]
        coll = coll[np.argsort(collectives.row_instance[coll], kind="stable")]
        instance = collectives.row_instance[coll]
        self._starts = np.flatnonzero(np.concatenate([[True], instance[1:] != instance[:-1]])) if len(coll) else \
            np.zeros(0, dtype=np.int64)
        window = c["window"][coll].astype(np.int64)
        self.instance_window = np.minimum.reduceat(window, self._starts) if len(coll) else window
        empty = np.zeros(0, dtype=np.int64)
        send = p2p.send_rows if p2p is not None else empty
        recv = p2p.recv_rows if p2p is not None else empty
        self.message_window = c["window"][recv].astype(np.int64)
        self.rows = np.concatenate([coll, send, recv]).astype(np.int64)
        self.times = np.concatenate([c["end"][coll], c["start"][send], c["end"][recv]]).astype(np.int64)
        self.window = c["window"][self.rows].astype(np.int64)
        self.rank = c["rank"][self.rows].astype(np.int64)
        self._split = (len(coll), len(coll) + len(send))

    def measures(self, shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per collective instance its finish spread (ns), per P2P message whether it broke
        causality, with `shift` (ns) subtracted from the times."""
        t = self.times - shift
        a, b = self._split
        if a:
            spread = np.maximum.reduceat(t[:a], self._starts) - np.minimum.reduceat(t[:a], self._starts)
        else:
            spread = np.zeros(0, dtype=np.int64)
        return spread, t[b:] < t[a:b]

    def figures(self, shift: np.ndarray, window: int | None = None, exact: bool = False) -> dict:
        """The figures (of one window, or all): spreads in µs, rounded to the ns unless `exact`."""
        spread, violated = self.measures(shift)
        if window is not None:
            spread, violated = spread[self.instance_window == window], violated[self.message_window == window]
        return summarize(spread, violated, exact)

    def keep_raw_where_worse(self, corrections: dict[tuple[int, int], tuple[float, float]], windows: set[int],
                             shift_of: Callable[[dict], np.ndarray], of_rank: np.ndarray, labels: list[str],
                             whole: bool = True) -> tuple[set[tuple[int, int]], list[str]]:
        """Drop (set to 0) the corrections {(domain, window): (offset µs, drift ppm)} of `windows`
        that make that window's figures worse than its raw clocks; then, should the whole trace's
        figures still be worse (medians and percentiles do not add up over windows), every
        correction (unless not `whole`: the trace is part of one judged later, see
        detect.incremental). `shift_of(corrections)` gives the shift of `rows`. Returns the
        (domain, window) pairs put back on raw clocks and a note for each decision."""
        raw = np.zeros(len(self.rows), dtype=np.int64)
        domain = of_rank[self.rank]
        shift = shift_of(corrections)
        kept: set[tuple[int, int]] = set()
        notes: list[str] = []
        for window in sorted(windows):
            before, after = self.figures(raw, window, exact=True), self.figures(shift, window, exact=True)
            made_worse = worse(after, before)
            if not made_worse:
                continue
            candidates = [d for (d, w), value in corrections.items() if w == window and any(value)]
            in_window = self.window == window
            chosen: list[int] = []
            if len(candidates) > GREEDY_HOSTS:
                # Too many to try one by one: the smallest corrections (noise, likeliest) go first,
                # as few as a bisection finds enough; all of them, the raw clocks, always are.
                candidates.sort(key=lambda d: abs(corrections[(d, window)][0]))
                order = np.full(max(int(domain.max(initial=-1)), max(candidates)) + 1, len(candidates))
                order[candidates] = np.arange(len(candidates))
                row_order = np.where(in_window, order[domain], len(candidates))

                def enough(count: int) -> bool:
                    return not worse(self.figures(np.where(row_order < count, 0, shift), window, exact=True), before)

                low, high = 0, len(candidates)
                while low < high:
                    middle = (low + high) // 2
                    low, high = (low, middle) if enough(middle) else (middle + 1, high)
                chosen = candidates[:high] if enough(high) else candidates
            else:
                trial = shift
                while candidates and worse(after, before):
                    best = min(candidates, key=lambda d: _excess(self.figures(
                        np.where(in_window & (domain == d), 0, trial), window, exact=True), before))
                    candidates.remove(best)
                    chosen.append(best)
                    trial = np.where(in_window & (domain == best), 0, trial)
                    after = self.figures(trial, window, exact=True)
            listed = [f"{labels[d]} ({corrections[(d, window)][0]:.1f} us)" for d in chosen]
            notes.append(f"window {window}: the fitted corrections made the {' and '.join(made_worse)} worse than the "
                         f"raw clocks; raw clocks kept for " + ", ".join(listed[:8])
                         + (f" and {len(listed) - 8} more" if len(listed) > 8 else ""))
            for d in chosen:
                corrections[(d, window)] = (0.0, 0.0)
                kept.add((d, window))
            shift = shift_of(corrections)
        if whole and worse(self.figures(shift, exact=True), self.figures(raw, exact=True)):
            for key, value in corrections.items():
                if any(value):
                    corrections[key] = (0.0, 0.0)
                    kept.add(key)
            notes.append("the corrections together made the whole trace's figures worse: every clock kept raw")
        return kept, notes


def summarize(spread: np.ndarray, violated: np.ndarray, exact: bool = False) -> dict:
    """The figures of collective finish spreads (ns) and P2P causality breaks (Judge.measures)."""
    result = {"collective_instances": int(len(spread)), "finish_spread_us_median": None,
              "finish_spread_us_p95": None, "p2p_messages": int(len(violated)),
              "causality_violations": int(violated.sum())}
    if len(spread):
        median, p95 = float(np.median(spread)) / 1e3, float(np.percentile(spread, 95)) / 1e3
        result["finish_spread_us_median"] = median if exact else round(median, 3)
        result["finish_spread_us_p95"] = p95 if exact else round(p95, 3)
    return result


# Operations whose every participant needs every other's input, so none finishes on one rank
# before all members started it (broadcast, reduce, gather and scatter depend on their root only).
ALL_DEPENDENT = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
                           "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
                           "barrier", "monitored_barrier", "all_gather_single", "reduce_scatter_single"})
# Timestamps, and the reference pairs that make them wall clock, are good to a few µs; a bound is
# the least of many differences of them, so noise alone breaks it by a few µs, never by this much.
TOLERANCE_US = 20.0
MAX_HOSTS = 32  # an instance spanning more hosts gives no bounds: its pairs grow with the square
# The middle of a two-sided bound is off by at most half its width; a fit whose anchors scatter by
# sigma is often off by about sigma where the anchors' model fails (late-observed finishes), with
# no bound at all. The bound's middle wins where half its width is below this many sigma.
SCATTERS = 2.0


class Causality:
    """Bounds `x[b] - x[a] <= U` on the corrections of two clocks (µs), per window, that hold
    whatever the load: a message is never received before it was sent (send start -> receive
    end), and an all-reduce-like collective never finishes on one rank before every member
    started it. The anchors' model (members finish together) is only a model; a fit it misleads
    shows as a broken bound, and the fastest messages each way bound the offset to within their
    latencies (the NTP estimate takes the middle)."""

    def __init__(self, trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks | None, of_rank: np.ndarray):
        c = trace.columns
        self.c, self.of_rank = c, of_rank
        dependent = [i for i, name in enumerate(trace.names) if name in ALL_DEPENDENT]
        usable = collectives.synchronous & ~collectives.op_mismatch
        rows = np.flatnonzero(collectives.row_instance >= 0)
        rows = rows[usable[collectives.row_instance[rows]] & np.isin(c["name"][rows], dependent)]
        instance, domain = collectives.row_instance[rows], of_rank[c["rank"][rows]]
        order = np.lexsort((domain, instance))
        self.coll, self.instance, self.domain = rows[order], instance[order], domain[order]
        empty = np.zeros(0, dtype=np.int64)
        self.send = p2p.send_rows if p2p is not None else empty
        self.recv = p2p.recv_rows if p2p is not None else empty

    def bounds(self, shift: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[np.ndarray, ...]:
        """(window, a, b, U µs), the tightest per (window, a, b), on times less `shift(rows, times)` ns."""
        c, parts = self.c, []
        send_start = c["start"][self.send] - shift(self.send, c["start"][self.send])
        recv_end = c["end"][self.recv] - shift(self.recv, c["end"][self.recv])
        parts.append((c["window"][self.recv], self.of_rank[c["rank"][self.send]], self.of_rank[c["rank"][self.recv]],
                      recv_end - send_start))
        if len(self.coll):
            start = c["start"][self.coll] - shift(self.coll, c["start"][self.coll])
            end = c["end"][self.coll] - shift(self.coll, c["end"][self.coll])
            first = np.flatnonzero(np.concatenate([[True], (self.instance[1:] != self.instance[:-1])
                                                   | (self.domain[1:] != self.domain[:-1])]))
            latest_start, earliest_end = np.maximum.reduceat(start, first), np.minimum.reduceat(end, first)
            group_instance, group_domain = self.instance[first], self.domain[first]
            group_window = c["window"][self.coll][first]
            _, at, hosts = np.unique(group_instance, return_index=True, return_counts=True)
            for count in np.unique(hosts[(hosts >= 2) & (hosts <= MAX_HOSTS)]).tolist():
                parts.extend(_pair_bounds(at[hosts == count][:, None] + np.arange(count)[None, :], group_domain,
                                          group_window, latest_start, earliest_end))
        window, a, b, bound = (np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(4))
        other = a != b
        window, a, b, bound = window[other], a[other], b[other], bound[other]
        if not len(a):
            return window, a, b, bound / 1e3
        order = np.lexsort((b, a, window))
        window, a, b, bound = window[order], a[order], b[order], bound[order]
        first = np.flatnonzero(np.concatenate([[True], (window[1:] != window[:-1]) | (a[1:] != a[:-1])
                                               | (b[1:] != b[:-1])]))
        return window[first], a[first], b[first], np.minimum.reduceat(bound, first) / 1e3

    def respect(self, corrections: dict[tuple[int, int], tuple[float, float]], references: set[tuple[int, int]],
                shift: Callable[[np.ndarray, np.ndarray], np.ndarray], labels: list[str], windows: set[int],
                scales: dict[tuple[int, int], float]) -> list[str]:
        """Check the fitted corrections of `windows` (`shift`: their drift part) against the bounds.
        A fit that breaks one is not trusted, drift included: the raw clocks stay if they break
        none, else the offsets come from the middle of each pair of clocks' two-sided bound on the
        raw times. A fit that breaks none still gives way where half a two-sided bound is below
        SCATTERS x the anchors' own scatter (`scales`, the fit's robust residual scale, µs): the
        middle of that bound is then the better estimate (off by at most half the bound). Middles are combined
        by least squares (references fixed), then moved the least way into every bound. Returns
        a note per window changed."""
        notes = []
        fitted, plain = self.bounds(shift), None
        for window in sorted(set(np.unique(fitted[0]).tolist()) & windows):
            x = np.zeros(len(labels))
            present = np.zeros(len(labels), dtype=bool)
            for (d, w), (offset, _) in corrections.items():
                if w == window:
                    x[d], present[d] = offset, True
            m = (fitted[0] == window) & present[fitted[1]] & present[fitted[2]]
            if not m.any():
                continue
            broke = (x[fitted[2][m]] - x[fitted[1][m]] - fitted[3][m]).max() > TOLERANCE_US
            if broke:
                plain = plain or self.bounds(lambda rows, times: np.zeros(len(rows), dtype=np.int64))
                m = (plain[0] == window) & present[plain[1]] & present[plain[2]]
                a, b, bound = plain[1][m], plain[2][m], plain[3][m]
                if bound.min() >= -TOLERANCE_US:
                    # The raw clocks break no bound: nothing proves them wrong, so they stay.
                    for d in np.flatnonzero(present).tolist():
                        corrections[(d, window)] = (0.0, 0.0)
                    notes.append(f"window {window}: the anchor fit broke causality (a receive before its send, or a "
                                 f"collective finished before a member started it) and the raw clocks do not: kept raw")
                    continue
            else:
                a, b, bound = fitted[1][m], fitted[2][m], fitted[3][m]
            upper = dict(zip(zip(a.tolist(), b.tolist()), bound.tolist()))
            # Both ways bounded: the interval [-U(b->a), U(a->b)] for x[b] - x[a]; an empty one
            # (contradictory times, e.g. a clock stepped inside the window) is left out.
            pairs = [(i, j, (u - upper[(j, i)]) / 2, u + upper[(j, i)]) for (i, j), u in upper.items()
                     if (j, i) in upper and i < j]
            broken = {(i, j) for i, j, _, width in pairs if width < -TOLERANCE_US}
            pairs = [p for p in pairs if (p[0], p[1]) not in broken]
            if not broke:
                # ... and only where the fit sits in the bound's outer halves, i.e. would have the
                # fastest messages one way over three times as fast as the other way's.
                pairs = [p for p in pairs if p[3] / 2 < SCATTERS * min(scales.get((p[0], window), 0.0),
                                                                       scales.get((p[1], window), 0.0))
                         and abs(x[p[1]] - x[p[0]] - p[2]) > p[3] / 4]
                if not pairs:
                    continue
            keep = np.array([(i, j) not in broken and (j, i) not in broken for i, j in zip(a.tolist(), b.tolist())])
            a, b, bound = a[keep], b[keep], bound[keep]
            fixed = np.array([(d, window) in references for d in range(len(labels))])
            x = _middle(x, pairs, fixed)
            for _ in range(100):
                gap = x[b] - x[a] - bound
                if not len(gap) or gap.max() <= TOLERANCE_US / 2:
                    break
                for k in np.flatnonzero(gap > TOLERANCE_US / 2).tolist():
                    g = x[b[k]] - x[a[k]] - bound[k]
                    if g > 0 and not (fixed[a[k]] and fixed[b[k]]):
                        share = 1.0 if fixed[a[k]] or fixed[b[k]] else 0.5
                        x[b[k]] -= 0.0 if fixed[b[k]] else g * share
                        x[a[k]] += 0.0 if fixed[a[k]] else g * share
            moved = []
            for d in np.flatnonzero(present).tolist():
                offset, drift = corrections[(d, window)]
                corrections[(d, window)] = (float(x[d]), 0.0 if broke else drift)
                if abs(x[d] - offset) > 0.05 or broke and drift:
                    moved.append(f"{labels[d]} {offset:.1f} -> {x[d]:.1f} us"
                                 + (f" (drift {drift:.1f} ppm dropped)" if broke and drift else ""))
            listed = ", ".join(moved[:8]) + (f" and {len(moved) - 8} more" if len(moved) > 8 else "")
            if broke:
                notes.append(f"window {window}: the anchor fit broke causality (a receive before its send, or a "
                             f"collective finished before a member started it); offsets from the causality bounds "
                             f"instead: {listed}")
            elif moved:
                notes.append(f"window {window}: causality bounds narrower than the anchors' scatter; offsets from "
                             f"their middle: {listed}")
            if broken:
                notes.append(f"window {window}: contradictory times between hosts "
                             + ", ".join(f"{labels[i]} and {labels[j]}" for i, j in sorted(broken)))
        return notes


def _pair_bounds(groups: np.ndarray, domain: np.ndarray, window: np.ndarray, latest_start: np.ndarray,
                 earliest_end: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """The collective bounds of instances with one host count: `groups` [instances, hosts] indexes
    their (instance, host) groups. Per ordered pair of hosts, a bound is the least over instances
    of one host's earliest finish less the other's latest start; instances with the same hosts
    and windows (a TP group's thousands of all-reduces) give one bound per pair, taken as a
    minimum over the instances, so no pair list grows with the iterations."""
    hosts = groups.shape[1]
    keys = np.concatenate([domain[groups], window[groups]], axis=1)
    order = np.lexsort(keys.T[::-1])
    groups, keys = groups[order], keys[order]
    first = np.flatnonzero(np.concatenate([[True], (keys[1:] != keys[:-1]).any(axis=1)]))
    end, start = earliest_end[groups], latest_start[groups]
    sets_domain, sets_window = keys[first, :hosts], keys[first, hosts:]
    parts = []
    for i in range(hosts):
        least = np.minimum.reduceat(end - start[:, i:i + 1], first, axis=0)  # [sets, hosts]: to each host b
        parts.append((np.repeat(sets_window[:, i], hosts), np.repeat(sets_domain[:, i], hosts),
                      sets_domain.ravel(), least.ravel()))
    return parts


def _middle(x: np.ndarray, pairs: list[tuple[int, int, float, float]], fixed: np.ndarray) -> np.ndarray:
    """Least squares over the pairs x[j] - x[i] ~ middle, weighted by 1 / half-width², the fixed
    clocks held and every other clock held very lightly at its start (`x`), so that a set of
    clocks the pairs tie to no fixed one keeps its level (damped Jacobi sweeps: a job spans few hosts)."""
    if not pairs:
        return x
    i, j, middle, width = (np.array(column) for column in zip(*pairs))
    i, j = i.astype(np.int64), j.astype(np.int64)
    weight = 1.0 / np.maximum(width / 2, 1.0) ** 2
    hold = 1e-6 * float(weight.max())
    start, free = x.copy(), ~fixed
    for _ in range(10_000):
        total = np.bincount(j, weight * (x[i] + middle), len(x)) + np.bincount(i, weight * (x[j] - middle), len(x))
        norm = np.bincount(j, weight, len(x)) + np.bincount(i, weight, len(x))
        new = np.where(free & (norm > 0), 0.5 * x + 0.5 * (total + hold * start) / (norm + hold), x)
        if np.abs(new - x).max() < 1e-4:
            return new
        x = new
    return x
