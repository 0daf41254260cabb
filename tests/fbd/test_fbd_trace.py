"""A traced FBD run (PP=2 on 4 ranks): forward and backward instances write separate files with a
role suffix and header field, and appear as separate, labelled tracks in the aggregated trace."""
from __future__ import annotations

import json
from collections import Counter

from launch import python
from test_fbd_equivalence import fbd_run, launch_dir

from megatron.scan.trace_format import read_rank_file, trace_file_name

# (rank, role, pp) for PP=2 on 4 ranks: backward instances first (the training mesh), then forward.
ROLES = [(0, "bwd", 0), (1, "bwd", 1), (2, "fwd", 0), (3, "fwd", 1)]


def test_roles_are_separate_tracks_in_the_aggregated_trace(tmp_path):
    fbd_run("pp2")
    trace_dir = launch_dir("pp2") / "trace"
    assert sorted(p.name for p in trace_dir.iterdir()) == sorted(trace_file_name(0, pp, 0, role) for _, role, pp in ROLES)
    for rank, role, pp in ROLES:
        f = read_rank_file(trace_dir / trace_file_name(0, pp, 0, role))
        assert f.header["rank"] == rank and f.header["role"] == role and f.header["world_size"] == 4
        assert f.header["coordinates"] == {"dp": 0, "pp": pp, "tp": 0}
        names = Counter(f.names[i] for i in f.columns["name"])
        assert names["forward"] == 8 * 4  # 8 traced iterations (windows of 2 every 5) x 4 microbatches; bwd: recomputation
        assert names["backward"] == (32 if role == "bwd" else 0)
        assert names["optimizer"] == (8 if role == "bwd" else 0)
    out = tmp_path / "out.json"
    proc = python(["scripts/aggregate.py", "-b", str(trace_dir), "-o", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "0 unmatched sends, 0 unmatched receives" in proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    labels = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert labels == {rank: f"DP0-PP{pp}-TP0 {role} (rank {rank})" for rank, role, pp in ROLES}
    spans = Counter((e["pid"], e["name"]) for e in data["traceEvents"] if e["ph"] == "X")
    assert all(spans[(rank, "backward")] == 0 for rank, role, _ in ROLES if role == "fwd")
    assert all(spans[(rank, "backward")] > 0 for rank, role, _ in ROLES if role == "bwd")


def test_detection_compares_forward_instances_with_forward_instances_only():
    """A forward instance (no backward, no optimizer) and the backward instance of the same
    coordinates do different work: detection never makes them each other's peers, and the weight
    hand-off (far larger than any other message) is not judged against activations and RNG states."""
    fbd_run("pp2")
    trace_dir = launch_dir("pp2") / "trace"
    proc = python(["-m", "megatron.scan", "detect", str(trace_dir), "--json"], timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    role = {rank: r for rank, r, _ in ROLES}
    for rank, finding in result["stages"]["compute"]["ranks"].items():
        assert all(role[peer] == role[int(rank)] for peer in finding["peers"]), finding
    for link in result["stages"]["pipeline"]["links"]:
        if {role[link["src"]], role[link["dst"]]} == {"fwd", "bwd"} and link["src"] < 2:  # bwd -> fwd: weights
            assert not link["flagged"], link
