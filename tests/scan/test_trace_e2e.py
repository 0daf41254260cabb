"""End to end on a real 4-rank CPU run (TP=2, PP=2) traced with --trace: the per-rank files, the
aggregated Chrome trace, collective and P2P links, and clock alignment of a skewed rank."""
from __future__ import annotations

import json
import re
import socket
from collections import Counter, defaultdict

import numpy as np
import pytest

from conftest import SKEW_MS, SKEWED_RANK
from launch import python

from megatron.scan.aggregate import collective_end_spread_us
from megatron.scan.trace_format import read_rank_file, trace_file_name

# (rank, dp, pp, tp) for TP=2 PP=2 on 4 ranks in megatron-core's order
LAYOUT = [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1)]


def test_one_file_per_rank_with_header(traced_tp2_pp2):
    trace_dir, _ = traced_tp2_pp2
    assert sorted(p.name for p in trace_dir.iterdir()) == sorted(trace_file_name(d, p, t) for _, d, p, t in LAYOUT)
    run_ids = set()
    for rank, dp, pp, tp in LAYOUT:
        f = read_rank_file(trace_dir / trace_file_name(dp, pp, tp))
        h = f.header
        assert h["rank"] == rank and h["world_size"] == 4
        assert h["coordinates"] == {"dp": dp, "pp": pp, "tp": tp}
        assert h["sizes"] == {"dp": 1, "pp": 2, "tp": 2, "vpp": 1}
        assert h["host"] == socket.gethostname() and h["device"] == "cpu" and h["timing"] == "host-monotonic"
        assert set(h["clock_reference"]) == {"wall_ns", "monotonic_ns"}
        assert h["trace"] == {"interval": 5, "continuous": 2, "granularity": "full", "dense_until": 0}
        run_ids.add(h["run_id"])
        # Windows of 2 iterations every 5, each with its own wall/monotonic reference pairs; then the end line.
        assert [w["iterations"] for w in f.windows] == [[0, 1], [5, 6]]
        for w in f.windows:
            assert w["clock"]["start"]["monotonic_ns"] < w["clock"]["end"]["monotonic_ns"]
            assert [m["iteration"] for m in w["metrics"]] == list(range(w["iterations"][0], w["iterations"][1] + 1))
        assert f.ended and not f.warnings
        names = Counter(f.names[i] for i in f.columns["name"])
        assert names["iteration"] == 4 and names["optimizer"] == 4 and names["grad_sync"] == 4
        assert names["forward"] == names["backward"] == 4 * 8  # 8 microbatches per iteration
        assert names["layer_forward"] == 4 * 8 * 2  # full granularity: 2 layers per stage
        assert names["send"] == names["recv"] == 4 * 8
        # megatron-core's TP all-reduces, seen by wrapping torch.distributed
        assert names["all_reduce"] > 4 * 8 * 2
    assert len(run_ids) == 1


def test_every_rank_in_the_chrome_trace_sorted_and_named(aggregated_tp2_pp2):
    _, output = aggregated_tp2_pp2
    data = json.loads(output.read_text())
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {rank: f"DP{d}-PP{p}-TP{t} (rank {rank})" for rank, d, p, t in LAYOUT}
    sort = {e["pid"]: e["args"]["sort_index"] for e in data["traceEvents"] if e["name"] == "process_sort_index"}
    assert sort == {rank: rank for rank, *_ in LAYOUT}
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"} == {0, 1, 2, 3}


def test_collectives_matched_across_all_participants(aggregated_tp2_pp2):
    result, _ = aggregated_tp2_pp2
    col, trace = result.collectives, result.trace
    assert len(col) > 100
    assert col.complete.all(), f"{(~col.complete).sum()} incomplete collective instances"
    assert not col.op_mismatch.any()
    tp_groups = {gid for gid, g in enumerate(trace.groups) if g["desc"] == "TENSOR_MODEL_PARALLEL_GROUP"}
    assert {tuple(trace.groups[g]["ranks"]) for g in tp_groups} == {(0, 1), (2, 3)}
    tp_instances = np.isin(col.group, list(tp_groups))
    assert tp_instances.sum() > 100 and (col.members[tp_instances] == 2).all()
    # Sequence numbers of each group are dense within a window on every member: nothing missed.
    c = trace.columns
    for gid in tp_groups:
        for rank in trace.groups[gid]["ranks"]:
            seqs = np.sort(c["seq"][(c["group"] == gid) & (c["rank"] == rank) & (c["window"] == 0)])
            assert (np.diff(seqs) == 1).all()


def test_tp_all_reduce_inside_forward_and_backward(aggregated_tp2_pp2):
    """The TP all-reduces megatron-core issues from its layers carry the microbatch of the enclosing span."""
    result, _ = aggregated_tp2_pp2
    c, trace = result.trace.columns, result.trace
    tp = [gid for gid, g in enumerate(trace.groups) if g["desc"] == "TENSOR_MODEL_PARALLEL_GROUP"]
    rows = np.isin(c["group"], tp)
    assert (c["microbatch"][rows] >= 0).mean() > 0.9
    assert set(trace.names[i] for i in c["dtype"][rows]) == {"float32"}
    assert (c["bytes"][rows] == 64 * 2 * 64 * 4).any()  # one [seq, micro batch, hidden] fp32 activation


def test_every_send_linked_to_its_receive(aggregated_tp2_pp2):
    result, output = aggregated_tp2_pp2
    trace, p2p = result.trace, result.p2p
    sends = int((trace.columns["name"] == trace.name_id("send")).sum())
    assert sends == 4 * 4 * 8 and len(p2p) == sends
    assert len(p2p.unmatched_sends) == 0 and len(p2p.unmatched_recvs) == 0
    c = trace.columns
    assert (c["rank"][p2p.recv_rows] == c["peer"][p2p.send_rows]).all()
    assert (c["microbatch"][p2p.recv_rows] == c["microbatch"][p2p.send_rows]).all()
    assert (c["bytes"][p2p.recv_rows] == c["bytes"][p2p.send_rows]).all()
    data = json.loads(output.read_text())
    flows = Counter((e["ph"], e["name"]) for e in data["traceEvents"] if e["ph"] in "sf")
    assert flows[("s", "p2p")] == flows[("f", "p2p")] == sends
    expected_collective_flows = int((result.collectives.members - 1).sum())
    assert flows[("s", "collective")] == flows[("f", "collective")] == expected_collective_flows


def test_clock_alignment_recovers_the_skewed_rank(aggregated_tp2_pp2, traced_tp2_pp2):
    result, _ = aggregated_tp2_pp2
    alignment = result.alignment
    report = json.dumps(alignment.as_dict()["ranks"])
    skewed = alignment.ranks[SKEWED_RANK]
    # Tolerance: 4 processes share 2 cores, so a rank is often descheduled right at a collective's end.
    for window, offset in skewed.offset_us.items():
        assert abs(offset - SKEW_MS * 1e3) < 3_000, f"window {window}: injected {SKEW_MS} ms; {report}"
    for rank in (0, 1, 2):
        assert all(abs(v) < 3_000 for v in alignment.ranks[rank].offset_us.values()), report
    assert all(alignment.ranks[r].anchors > 50 for r in range(4)) and not alignment.unanchored
    spread = collective_end_spread_us(result.trace, result.collectives)
    # Participants of each collective finish together once aligned (2 cores, 4 processes: ms scheduling noise).
    assert np.median(spread) < 1_500 and np.percentile(spread, 90) < 5_000
    # Without alignment the skewed rank's collectives would be 40 ms apart.
    from megatron.scan.aggregate import aggregate

    trace_dir, _ = traced_tp2_pp2
    raw = aggregate(trace_dir, None, do_align=False)
    raw_spread = collective_end_spread_us(raw.trace, raw.collectives)
    assert np.percentile(raw_spread, 90) > 30_000


def test_windows_aligned_before_are_reused_not_fitted_again(aggregated_tp2_pp2, traced_tp2_pp2):
    """Where online detection reads the growing directory whole (a restarted job's attempts): with
    window 0's corrections from an earlier fit, only window 1 is fitted, and the aligned times are
    the same."""
    from megatron.scan.aggregate import aggregate
    from megatron.scan.align import fitted_windows

    full, _ = aggregated_tp2_pp2
    trace_dir, _ = traced_tp2_pp2
    earlier = fitted_windows(full.alignment, 1)
    assert {window for _, window in earlier} == {0} and len(earlier) == 4
    again = aggregate(trace_dir, None, jobs=1, fitted=earlier)
    assert 0 < again.alignment.anchors < full.alignment.anchors  # window 1's anchors only
    for column in ("start", "end"):
        assert np.abs(again.trace.columns[column] - full.trace.columns[column]).max() <= 1  # ns
    assert again.alignment.ranks[SKEWED_RANK].offset_us == full.alignment.ranks[SKEWED_RANK].offset_us


def test_event_nesting_is_valid(aggregated_tp2_pp2):
    _, output = aggregated_tp2_pp2
    events = [e for e in json.loads(output.read_text())["traceEvents"] if e["ph"] == "X"]
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    for key, items in by_thread.items():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []
        for e in items:
            while stack and e["ts"] >= stack[-1] - 1e-3:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-3, f"{key}: {e['name']} at {e['ts']} overlaps its parent"
            stack.append(end)
    layer = [e for e in events if e["name"] == "layer_forward"]
    assert layer and all("layer" in e["args"] and "microbatch" in e["args"] for e in layer)


CHROME_EVENT_SCHEMA = {
    "X": {"name": str, "cat": str, "ts": (int, float), "dur": (int, float), "pid": int, "tid": int, "args": dict},
    "M": {"name": str, "pid": int, "tid": int, "args": dict},
    "s": {"name": str, "cat": str, "id": int, "ts": (int, float), "pid": int, "tid": int},
    "f": {"name": str, "cat": str, "id": int, "ts": (int, float), "pid": int, "tid": int, "bp": str},
    "C": {"name": str, "ts": (int, float), "pid": int, "args": dict},  # the per-rank "microbatches" counter
}


def test_chrome_trace_schema(aggregated_tp2_pp2):
    """The JSON Object Format of the Trace Event Format, as chrome://tracing and Perfetto read it."""
    _, output = aggregated_tp2_pp2
    data = json.loads(output.read_text())
    assert isinstance(data, dict) and isinstance(data["traceEvents"], list)
    assert data["displayTimeUnit"] in ("ms", "ns")
    assert data["otherData"]["time_base_unix_ns"] > 1.6e18  # absolute time kept: a recent Unix epoch in ns
    for event in data["traceEvents"]:
        schema = CHROME_EVENT_SCHEMA[event["ph"]]
        for field, kind in schema.items():
            assert isinstance(event[field], kind), f"{field} of {event}"
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0
        if event["ph"] == "M":
            assert event["name"] in {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}
        if event["ph"] == "f":
            assert event["bp"] == "e"
    for kind in ("s", "f"):
        ids = [e["id"] for e in data["traceEvents"] if e["ph"] == kind]
        assert len(ids) == len(set(ids))
    summary = data["otherData"]["megascan"]
    assert summary["ranks"] == [0, 1, 2, 3] and summary["collective_instances_incomplete"] == 0


def test_aggregate_script_with_seed_flags(traced_tp2_pp2, tmp_path):
    trace_dir, _ = traced_tp2_pp2
    output = tmp_path / "out.json"
    proc = python(["scripts/aggregate.py", "-b", str(trace_dir), "-o", str(output)])
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"wrote .*out\.json: 4 ranks", proc.stdout)
    assert "0 unmatched sends, 0 unmatched receives" in proc.stdout
    json.loads(output.read_text())
    proc = python(["-m", "megatron.scan", "aggregate", str(trace_dir), "-o", str(tmp_path / "m.json"), "-q"])
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    # MegatronApp's spellings: -d also writes the merged trace, then detects.
    for flag in ("--benchmark", "--bench-dir", "--benchmark_dir"):
        proc = python(["scripts/aggregate.py", flag, str(trace_dir), "-o", str(tmp_path / f"{flag}.json"), "-q"])
        assert proc.returncode == 0 and json.loads((tmp_path / f"{flag}.json").read_text())["traceEvents"], flag
    (trace_dir / "merged_trace.json").unlink(missing_ok=True)
    proc = python(["scripts/aggregate.py", "-b", str(trace_dir), "-d"])
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (trace_dir / "abnormal.json").is_file() and (trace_dir / "abnormal.txt").is_file()
    assert json.loads((trace_dir / "merged_trace.json").read_text())["traceEvents"]
    assert proc.stdout.index("wrote ") < proc.stdout.index("MegaScan detection:")


@pytest.mark.parametrize("flags, message", [
    (["--trace-interval", "0"], "--trace-interval must be >= 1"),
    (["--trace-interval", "2", "--continuous-trace-iterations", "3"], "--continuous-trace-iterations must be in [1, "),
    (["--trace-clock-skew", "x"], "--trace-clock-skew wants RANK:OFFSET_MS"),
])
def test_bad_trace_flags_are_config_errors(flags, message):
    from megatron.app.config import ConfigError
    from megatron.app.train import parse

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(["--mock-data", "--trace", *flags])


def test_bad_trace_flag_message_on_the_command_line():
    proc = python(["pretrain_gpt.py", "--mock-data", "--trace", "--trace-interval", "0"])
    assert proc.returncode == 2 and "error: --trace-interval must be >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_megatronapp_granularity_names_are_accepted():
    from megatron.app.train import parse
    from megatron.app.arguments import build_parser
    from megatron.app.plugins import available_plugins

    parser = build_parser(available_plugins())
    assert parser.parse_args(["--mock-data", "--trace", "--trace-granularity", "base"]).trace_granularity == "coarse"
    assert parser.parse_args(["--mock-data", "--trace", "--trace-granularity", "full"]).trace_granularity == "full"
    with pytest.raises(SystemExit):
        parse(["--mock-data", "--trace", "--trace-granularity", "layers"])
