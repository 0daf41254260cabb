"""The detectors' input: compact per-rank tables (compute instances, collective arrivals, P2P
messages, iteration times) built from an aligned aggregation or from online window summaries."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron.scan.keys import unique_rows  # noqa: F401  (the analyzers' import of it)
from megatron.scan.speed import COMPUTE_SPANS
from megatron.scan.trace_format import FLAG_ASYNC, FLAG_BACKWARD, FLAG_INSTANT

# Spans during which a rank waits for others or moves data; the time between them is its own work.
WAIT_KINDS = ("recv", "send", "data", "grad_sync", "optimizer")


@dataclass(kw_only=True)
class RankRole:
    rank: int
    dp: int
    pp: int
    tp: int
    host: str = ""
    role: str = ""  # MegaFBD's "fwd"/"bwd": the two instances of one coordinate do different work

    @property
    def coordinates(self) -> str:
        return f"{self.dp}-{self.pp}-{self.tp}" + (f" {self.role}" if self.role else "")

    @property
    def stage(self) -> tuple[int, str]:
        """Ranks with the same stage run the same tasks, so they are each other's peers."""
        return self.pp, self.role


@dataclass(kw_only=True)
class DetectionInput:
    """All times in ns on one (aligned) clock. Arrays of one table have equal length."""

    roles: dict[int, RankRole]
    sizes: dict[str, int]
    # compute instances: one row per forward/backward task of a rank
    compute: dict[str, np.ndarray]  # rank, iteration, kind (0 F, 1 B), chunk, microbatch, start, busy
    # collective participations: one row per (instance, rank)
    collectives: dict[str, np.ndarray]  # instance, rank, arrive, end, group_size, kind (index into group_kinds), iteration
    group_kinds: list[str]
    # matched P2P messages
    p2p: dict[str, np.ndarray]  # src, dst, iteration, backward, send_start, send_end, recv_start, recv_end, bytes
    iteration_time: dict[str, np.ndarray]  # rank, iteration, start, end
    # per transformer layer call (--trace-granularity full): busy = span minus the collectives and
    # async-collective waits inside it
    layers: dict[str, np.ndarray] = field(default_factory=lambda: _empty(LAYER_COLUMNS))
    # per traced iteration, where the tracer could read them: CPU time and run-queue wait (ms)
    host: dict[str, np.ndarray] = field(default_factory=lambda: _empty_float(HOST_COLUMNS))
    # per rank with NVML readings (CUDA ranks with nvidia-ml-py): gpu_counters.summarize of its iterations
    gpu: dict[int, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # Collective instances already resolved where their members' rows were (per-node summaries,
    # megatron.scan.detect.summary): {"stats": collective.STAT_COLUMNS table, "late":
    # collective.LATE_COLUMNS table, "instances": count}; None when every instance is in `collectives`.
    arrivals: dict | None = None
    # Per-node reductions of a large job (megatron.scan.detect.reference, summary): each rank's
    # compute comparison (compute.reduce_compute) and each P2P link's (p2p.reduce_links), made on
    # the ranks' nodes; `compute`, `layers` and `p2p` then hold the reference ranks' rows only
    # (P2P: the messages they received). None: every rank's rows are here. The window-by-window
    # input (detect.incremental) also sets compute_stats, joined from its windows', beside every
    # rank's rows.
    compute_stats: dict | None = None
    link_stats: dict | None = None

    @property
    def world(self) -> list[int]:
        return sorted(self.roles)

    def label(self, rank: int) -> str:
        r = self.roles[rank]
        return f"rank {rank} (DP{r.dp}-PP{r.pp}-TP{r.tp}{' ' + r.role if r.role else ''})"


def _empty(names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {n: np.zeros(0, dtype=np.int64) for n in names}


COMPUTE_COLUMNS = ("rank", "iteration", "kind", "chunk", "microbatch", "start", "busy")
COLLECTIVE_COLUMNS = ("instance", "rank", "arrive", "end", "group_size", "kind")
P2P_COLUMNS = ("src", "dst", "iteration", "backward", "send_start", "send_end", "recv_start", "recv_end", "bytes")
ITERATION_COLUMNS = ("rank", "iteration", "start", "end")
HOST_COLUMNS = ("rank", "iteration", "cpu_ms", "cpu_wait_ms", "main_cpu_ms", "main_wait_ms")
LAYER_COLUMNS = ("rank", "iteration", "kind", "layer", "busy")


def table_rows(table: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    """The same rows (a mask or indices) of every column of a table."""
    return {name: column[rows] for name, column in table.items()}


def nested_busy(rank: np.ndarray, start: np.ndarray, end: np.ndarray, rows: np.ndarray,
                waits: np.ndarray) -> np.ndarray:
    """Duration of each span in `rows` minus its overlap with the `waits` rows of the same rank."""
    busy = (end[rows] - start[rows]).astype(np.int64)
    if not len(rows) or not len(waits):
        return busy
    low, span = _time_span(start, end)
    for first, last in _rank_blocks(rank, span):
        these = np.flatnonzero((rank[rows] >= first) & (rank[rows] < last))
        w = waits[(rank[waits] >= first) & (rank[waits] < last)]
        if not len(these) or not len(w):
            continue
        axis = (rank - first).astype(np.int64) * span
        order = w[np.argsort(axis[w] + (start[w] - low), kind="stable")]
        own, begin, stop = axis[rows[these]], start[rows[these]] - low, end[rows[these]] - low
        waited = _overlap(own, begin, begin, stop, axis[order] + (start[order] - low), start[order] - low,
                          end[order] - low)
        busy[these] = np.maximum(busy[these] - waited, 1)
    return busy


def _empty_float(names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {n: np.zeros(0, dtype=np.float64) for n in names}


def host_table(windows: dict[int, list[dict]]) -> dict[str, np.ndarray]:
    """The per-iteration host counters the tracer put in each window's metrics."""
    # The training thread's own counters are NaN in traces written before they were recorded.
    rows = [(rank, m["iteration"], m["cpu_ms"], m["cpu_wait_ms"], m.get("main_cpu_ms", np.nan),
             m.get("main_wait_ms", np.nan))
            for rank, ws in windows.items() for w in ws
            for m in w.get("metrics") or [] if "cpu_wait_ms" in m and "iteration" in m]
    if not rows:
        return _empty_float(HOST_COLUMNS)
    table = np.array(rows, dtype=np.float64)
    return {name: table[:, i] for i, name in enumerate(HOST_COLUMNS)}


def gpu_summaries(windows: dict[int, list[dict]]) -> dict[int, dict]:
    """Per rank, what its GPU's NVML readings over the traced iterations say (gpu_counters.summarize)."""
    from megatron.scan.gpu_counters import summarize

    out = {}
    for rank, ws in windows.items():
        summary = summarize([m for w in ws for m in w.get("metrics") or []])
        if summary is not None:
            out[rank] = summary
    return out


def busy_compute(rank: np.ndarray, name: np.ndarray, start: np.ndarray, end: np.ndarray, flags: np.ndarray,
                 group: np.ndarray, compute_ids: np.ndarray, wait_ids: np.ndarray,
                 not_before: np.ndarray | None = None,
                 inner_wait_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Busy time of every compute span: from its start to the next non-nested event of the same rank,
    minus the synchronous collectives and the waits on async collectives (`inner_wait_ids`)
    inside. The trailing gap counts because work the tracer does
    not see (an interfering kernel, a slowdown injected after the span) still delays the rank;
    collectives are subtracted because a rank waiting for a slow TP peer is not slow.
    `not_before` (per compute row, same order as the returned rows) moves a span's start later:
    a TP group's task cannot progress before its last member starts it, and waiting for that
    member inside the span (an async all-reduce waited on mid-backward) is not traced.
    Returns (rows of compute spans, busy ns)."""
    rows = np.flatnonzero(np.isin(name, compute_ids))
    busy = np.zeros(len(rows), dtype=np.int64)
    instant = (flags & FLAG_INSTANT) > 0
    boundary = np.isin(name, np.concatenate([compute_ids, wait_ids])) & ~instant
    synchronous_collective = (group >= 0) & ((flags & FLAG_ASYNC) == 0) & ~instant
    if inner_wait_ids is not None and len(inner_wait_ids):
        synchronous_collective |= np.isin(name, inner_wait_ids) & ~instant
    b = np.flatnonzero(boundary)
    cr = np.flatnonzero(synchronous_collective)
    if not len(rows):
        return rows, busy
    # Every rank's events on one axis, rank by rank (rank x span + time), so that one sorted
    # search finds each span's next boundary and its collectives among its own rank's: a loop
    # over ranks cost ranks x events (41 s at 4,096 ranks).
    low, span = _time_span(start, end)
    for first, last in _rank_blocks(rank, span):
        these = np.flatnonzero((rank[rows] >= first) & (rank[rows] < last))
        if len(these):
            busy[these] = _busy(rows[these], b[(rank[b] >= first) & (rank[b] < last)],
                                cr[(rank[cr] >= first) & (rank[cr] < last)], rank - first,
                                start - low, end - low, span,
                                None if not_before is None else not_before[these] - low)
    return rows, busy


def _time_span(start: np.ndarray, end: np.ndarray) -> tuple[int, int]:
    """(earliest time, span of the times): times less the first fall in [0, span)."""
    low = int(min(start.min(), end.min()))
    return low, int(max(start.max(), end.max())) - low + 1


def _rank_blocks(rank: np.ndarray, span: int) -> list[tuple[int, int]]:
    """[first, last) rank blocks few enough that rank x span + time fits in int64 (one block unless
    the trace spans centuries of nanoseconds)."""
    at_once = max(1, 2 ** 62 // span)
    return [(first, first + at_once) for first in range(0, int(rank.max()) + 1, at_once)]


def _busy(rows: np.ndarray, b: np.ndarray, cr: np.ndarray, rank: np.ndarray, start: np.ndarray, end: np.ndarray,
          span: int, not_before: np.ndarray | None) -> np.ndarray:
    """busy_compute for `rows` with their ranks' boundary rows `b` and collective rows `cr`
    (times from 0, below `span`; ranks from 0, few enough that rank x span fits in int64)."""
    axis = rank.astype(np.int64) * span
    b_key = np.sort(axis[b] + start[b], kind="stable")
    c_order = cr[np.argsort(axis[cr] + start[cr], kind="stable")]
    c_key = axis[c_order] + start[c_order]
    c_start, c_end = start[c_order], end[c_order]
    own = axis[rows]
    nxt = np.searchsorted(b_key, own + end[rows], side="left")
    found = nxt < len(b_key)
    found[found] = (b_key[nxt[found]] - own[found]) < span  # the next boundary is the same rank's
    stop = np.where(found, b_key[np.minimum(nxt, len(b_key) - 1)] - own, end[rows])
    begin = start[rows] if not_before is None else np.minimum(np.maximum(start[rows], not_before), stop)
    waited = _overlap(own, start[rows], begin, stop, c_key, c_start, c_end)
    return np.maximum(stop - begin - waited, 1).astype(np.int64)


def _overlap(own: np.ndarray, first: np.ndarray, begin: np.ndarray, stop: np.ndarray, key: np.ndarray,
             w_start: np.ndarray, w_end: np.ndarray) -> np.ndarray:
    """Per span, the time within [begin, stop) covered by the waits (sorted `key`: rank axis +
    start) of its own rank (`own`: its rank's axis) that start in [first, stop)."""
    lo = np.searchsorted(key, own + first, "left")
    hi = np.searchsorted(key, own + stop, "left")
    count = np.maximum(hi - lo, 0)
    owner = np.repeat(np.arange(len(own)), count)
    inside = np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count) + lo[owner]
    # Clipped to the span's window: a wait running past it is not this span's.
    overlap = np.clip(np.minimum(w_end[inside], stop[owner]) - np.maximum(w_start[inside], begin[owner]), 0, None)
    # Summed as floats, exact for integers below 2^53 ns (104 days of waiting in one span)
    return np.bincount(owner, weights=overlap, minlength=len(own)).astype(np.int64)


def _tensor_parallel_start(c: dict[str, np.ndarray], rows: np.ndarray, roles: dict[int, RankRole]) -> np.ndarray:
    """Per compute row, the latest start of the same task (iteration, kind, chunk, microbatch) among
    the members of its TP group (same DP and PP coordinates)."""
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    ranks = c["rank"][rows].astype(np.int64)
    # Coordinates by rank through one lookup table, not a dictionary lookup per row.
    coordinate = np.zeros((int(max(max(roles), ranks.max())) + 1, 2), dtype=np.int64)
    for r, role in roles.items():
        coordinate[r] = (role.dp, role.pp)
    dp_pp = coordinate[ranks]
    key = np.stack([dp_pp[:, 0], dp_pp[:, 1], c["iteration"][rows], c["name"][rows], c["chunk"][rows],
                    c["microbatch"][rows]], axis=1)
    _, inverse = unique_rows(key)
    latest = np.full(inverse.max() + 1, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(latest, inverse, c["start"][rows].astype(np.int64))
    return latest[inverse]


def roles_of(headers: dict[int, dict[str, Any]]) -> dict[int, RankRole]:
    """Each rank's place in the job, from its trace file's header."""
    return {r: RankRole(rank=r, host=str(h.get("host", "")), role=str(h.get("role", "") or ""),
                        **{k: int(h["coordinates"][k]) for k in ("dp", "pp", "tp")})
            for r, h in headers.items()}


def from_aggregation(aggregation: Any) -> DetectionInput:
    """Tables from an `Aggregation` (loaded, matched and clock-aligned trace directory)."""
    trace, collectives, p2p = aggregation.trace, aggregation.collectives, aggregation.p2p
    c = trace.columns
    roles = roles_of(trace.ranks)
    first = next(iter(trace.ranks.values()))
    sizes = {k: int(first["sizes"][k]) for k in ("dp", "pp", "tp")}
    compute_ids = trace.ids(COMPUTE_SPANS)
    wait_ids = trace.ids(WAIT_KINDS)
    rows = np.flatnonzero(np.isin(c["name"], compute_ids))
    rows, busy = busy_compute(c["rank"], c["name"], c["start"], c["end"], c["flags"], c["group"], compute_ids,
                              wait_ids, not_before=_tensor_parallel_start(c, rows, roles),
                              inner_wait_ids=trace.ids(("collective_wait",)))
    backward_id = trace.name_id("backward")
    compute = {"rank": c["rank"][rows].astype(np.int64), "iteration": c["iteration"][rows].astype(np.int64),
               "kind": (c["name"][rows] == backward_id).astype(np.int64), "chunk": c["chunk"][rows].astype(np.int64),
               "microbatch": c["microbatch"][rows].astype(np.int64), "start": c["start"][rows], "busy": busy}
    # Collectives: complete, synchronous instances with two or more members only.
    keep_instance = collectives.complete & collectives.synchronous & (collectives.members >= 2) & ~collectives.op_mismatch
    crow = np.flatnonzero(collectives.row_instance >= 0)
    crow = crow[keep_instance[collectives.row_instance[crow]]]
    kinds = sorted({g.get("desc") or g.get("name", "?") for g in trace.groups}) if trace.groups else []
    kind_of_group = np.array([kinds.index(g.get("desc") or g.get("name", "?")) for g in trace.groups] + [-1], np.int64)
    inst = collectives.row_instance[crow]
    coll = {"instance": inst, "rank": c["rank"][crow].astype(np.int64), "arrive": c["start"][crow],
            "end": c["end"][crow], "group_size": collectives.expected[inst].astype(np.int64),
            "kind": kind_of_group[collectives.group[inst]], "iteration": c["iteration"][crow].astype(np.int64)}
    s, r = p2p.send_rows, p2p.recv_rows
    messages = {"src": c["rank"][s].astype(np.int64), "dst": c["rank"][r].astype(np.int64),
                "iteration": c["iteration"][r].astype(np.int64),
                "backward": ((c["flags"][r] & FLAG_BACKWARD) > 0).astype(np.int64),
                "send_start": c["start"][s], "send_end": c["end"][s], "recv_start": c["start"][r],
                "recv_end": c["end"][r], "bytes": c["bytes"][r].astype(np.int64)}
    layer_rows = np.flatnonzero(np.isin(c["name"], trace.ids(("layer_forward", "layer_backward"))))
    waits = np.flatnonzero((((c["group"] >= 0) & ((c["flags"] & FLAG_ASYNC) == 0))
                            | np.isin(c["name"], trace.ids(("collective_wait",)))) & ((c["flags"] & FLAG_INSTANT) == 0))
    layers = {"rank": c["rank"][layer_rows].astype(np.int64), "iteration": c["iteration"][layer_rows].astype(np.int64),
              "kind": (c["name"][layer_rows] == trace.name_id("layer_backward")).astype(np.int64),
              "layer": c["layer"][layer_rows].astype(np.int64),
              "busy": nested_busy(c["rank"], c["start"], c["end"], layer_rows, waits)}
    it = np.flatnonzero(c["name"] == trace.name_id("iteration")) if trace.name_id("iteration") >= 0 else np.zeros(0, int)
    iterations = {"rank": c["rank"][it].astype(np.int64), "iteration": c["iteration"][it].astype(np.int64),
                  "start": c["start"][it], "end": c["end"][it]}
    return DetectionInput(roles=roles, sizes=sizes, compute=compute, collectives=coll, group_kinds=kinds, p2p=messages,
                          iteration_time=iterations, layers=layers, host=host_table(getattr(trace, "windows", {}) or {}),
                          gpu=gpu_summaries(getattr(trace, "windows", {}) or {}), warnings=list(trace.warnings))
