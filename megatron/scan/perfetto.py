"""Perfetto's native protobuf trace (`.pftrace`), for jobs whose Chrome JSON no browser opens, and
the focused view: only the suspects, their peers and pipeline neighbours and a sample of the rest.

The writer mirrors chrome.py: one process track per rank named `DP{d}-PP{p}-TP{t} (rank g)`, one
child track per lane of chrome.THREADS, every event a TYPE_SLICE_BEGIN/END pair with its args as
debug annotations and its category, names, categories, argument keys and repeated string values
interned once (InternedData), flows send -> receive and
between the participants of a collective, the microbatches counter and the restart markers. The
wire format is encoded here (varints and length-delimited fields; no protobuf package needed) and
streamed packet by packet: a `Trace` is a sequence of `packet` fields (field 1), so the file is
the concatenation of the encoded packets.

Differences from the Chrome trace, forced by the format: timestamps are ns after the trace's time
base (otherData's time_base_unix_ns, here an annotation of the "megascan" marker at time 0);
process pids are rank + 1 (pid 0 is the idle process to Perfetto); a slice that overlaps another
on its lane without nesting goes to an extra lane ("compute (2)"), since BEGIN/END slices must
nest; a flow runs from the earlier slice's begin to the later slice's end, because Perfetto binds
a flow when the slice opening it is read in time order: send -> receive as in Chrome, but a
collective's arrows point from each participant to the last arriver (who everybody waited for).
Over 400 lines: the encoder, the writer and the focused view's rank choice are one feature.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from typing import Any, Iterable

import numpy as np

from megatron.app.progress import SILENT, Reporter
from megatron.scan.chrome import CATEGORY, THREADS, microbatch_counts, thread_of
from megatron.scan.load import GlobalTrace
from megatron.scan.match import Collectives, P2PLinks
from megatron.scan.trace_format import FLAG_ASYNC, FLAG_BACKWARD

EXTENSIONS = (".pftrace", ".perfetto-trace")
TYPE_SLICE_BEGIN, TYPE_SLICE_END, TYPE_INSTANT, TYPE_COUNTER = 1, 2, 3, 4
SEQ_INCREMENTAL_STATE_CLEARED, SEQ_NEEDS_INCREMENTAL_STATE = 1, 2
SEQUENCE_ID = 1
META_TRACK = 1  # the "megascan" global track: summary and focus notes
MAX_OVERFLOW = 32  # extra lanes per lane before an overlapping slice is clamped into its parent


# --- wire format --------------------------------------------------------------------------------
def varint(value: int) -> bytes:
    """Base-128 varint; a negative int64 as its 10-byte two's complement, as protobuf does."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [varint(v) for v in range(1 << 14)]


def _v(value: int) -> bytes:
    return _SMALL[value] if 0 <= value < 16384 else varint(value)


def tag(field: int, wire: int) -> bytes:
    return _v(field << 3 | wire)


def uint_field(field: int, value: int) -> bytes:
    return tag(field, 0) + _v(value)


def bytes_field(field: int, payload: bytes | str) -> bytes:
    if isinstance(payload, str):
        payload = payload.encode()
    return tag(field, 2) + _v(len(payload)) + payload


def double_field(field: int, value: float) -> bytes:
    return tag(field, 1) + struct.pack("<d", value)


def fixed64_field(field: int, value: int) -> bytes:
    return tag(field, 1) + struct.pack("<Q", value)


# TracePacket / TrackEvent / TrackDescriptor / DebugAnnotation field numbers (perfetto_trace.proto).
_PACKET = b"\x0a"  # Trace.packet
_TIMESTAMP = tag(8, 0)
_TRACK_EVENT = tag(11, 2)
_SEQUENCE = uint_field(10, SEQUENCE_ID)
_INTERNED_USE = _SEQUENCE + uint_field(13, SEQ_NEEDS_INCREMENTAL_STATE)  # packets reading interned data
_BEGIN, _END, _INSTANT, _COUNTER = (uint_field(9, t) for t in (TYPE_SLICE_BEGIN, TYPE_SLICE_END, TYPE_INSTANT,
                                                                 TYPE_COUNTER))


def packet(body: bytes) -> bytes:
    return _PACKET + _v(len(body)) + body


def track_event_packet(ts: int, event: bytes, interned: bool = True) -> bytes:
    return packet(_TIMESTAMP + _v(ts) + _TRACK_EVENT + _v(len(event)) + event + (_INTERNED_USE if interned
                                                                                   else _SEQUENCE))


def track_descriptor(uuid: int, name: str, *, parent: int = 0, pid: int | None = None, order: int | None = None,
                     counter: bool = False, explicit_order: bool = False) -> bytes:
    body = uint_field(1, uuid)
    if pid is not None:
        body += bytes_field(3, uint_field(1, pid) + bytes_field(6, name))  # ProcessDescriptor pid, process_name
    else:
        body += bytes_field(2, name)
    if parent:
        body += uint_field(5, parent)
    if counter:
        body += bytes_field(8, b"")
    if explicit_order:
        body += uint_field(11, 3)  # child_ordering EXPLICIT
    if order is not None:
        body += uint_field(12, order)  # sibling_order_rank
    return packet(bytes_field(60, body))


class Interned:
    """Names, argument keys and string values, each sent once in the first packet."""

    def __init__(self, names: Iterable[str], keys: Iterable[str], values: Iterable[str],
                 categories: Iterable[str] = ()) -> None:
        self.name = {n: i for i, n in enumerate(dict.fromkeys(names), start=1)}
        self.category = {n: i for i, n in enumerate(dict.fromkeys(categories), start=1)}
        self.category_field = {n: uint_field(3, i) for n, i in self.category.items()}  # TrackEvent.category_iids
        self.key = {k: i for i, k in enumerate(dict.fromkeys(keys), start=1)}
        self.value = {s: i for i, s in enumerate(dict.fromkeys(values), start=1)}
        self.name_field = {n: uint_field(10, i) for n, i in self.name.items()}
        self.key_field = {k: uint_field(1, i) for k, i in self.key.items()}

    def first_packet(self) -> bytes:
        data = b"".join(bytes_field(1, uint_field(1, i) + bytes_field(2, n)) for n, i in self.category.items())
        data += b"".join(bytes_field(2, uint_field(1, i) + bytes_field(2, n)) for n, i in self.name.items())
        data += b"".join(bytes_field(3, uint_field(1, i) + bytes_field(2, k)) for k, i in self.key.items())
        data += b"".join(bytes_field(29, uint_field(1, i) + bytes_field(2, s)) for s, i in self.value.items())
        return packet(uint_field(10, SEQUENCE_ID) + uint_field(13, SEQ_INCREMENTAL_STATE_CLEARED)
                      + bytes_field(12, data))

    def annotation(self, key: str, value: Any) -> bytes:
        """DebugAnnotation: interned key; bool, int, double or (interned where known) string value."""
        body = self.key_field[key] if key in self.key_field else bytes_field(10, key)
        if isinstance(value, bool):
            body += uint_field(2, int(value))
        elif isinstance(value, int):
            body += uint_field(4, value) if value >= 0 else tag(4, 0) + varint(value)
        elif isinstance(value, float):
            body += double_field(5, value)
        elif value in self.value:
            body += uint_field(17, self.value[value])
        else:
            body += bytes_field(6, str(value))
        return bytes_field(4, body)


def group_label(group: dict[str, Any]) -> str:
    """As the Chrome trace labels a group: kind and ranks, long lists shortened."""
    ranks = group["ranks"]
    desc = group["desc"].replace("_GROUP", "").lower() if group["desc"] else group["name"]
    shown = ",".join(map(str, ranks)) if len(ranks) <= 16 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"
    return f"{desc} [{shown}]"


# --- the writer ---------------------------------------------------------------------------------
_KEYS = ("iteration", "microbatch", "chunk", "layer", "bytes", "bandwidth_GBps", "transfer_us", "peer", "direction",
         "group", "seq", "participants", "async", "dtype")


def process_uuid(rank: int) -> int:
    return (rank + 1) << 12


def lane_uuid(rank: int, lane: int, extra: int = 0) -> int:
    return process_uuid(rank) | lane << 6 | extra


def write_perfetto_trace(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks, path: str | os.PathLike,
                         other_data: dict[str, Any] | None = None, progress: Reporter = SILENT) -> dict[str, int]:
    """Stream the trace to `path` (a temporary name, then renamed). Returns counts: events (slices
    from trace rows), flows, counters, restarts, markers (the megascan slices), overflow_lanes."""
    c = trace.columns
    total = len(trace)
    base = int(c["start"].min() // 1_000_000 * 1_000_000) if len(trace) else 0
    counts = {"events": 0, "flows": 0, "counters": 0, "restarts": 0, "markers": 0, "overflow_lanes": 0,
              "clamped": 0}
    members, expected = collectives.members, collectives.expected
    participants = {f"{m}/{e}" for m, e in zip(members.tolist(), expected.tolist())}
    groups = [group_label(g) for g in trace.groups]
    interned = Interned(list(trace.names) + ["megascan", "microbatches"], _KEYS,
                        groups + [n for n in trace.names] + ["F", "B"] + sorted(participants),
                        sorted(set(CATEGORY.values()) | {"collective", "other"}))
    temporary = f"{path}.tmp"
    with open(temporary, "wb", buffering=1 << 20) as out, \
            progress.step("writing the merged trace (Perfetto)", total, unit=" events") as step:
        out.write(interned.first_packet())
        out.write(track_descriptor(META_TRACK, "megascan"))
        meta = {"time_base_unix_ns": base, "producer": "megatron.scan", **(other_data or {})}
        event = _INSTANT + uint_field(11, META_TRACK) + interned.name_field["megascan"]
        for key, value in meta.items():
            text = value if isinstance(value, (int, float, str)) else json.dumps(value, separators=(",", ":"))
            event += interned.annotation(key, text)
        out.write(track_event_packet(0, event))
        counts["markers"] = 1
        begin_flow, end_flows, counts["flows"] = _flow_ids(trace, collectives, p2p)
        _slices(trace, collectives, p2p, base, interned, begin_flow, end_flows, out, counts, step)
        counts["counters"] = _microbatch_counters(trace, base, interned, out)
        counts["restarts"] = _restart_markers(trace, base, interned, out)
        step.set(total)
    os.replace(temporary, path)
    return counts


def _flow_ids(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks) -> tuple[dict, dict, int]:
    """Flow ids numbered as chrome.py numbers its arrows: P2P links first, then collectives.
    Returns (row -> id opened at its begin, row -> ids closed at its end, flows)."""
    begin: dict[int, int] = {}
    end: dict[int, list[int]] = {}
    flow_id = 0
    for send, recv in zip(p2p.send_rows.tolist(), p2p.recv_rows.tolist()):
        flow_id += 1
        begin[send] = flow_id
        end.setdefault(recv, []).append(flow_id)
    rows = np.flatnonzero(collectives.row_instance >= 0)
    if len(rows):
        inst = collectives.row_instance[rows]
        order = np.lexsort((trace.columns["start"][rows], inst))
        rows, inst = rows[order], inst[order]
        boundaries = np.flatnonzero(np.concatenate([inst[1:] != inst[:-1], [True]]))
        starts = np.concatenate([[0], boundaries[:-1] + 1])
        for lo, hi in zip(starts.tolist(), boundaries.tolist()):
            last = int(rows[hi])
            for other in rows[lo:hi].tolist():
                flow_id += 1
                begin[other] = flow_id
                end.setdefault(last, []).append(flow_id)
    return begin, end, flow_id


def _row_args(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks, interned: Interned):
    """A function row -> encoded debug annotations, the args chrome.py gives the same event."""
    c = trace.columns
    transfer_us = dict(zip(p2p.recv_rows.tolist(),
                           np.round((c["end"][p2p.recv_rows] - c["start"][p2p.send_rows]) / 1e3, 3).tolist()))
    dur_us = np.round(np.maximum(c["end"] - c["start"], 0) / 1e3, 3)
    groups = [group_label(g) for g in trace.groups]
    columns = {k: c[k] for k in ("name", "iteration", "microbatch", "chunk", "layer", "bytes", "peer", "group", "seq",
                                 "flags", "dtype")}
    instance, members, expected = collectives.row_instance, collectives.members, collectives.expected
    a = interned.annotation
    names = trace.names

    def args(i: int) -> bytes:
        name = names[columns["name"][i]]
        group = int(columns["group"][i])
        out = [a("iteration", int(columns["iteration"][i]))]
        for key in ("microbatch", "chunk", "layer"):
            if columns[key][i] >= 0:
                out.append(a(key, int(columns[key][i])))
        size = int(columns["bytes"][i])
        peer = int(columns["peer"][i])
        if size >= 0:
            out.append(a("bytes", size))
            elapsed = transfer_us.get(i) if peer >= 0 else float(dur_us[i])
            if elapsed is not None and elapsed > 0:
                out.append(a("bandwidth_GBps", round(size / (elapsed * 1e3), 4)))
            if i in transfer_us:
                out.append(a("transfer_us", float(transfer_us[i])))
        flags = int(columns["flags"][i])
        if peer >= 0:
            out.append(a("peer", peer))
            out.append(a("direction", "B" if flags & FLAG_BACKWARD else "F"))
        if group >= 0:
            out.append(a("group", groups[group]))
            out.append(a("seq", int(columns["seq"][i])))
            k = instance[i]
            out.append(a("participants", f"{members[k]}/{expected[k]}"))
            if flags & FLAG_ASYNC:
                out.append(a("async", True))
        if columns["dtype"][i] >= 0:
            out.append(a("dtype", names[columns["dtype"][i]]))
        out.append(interned.category_field[CATEGORY.get(name, "collective" if group >= 0 else "other")])
        return b"".join(out)
    return args


def _slices(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks, base: int, interned: Interned,
            begin_flow: dict, end_flows: dict, out, counts: dict, step) -> None:
    """Per rank: its tracks, then its slices lane by lane as properly nested BEGIN/END pairs."""
    c = trace.columns
    lane = thread_of(trace)
    start = (c["start"] - base).tolist()
    end = np.maximum(c["end"] - base, c["start"] - base).tolist()
    rank_of = c["rank"]
    order = np.lexsort((-(c["end"] - c["start"]), c["start"], lane, rank_of))
    args = _row_args(trace, collectives, p2p, interned)
    name_field = [interned.name_field[n] for n in trace.names]
    names = c["name"]
    ordered_ranks = rank_of[order]
    bounds = np.searchsorted(ordered_ranks, np.array(sorted(trace.ranks)), side="left").tolist() + [len(order)]
    for n, rank in enumerate(sorted(trace.ranks)):
        rows = order[bounds[n]:bounds[n + 1]].tolist()
        out.write(track_descriptor(process_uuid(rank), trace.label(rank), pid=rank + 1, explicit_order=True,
                                   order=rank))
        for tid, lane_name in THREADS.items():
            out.write(track_descriptor(lane_uuid(rank, tid), lane_name, parent=process_uuid(rank), order=tid * 64))
        # Assign each row a sub-lane where it nests (stack per sub-lane), then write the events.
        stacks: dict[int, list[list]] = {}
        events: list[bytes] = []  # BEGIN and END packets, in order on each track (ties keep this order)
        for i in rows:
            s, e, lid = start[i], end[i], int(lane[i])
            subs = stacks.setdefault(lid, [[]])
            placed = False
            for k, stack in enumerate(subs):
                while stack and stack[-1][0] <= s:
                    events.append(stack.pop()[1])
                if not stack or stack[-1][0] >= e:
                    placed = True
                    break
            if not placed:
                if len(subs) <= MAX_OVERFLOW:
                    subs.append([])
                    k = len(subs) - 1
                    out.write(track_descriptor(lane_uuid(rank, lid, k), f"{THREADS[lid]} ({k + 1})",
                                               parent=process_uuid(rank), order=lid * 64 + k))
                    counts["overflow_lanes"] += 1
                else:  # clamp into the innermost open slice of the first sub-lane
                    k = 0
                    e = subs[0][-1][0]
                    counts["clamped"] += 1
            track = uint_field(11, lane_uuid(rank, lid, k))
            event = _BEGIN + track + name_field[names[i]] + args(i)
            if i in begin_flow:
                event += fixed64_field(47, begin_flow[i])
            events.append(track_event_packet(s, event))
            closing = _END + track
            for flow in end_flows.get(i, ()):
                closing += fixed64_field(48, flow)
            subs[k].append((e, track_event_packet(e, closing, interned=False)))
        for subs in stacks.values():
            for stack in subs:
                while stack:
                    events.append(stack.pop()[1])
        out.write(b"".join(events))
        counts["events"] += len(rows)
        step.update(len(rows))


def _microbatch_counters(trace: GlobalTrace, base: int, interned: Interned, out) -> int:
    """The "microbatches" counter track of each rank, as chrome.py's counter events."""
    emitted, described = 0, set()
    for rank, start, microbatches in microbatch_counts(trace):
        uuid = lane_uuid(rank, 0, 63)
        if rank not in described:
            out.write(track_descriptor(uuid, "microbatches", parent=process_uuid(rank), counter=True, order=0))
            described.add(rank)
        event = _COUNTER + uint_field(11, uuid) + uint_field(30, int(microbatches))
        out.write(track_event_packet(start - base, event, interned=False))
        emitted += 1
    return emitted


def _restart_markers(trace: GlobalTrace, base: int, interned: Interned, out) -> int:
    emitted = 0
    for rank, header in sorted(trace.ranks.items()):
        for restart in header.get("restarts") or []:
            if restart.get("wall_ns") is None:
                continue
            name = (f"torchrun restart: attempt {restart.get('attempt')}, resumed at iteration "
                    f"{restart.get('start_iteration')}")
            event = _INSTANT + uint_field(11, lane_uuid(rank, 1)) + bytes_field(23, name)
            for key, value in restart.items():
                if key != "path":
                    event += interned.annotation(key, value if isinstance(value, (int, float, str)) else str(value))
            out.write(track_event_packet(max(int(restart["wall_ns"]) - base, 0), event))
            emitted += 1
    return emitted


# --- the focused view ---------------------------------------------------------------------------
@dataclass(kw_only=True)
class Focus:
    ranks: list[int]  # kept, sorted
    reasons: dict[int, str]  # rank -> why it is kept
    suspects: list[int]
    left_out: list[int]

    def note(self) -> dict[str, Any]:
        """What the focused view holds and what it leaves out (its metadata)."""
        from megatron.scan.hang import rank_ranges

        kinds: dict[str, list[int]] = {}
        for rank, why in sorted(self.reasons.items()):
            kinds.setdefault(why, []).append(rank)
        return {"focused": True, "suspects": self.suspects, "kept_ranks": len(self.ranks),
                "kept": {why: rank_ranges(ranks) for why, ranks in kinds.items()},
                "left_out_ranks": len(self.left_out), "left_out": rank_ranges(self.left_out)}


def focus_ranks(trace: GlobalTrace, suspects: Iterable[int], sample: int = 16) -> Focus:
    """The suspects; each suspect's peers (its stage in the other DP replicas, its TP group); its
    pipeline neighbours (pp - 1 and pp + 1 in the same dp and tp); rank 0; and `sample` of the
    other ranks, evenly spaced over the rank order (deterministic)."""
    coords = {r: (h["coordinates"]["dp"], h["coordinates"]["pp"], h["coordinates"]["tp"], h.get("role") or "")
              for r, h in trace.ranks.items()}
    by_coords: dict[tuple, list[int]] = {}
    for rank, (dp, pp, tp, _) in coords.items():
        by_coords.setdefault((dp, pp, tp), []).append(rank)
    reasons: dict[int, str] = {}
    suspects = [r for r in dict.fromkeys(int(s) for s in suspects) if r in coords]
    for rank in suspects:
        reasons[rank] = "suspect"
    for rank in suspects:
        dp, pp, tp, role = coords[rank]
        for other, (d, p, t, r) in coords.items():
            if other not in reasons and p == pp and r == role and (t == tp or d == dp):
                reasons[other] = "peer"
        for p in (pp - 1, pp + 1):
            for other in by_coords.get((dp, p, tp), []):
                reasons.setdefault(other, "pipeline neighbour")
    if 0 in coords:
        reasons.setdefault(0, "rank 0")
    healthy = sorted(r for r in coords if r not in reasons)
    if sample > 0 and healthy:
        picks = np.unique(np.linspace(0, len(healthy) - 1, min(sample, len(healthy))).round().astype(int))
        for k in picks.tolist():
            reasons[healthy[k]] = "sample"
    kept = sorted(reasons)
    return Focus(ranks=kept, reasons=reasons, suspects=suspects, left_out=sorted(set(coords) - set(kept)))


def subset(trace: GlobalTrace, collectives: Collectives, p2p: P2PLinks,
           ranks: Iterable[int]) -> tuple[GlobalTrace, Collectives, P2PLinks]:
    """The trace of `ranks` only: their rows, collective rows (instances keep their full member
    counts) and the P2P links with both ends kept."""
    keep = set(int(r) for r in ranks)
    mask = np.isin(trace.columns["rank"], np.array(sorted(keep), dtype=np.int64))
    new_index = np.cumsum(mask) - 1
    sub = replace(trace, ranks={r: h for r, h in trace.ranks.items() if r in keep},
                  windows={r: w for r, w in trace.windows.items() if r in keep},
                  columns={k: v[mask] for k, v in trace.columns.items()})
    links = mask[p2p.send_rows] & mask[p2p.recv_rows] if len(p2p.send_rows) else np.zeros(0, dtype=bool)

    def remap(rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        return new_index[rows[mask[rows]]] if len(rows) else rows

    sub_p2p = replace(p2p, send_rows=new_index[p2p.send_rows[links]], recv_rows=new_index[p2p.recv_rows[links]],
                      unmatched_sends=remap(p2p.unmatched_sends), unmatched_recvs=remap(p2p.unmatched_recvs))
    return sub, replace(collectives, row_instance=collectives.row_instance[mask]), sub_p2p
