"""Chrome trace JSON (chrome://tracing, Perfetto UI): one process per rank named
`DP{d}-PP{p}-TP{t} (rank g)`, threads for compute / P2P / collectives, complete events with
their args, and flow arrows send -> receive and last arriver -> every other participant."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from megatron.app.progress import SILENT, Progress, Reporter
from megatron.scan.load import GlobalTrace
from megatron.scan.match import Collectives, P2PLinks
from megatron.scan.trace_format import FLAG_ASYNC, FLAG_BACKWARD

THREADS = {1: "compute", 2: "p2p", 3: "collectives", 4: "async collectives"}
_P2P = {"send", "recv"}
CATEGORY = {"iteration": "step", "data": "data", "forward": "compute", "backward": "compute",
            "backward_weight": "compute", "layer_forward": "layer", "layer_backward": "layer", "grad_sync": "step", "optimizer": "step",
             "send": "p2p", "recv": "p2p", "collective_wait": "collective"}


def _group_label(group: dict[str, Any]) -> str:
    ranks = group["ranks"]
    desc = group["desc"].replace("_GROUP", "").lower() if group["desc"] else group["name"]
    shown = ",".join(map(str, ranks)) if len(ranks) <= 16 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"
    return f"{desc} [{shown}]"


def _us(ns: np.ndarray | int) -> np.ndarray:
    return np.round(np.asarray(ns, dtype=np.float64) / 1e3, 3)


def write_chrome_trace(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks, path: str | os.PathLike,
                       other_data: dict[str, Any] | None = None, progress: Reporter = SILENT) -> dict[str, int]:
    """Stream the trace to `path` (written to a temporary name, then renamed). Returns counts."""
    c = trace.columns
    # Progress counts events, then flow arrows: one per P2P link, one per collective row at most.
    total = len(trace) + len(p2p.send_rows) + int(np.count_nonzero(collectives.row_instance >= 0))
    base = int(c["start"].min() // 1_000_000 * 1_000_000) if len(trace) else 0
    temporary = f"{path}.tmp"
    counts = {"events": 0, "flows": 0}
    with open(temporary, "w") as out, progress.step("writing the merged trace", total, unit=" events") as step:
        out.write('{"traceEvents":[\n')
        first = [True]

        def emit(event: dict[str, Any]) -> None:
            out.write(("" if first[0] else ",\n") + json.dumps(event, separators=(",", ":")))
            first[0] = False

        _metadata(trace, emit)
        counts["events"] = _complete_events(trace, collectives, p2p, base, emit, step)
        counts["flows"] = _flows(trace, collectives, p2p, base, emit, step)
        counts["counters"] = _microbatch_counters(trace, base, emit)
        counts["restarts"] = _restart_markers(trace, base, emit)
        step.set(total)
        out.write("\n],\n")
        tail = {"displayTimeUnit": "ms",
                "otherData": {"time_base_unix_ns": base, "producer": "megatron.scan", **(other_data or {})}}
        out.write(json.dumps(tail)[1:])
    os.replace(temporary, path)
    return counts


def _metadata(trace: GlobalTrace, emit) -> None:
    for rank in sorted(trace.ranks):
        emit({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": trace.label(rank)}})
        emit({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, name in THREADS.items():
            emit({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
            emit({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})


def microbatch_counts(trace: GlobalTrace):
    """(rank, start ns of the iteration, microbatches) of every traced iteration whose metrics
    say how many of the global batch's microbatches the rank's replica ran (it changes where
    straggler mitigation moved work), ranks in order: the "microbatches" counter track."""
    c = trace.columns
    if "iteration" not in trace.names:
        return
    spans = c["name"] == trace.name_id("iteration")
    starts = {(int(r), int(i)): int(t) for r, i, t in zip(c["rank"][spans], c["iteration"][spans], c["start"][spans])}
    for rank, windows in sorted(trace.windows.items()):
        for window in windows:
            for record in window.get("metrics") or []:
                start = starts.get((rank, record.get("iteration")))
                if start is not None and record.get("microbatches") is not None:
                    yield rank, start, record["microbatches"]


def _microbatch_counters(trace: GlobalTrace, base: int, emit) -> int:
    """A "microbatches" counter track per rank (microbatch_counts)."""
    emitted = 0
    for rank, start, microbatches in microbatch_counts(trace):
        emit({"ph": "C", "name": "microbatches", "pid": rank, "ts": float(_us(start - base)),
              "args": {"microbatches": microbatches}})
        emitted += 1
    return emitted


def _restart_markers(trace: GlobalTrace, base: int, emit) -> int:
    """Where torchrun restarted the job (`--max-restarts`): a marker on each rank's track at the
    restarted process's start, naming the attempt and the iteration it resumed from."""
    emitted = 0
    for rank, header in sorted(trace.ranks.items()):
        for restart in header.get("restarts") or []:
            if restart.get("wall_ns") is None:
                continue
            emit({"ph": "i", "s": "p", "name": f"torchrun restart: attempt {restart.get('attempt')}, resumed at "
                                                f"iteration {restart.get('start_iteration')}",
                  "pid": rank, "tid": 1, "ts": float(_us(int(restart["wall_ns"]) - base)),
                  "args": {k: v for k, v in restart.items() if k != "path"}})
            emitted += 1
    return emitted


def thread_of(trace: GlobalTrace) -> np.ndarray:
    """The Chrome thread (tid) of each event row."""
    c = trace.columns
    tid = np.ones(len(trace), dtype=np.int64)
    tid[np.isin(c["name"], trace.ids(_P2P))] = 2
    collective = c["group"] >= 0
    tid[collective] = np.where((c["flags"][collective] & FLAG_ASYNC) > 0, 4, 3)
    tid[c["name"] == trace.name_id("collective_wait")] = 4  # waiting on an async collective's handle
    return tid


def _complete_events(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks, base: int, emit,
                     progress: Progress | None = None) -> int:
    c = trace.columns
    # A receive carries its message's transfer time (send posted -> receive complete) and the
    # effective bandwidth of that; the send span itself only measures posting the message.
    transfer_us = dict(zip(p2p.recv_rows.tolist(), _us(c["end"][p2p.recv_rows] - c["start"][p2p.send_rows]).tolist()))
    tid = thread_of(trace)
    ts = _us(c["start"] - base)
    dur = np.maximum(_us(c["end"] - c["start"]), 0.0)
    groups = [_group_label(g) for g in trace.groups]
    dtype_names = trace.names
    order = np.lexsort((c["start"], c["rank"]))
    columns = {k: c[k].tolist() for k in ("rank", "name", "iteration", "microbatch", "chunk", "layer", "bytes",
                                          "peer", "group", "seq", "flags", "dtype", "window")}
    instance = collectives.row_instance
    members = collectives.members.tolist()
    expected = collectives.expected.tolist()
    for n, i in enumerate(order.tolist()):
        if progress is not None and not n & 0xFFF:
            progress.update(4096 if n else 0)
        name = trace.names[columns["name"][i]]
        group = columns["group"][i]
        args: dict[str, Any] = {"iteration": columns["iteration"][i]}
        for key in ("microbatch", "chunk", "layer"):
            if columns[key][i] >= 0:
                args[key] = columns[key][i]
        size = columns["bytes"][i]
        if size >= 0:
            args["bytes"] = size
            elapsed = transfer_us.get(i) if columns["peer"][i] >= 0 else float(dur[i])
            if elapsed is not None and elapsed > 0:
                args["bandwidth_GBps"] = round(size / (elapsed * 1e3), 4)
            if i in transfer_us:
                args["transfer_us"] = transfer_us[i]
        if columns["peer"][i] >= 0:
            args["peer"] = columns["peer"][i]
            args["direction"] = "B" if columns["flags"][i] & FLAG_BACKWARD else "F"
        if group >= 0:
            args["group"] = groups[group]
            args["seq"] = columns["seq"][i]
            k = instance[i]
            args["participants"] = f"{members[k]}/{expected[k]}"
            if columns["flags"][i] & FLAG_ASYNC:
                args["async"] = True
        if columns["dtype"][i] >= 0:
            args["dtype"] = dtype_names[columns["dtype"][i]]
        category = CATEGORY.get(name, "collective" if group >= 0 else "other")
        emit({"name": name, "cat": category, "ph": "X", "pid": columns["rank"][i], "tid": int(tid[i]),
              "ts": float(ts[i]), "dur": float(dur[i]), "args": args})
    return len(order)


def _flows(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks, base: int, emit,
           progress: Progress | None = None) -> int:
    c = trace.columns
    tid = thread_of(trace)
    middle = _us((c["start"] + c["end"]) // 2 - base)
    rank = c["rank"]
    flow_id = 0
    if progress is not None:
        progress.set(len(trace))
    for send, recv in zip(p2p.send_rows.tolist(), p2p.recv_rows.tolist()):
        flow_id += 1
        if progress is not None and not flow_id & 0xFFF:
            progress.update(4096)
        emit({"ph": "s", "id": flow_id, "name": "p2p", "cat": "p2p", "pid": int(rank[send]), "tid": int(tid[send]),
              "ts": float(middle[send])})
        emit({"ph": "f", "bp": "e", "id": flow_id, "name": "p2p", "cat": "p2p", "pid": int(rank[recv]),
              "tid": int(tid[recv]), "ts": float(middle[recv])})
    rows = np.flatnonzero(collectives.row_instance >= 0)
    if len(rows):
        # Arrows start at the participant that arrived last (everybody waited for it).
        inst = collectives.row_instance[rows]
        order = np.lexsort((c["start"][rows], inst))
        rows, inst = rows[order], inst[order]
        boundaries = np.flatnonzero(np.concatenate([inst[1:] != inst[:-1], [True]]))
        starts = np.concatenate([[0], boundaries[:-1] + 1])
        for lo, hi in zip(starts.tolist(), boundaries.tolist()):
            if hi == lo:
                continue
            last = int(rows[hi])
            if progress is not None:
                progress.update(hi - lo + 1)
            for other in rows[lo:hi].tolist():
                flow_id += 1
                emit({"ph": "s", "id": flow_id, "name": "collective", "cat": "collective", "pid": int(rank[last]),
                      "tid": int(tid[last]), "ts": float(middle[last])})
                emit({"ph": "f", "bp": "e", "id": flow_id, "name": "collective", "cat": "collective",
                      "pid": int(rank[other]), "tid": int(tid[other]), "ts": float(middle[other])})
    return flow_id
