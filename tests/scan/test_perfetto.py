"""The Perfetto protobuf trace (`.pftrace`) and the focused view: read back by a decoder written
here from the wire format, by Perfetto's own generated classes (the `perfetto` wheel ships
perfetto_trace_pb2) and, where its binary is at hand, by Perfetto's trace processor; compared with
the Chrome JSON of the same directory."""
from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.scan import cli
from megatron.scan.aggregate import aggregate, write_trace
from megatron.scan.load import AggregateError
from megatron.scan.perfetto import focus_ranks, subset, write_perfetto_trace
from megatron.scan.synthetic import SyntheticRun, generate
from megatron.scan.trace_format import decode_column, encode_column, trace_file_name

ROOT = Path(__file__).resolve().parents[2]


# --- a decoder of the wire format, independent of the writer ------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def fields(buf: bytes):
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = struct.unpack("<Q", buf[i:i + 8])[0], i + 8
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield number, value


def decode(path: Path) -> dict:
    """Slices (name per BEGIN) per rank, flows opened and closed, tracks, per the proto's fields."""
    names: dict[int, str] = {}
    tracks: dict[int, dict] = {}
    begins: dict[int, list[str]] = collections.defaultdict(list)
    ends = collections.Counter()
    flows_out, flows_in = set(), set()
    instants = 0
    for number, packet in fields(path.read_bytes()):
        assert number == 1  # Trace.packet
        for field, value in fields(packet):
            if field == 12:  # interned_data
                for kind, entry in fields(value):
                    if kind == 2:  # event_names
                        entry = dict(fields(entry))
                        names[entry[1]] = entry[2].decode()
            elif field == 60:  # track_descriptor
                d = dict(fields(value))
                process = dict(fields(d[3])) if 3 in d else {}
                tracks[d[1]] = {"parent": d.get(5, 0), "name": (d.get(2) or process.get(6, b"")).decode(),
                                "pid": process.get(1)}
            elif field == 11:  # track_event
                event = list(fields(value))
                e = dict(event)
                track = tracks[e[11]]
                rank = (tracks[track["parent"]] if track["parent"] else track)["pid"]
                rank = rank - 1 if rank is not None else None
                if e[9] == 1:
                    begins[rank].append(names[e[10]])
                elif e[9] == 2:
                    ends[rank] += 1
                elif e[9] == 3:
                    instants += 1
                flows_out.update(v for f, v in event if f == 47)
                flows_in.update(v for f, v in event if f == 48)
    return {"begins": begins, "ends": ends, "flows_out": flows_out, "flows_in": flows_in, "tracks": tracks,
            "instants": instants}


def chrome_slices(path: Path) -> dict[int, list[str]]:
    per_rank: dict[int, list[str]] = collections.defaultdict(list)
    for event in json.loads(path.read_text())["traceEvents"]:
        if event["ph"] == "X":
            per_rank[event["pid"]].append(event["name"])
    return per_rank


@pytest.fixture(scope="module", params=[(2, 2, 2), (4, 4, 4)], ids=["8-ranks", "64-ranks"])
def written(request, tmp_path_factory):
    tp, pp, dp = request.param
    directory = tmp_path_factory.mktemp(f"pf{tp * pp * dp}")
    generate(SyntheticRun(tp=tp, pp=pp, dp=dp, offsets_ms={1: 2.0}), directory)
    result = aggregate(directory, None, jobs=1)
    counts = {"perfetto": write_trace(result, directory / "merged.pftrace", "perfetto"),
              "chrome": write_trace(result, directory / "merged.json", "chrome")}
    return directory, result, counts


def test_slices_per_rank_and_names_match_the_chrome_trace(written):
    directory, result, counts = written
    ours = decode(directory / "merged.pftrace")
    chrome = chrome_slices(directory / "merged.json")
    assert sorted(ours["begins"]) == sorted(chrome) == sorted(result.trace.ranks)
    for rank, names in chrome.items():
        assert sorted(ours["begins"][rank]) == sorted(names), rank
        assert ours["ends"][rank] == len(names)
    assert counts["perfetto"]["events"] == counts["chrome"]["events"] == sum(map(len, chrome.values()))
    # Every flow opened is closed, as many as the Chrome trace's arrows.
    assert ours["flows_out"] == ours["flows_in"]
    assert len(ours["flows_out"]) == counts["perfetto"]["flows"] == counts["chrome"]["flows"]
    assert ours["instants"] == 1  # the megascan marker with the summary
    labels = {t["name"] for t in ours["tracks"].values() if t["pid"] is not None}
    assert labels == {result.trace.label(r) for r in result.trace.ranks}
    assert (directory / "merged.pftrace").stat().st_size < (directory / "merged.json").stat().st_size / 2


def test_perfettos_own_generated_classes_read_it(written):
    """The perfetto wheel's perfetto_trace_pb2 (built from Perfetto's .proto files) parses the file:
    same slices, names resolved through the interned data, tracks named as the Chrome processes."""
    try:  # a protobuf runtime too new for the wheel's generated code raises VersionError, not ImportError
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb2
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Perfetto's generated trace protos unusable here ({exc!r}); pip install perfetto: its wheel "
                    f"ships perfetto_trace_pb2")
    directory, result, counts = written
    trace = pb2.Trace()
    trace.ParseFromString((directory / "merged.pftrace").read_bytes())
    names = {}
    processes, parents = {}, {}
    per_rank = collections.defaultdict(list)
    kinds = collections.Counter()
    flows = collections.Counter()
    categories = {}
    for packet in trace.packet:
        for entry in packet.interned_data.event_names:
            names[entry.iid] = entry.name
        for entry in packet.interned_data.event_categories:
            categories[entry.iid] = entry.name
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            if d.HasField("process"):
                processes[d.uuid] = d.process.pid - 1
                assert d.process.process_name == result.trace.label(d.process.pid - 1)
            parents[d.uuid] = d.parent_uuid
        if packet.HasField("track_event"):
            event = packet.track_event
            kinds[event.type] += 1
            flows["out"] += len(event.flow_ids)
            flows["in"] += len(event.terminating_flow_ids)
            if event.type == pb2.TrackEvent.TYPE_SLICE_BEGIN:
                assert packet.trusted_packet_sequence_id == 1
                per_rank[processes[parents[event.track_uuid]]].append(names[event.name_iid])
                assert [categories[i] for i in event.category_iids] in (["compute"], ["p2p"], ["collective"],
                                                                        ["step"], ["data"], ["layer"], ["other"])
    assert trace.packet[0].sequence_flags == pb2.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    events = counts["perfetto"]["events"]
    assert kinds[pb2.TrackEvent.TYPE_SLICE_BEGIN] == kinds[pb2.TrackEvent.TYPE_SLICE_END] == events
    assert flows["out"] == flows["in"] == counts["perfetto"]["flows"]
    chrome = chrome_slices(directory / "merged.json")
    assert {r: sorted(n) for r, n in per_rank.items()} == {r: sorted(n) for r, n in chrome.items()}


def _trace_processor() -> str | None:
    return os.environ.get("PERFETTO_TRACE_PROCESSOR") or shutil.which("trace_processor_shell") \
        or shutil.which("trace_processor")


@pytest.mark.multiprocess
@pytest.mark.skipif(_trace_processor() is None, reason="Perfetto's trace processor binary is not here (set "
                    "PERFETTO_TRACE_PROCESSOR=/path/to/trace_processor_shell; it cannot be downloaded offline)")
def test_perfettos_trace_processor_counts_our_slices_and_flows(written):
    tp = pytest.importorskip("perfetto.trace_processor")
    directory, _, counts = written
    config = tp.TraceProcessorConfig(bin_path=_trace_processor())
    with tp.TraceProcessor(trace=str(directory / "merged.pftrace"), config=config) as processor:
        slices = next(iter(processor.query("select count(*) as n from slice"))).n
        flows = next(iter(processor.query("select count(*) as n from flow"))).n
    c = counts["perfetto"]
    assert slices == c["events"] + c["restarts"] + c["markers"]
    assert flows == c["flows"]


# --- the focused view ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("focus")
    spec = SyntheticRun(tp=2, pp=4, dp=8)  # 64 ranks
    generate(spec, directory)
    return directory, spec, aggregate(directory, None, jobs=1)


def test_focus_holds_the_suspect_its_peers_and_neighbours_and_is_smaller(job, capsys):
    directory, spec, result = job
    slow = spec.rank(dp=3, pp=2, tp=1)
    focus = focus_ranks(result.trace, [slow], sample=4)
    peers = {spec.rank(d, 2, 1) for d in range(spec.dp)} | {spec.rank(3, 2, t) for t in range(spec.tp)}
    neighbours = {spec.rank(3, 1, 1), spec.rank(3, 3, 1)}
    assert {slow} | peers | neighbours | {0} <= set(focus.ranks)
    assert focus.reasons[slow] == "suspect" and len(focus.ranks) == len(peers | neighbours | {0}) + 4
    assert focus_ranks(result.trace, [slow], sample=4).ranks == focus.ranks  # deterministic
    assert set(focus.ranks) | set(focus.left_out) == set(result.trace.ranks)
    # Through the CLI's writer, with the suspect forced (as if detection named it).
    write_trace(result, directory / "merged.pftrace", "perfetto")
    args = argparse.Namespace(focus_sample=4)
    assert cli.write_focus(result, str(directory), "perfetto", args, suspects=[slow]) == 0
    printed = capsys.readouterr().out
    assert f"{len(focus.ranks)} of 64 ranks" in printed
    focused = decode(directory / "focused_trace.pftrace")
    assert set(focused["begins"]) == set(focus.ranks)
    full = decode(directory / "merged.pftrace")
    for rank in focus.ranks:
        assert focused["begins"][rank] == full["begins"][rank]
    assert (directory / "focused_trace.pftrace").stat().st_size < (directory / "merged.pftrace").stat().st_size / 2
    # The note of what was left out travels in the file (the megascan marker's annotations).
    assert b"left_out" in (directory / "focused_trace.pftrace").read_bytes()


def test_focus_without_suspects_is_the_sample_and_rank_0_and_chrome_subset_is_consistent(job, tmp_path):
    directory, spec, result = job
    focus = focus_ranks(result.trace, [], sample=5)
    assert 0 in focus.ranks and len(focus.ranks) == 6 and not focus.suspects
    trace, collectives, p2p = subset(result.trace, result.collectives, result.p2p, focus.ranks)
    assert sorted(trace.ranks) == focus.ranks
    assert len(trace) == int(np.isin(result.trace.columns["rank"], focus.ranks).sum())
    assert (trace.columns["rank"][p2p.send_rows] >= 0).all() and len(collectives.row_instance) == len(trace)
    counts = write_perfetto_trace(trace, collectives, p2p, tmp_path / "f.pftrace")
    ours = decode(tmp_path / "f.pftrace")
    assert ours["flows_out"] == ours["flows_in"] and len(ours["flows_out"]) == counts["flows"]


def test_focus_flag_runs_detection_and_writes_the_view(job, capsys):
    directory, _, _ = job
    args = argparse.Namespace(jobs=1, run_id=None, no_drift=False, no_align=False, summary=None, quiet=True,
                              trace_format=None, focus=True, focus_sample=3)
    assert cli.run_aggregate(str(directory), None, args) == 0
    assert (directory / "merged_trace.json").exists() and (directory / "focused_trace.json").exists()
    note = json.loads((directory / "focused_trace.json").read_text())["otherData"]["megascan_focus"]
    assert note["focused"] and note["left_out_ranks"] + note["kept_ranks"] == 64
    assert "wrote focused view" in capsys.readouterr().out


def slow_down(directory: Path, spec: SyntheticRun, dp: int, pp: int, tp: int, factor: float = 1.8) -> int:
    """Make one rank's forward and backward tasks `factor` times longer in its trace file (a slow GPU
    as its own timeline shows it); returns the rank."""
    path = directory / trace_file_name(dp, pp, tp)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    window = lines[1]
    events, compute = window["events"], [window["names"].index("forward"), window["names"].index("backward")]
    start, end = decode_column(events["start_ns"]), decode_column(events["end_ns"])
    mine = np.isin(decode_column(events["name"]), compute)
    end[mine] = start[mine] + (factor * (end[mine] - start[mine])).astype(np.int64)
    events["end_ns"] = encode_column(end)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return spec.rank(dp, pp, tp)


def test_detect_then_focus_holds_the_slow_rank(tmp_path, monkeypatch, capsys):
    """scripts/aggregate.py -d --focus: detection names the slowed rank, the focused view reuses its
    abnormal.json and holds the rank, its peers and neighbours."""
    spec = SyntheticRun(tp=2, pp=4, dp=8)
    generate(spec, tmp_path)
    slow = slow_down(tmp_path, spec, dp=3, pp=2, tp=1)
    script = runpy.run_path(str(ROOT / "scripts" / "aggregate.py"), run_name="not_main")
    monkeypatch.setattr("sys.argv", ["aggregate.py", "-b", str(tmp_path), "-d", "--focus", "--focus-sample", "4",
                                     "-o", str(tmp_path / "full.pftrace"), "-q", "-j", "1"])
    assert script["main"]() == 0
    assert slow in cli.suspects_in(str(tmp_path / "abnormal.json"))
    assert f"wrote focused view {tmp_path / 'focused_trace.pftrace'}" in capsys.readouterr().out
    focused = decode(tmp_path / "focused_trace.pftrace")
    assert slow in focused["begins"] and {spec.rank(d, 2, 1) for d in range(spec.dp)} <= set(focused["begins"])
    assert len(focused["begins"]) < 64


# --- choosing the format, and bad input ---------------------------------------------------------
def test_format_follows_the_extension_and_conflicts_are_errors():
    assert cli.format_for("x.pftrace", None) == "perfetto" == cli.format_for("x.perfetto-trace", "perfetto")
    assert cli.format_for("x.json", None) == "chrome" and cli.format_for(None, None) is None
    assert cli.format_for("x.trace", "perfetto") == "perfetto"
    with pytest.raises(AggregateError, match="names a chrome trace but --format perfetto"):
        cli.format_for("x.json", "perfetto")
    with pytest.raises(AggregateError, match="names a perfetto trace but --format chrome"):
        cli.format_for("x.pftrace", "chrome")


def test_script_rejects_an_unknown_format_and_a_mismatched_name(job, monkeypatch, capsys):
    directory, _, _ = job
    script = runpy.run_path(str(ROOT / "scripts" / "aggregate.py"), run_name="not_main")
    monkeypatch.setattr("sys.argv", ["aggregate.py", "-b", str(directory), "--format", "protobuf"])
    with pytest.raises(SystemExit) as exit_:
        script["main"]()
    assert exit_.value.code == 2 and "invalid choice: 'protobuf'" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["aggregate.py", "-b", str(directory), "-o", str(directory / "m.json"),
                                     "--format", "perfetto"])
    assert script["main"]() == 2
    assert "names a chrome trace but --format perfetto" in capsys.readouterr().err
    assert not (directory / "m.json").exists()


def test_many_ranks_without_o_or_format_write_perfetto_and_say_so(job, monkeypatch, capsys, tmp_path):
    directory, _, _ = job
    copy = tmp_path / "job"
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("merged*", "focused*"))
    monkeypatch.setattr(cli, "AUTO_PERFETTO_RANKS", 32)  # the threshold is 1024; this job has 64 ranks
    args = argparse.Namespace(jobs=1, run_id=None, no_drift=False, no_align=False, summary=None, quiet=True,
                              trace_format=None, focus=False, focus_sample=16)
    assert cli.run_aggregate(str(copy), None, args) == 0
    assert (copy / "merged_trace.pftrace").exists() and not (copy / "merged_trace.json").exists()
    assert "64 ranks (> 32): writing the Perfetto protobuf trace" in capsys.readouterr().err
