"""A rank killed mid-run (SIGKILL, as a dying host) leaves every finished window readable, and
the directory still aggregates; here with PP=2 DP=2, so DP gradient all-reduces are matched too."""
from __future__ import annotations

import json

import numpy as np

from conftest import train
from megatron.scan.aggregate import aggregate
from megatron.scan.cli import main
from megatron.scan.trace_format import read_rank_file, trace_file_name

KILLED_RANK, KILL_ITERATION = 1, 9


def test_killed_rank_keeps_finished_windows(tmp_path, capsys):
    trace_dir = tmp_path / "trace"
    proc = train(trace_dir, ["--pipeline-model-parallel-size", "2"],
                 ["--trace-interval", "2", "--continuous-trace-iterations", "1",
                  "--scan-kill-rank", f"{KILLED_RANK}:{KILL_ITERATION}"],
                 iters=30, extra_env={"MEGATRON_APP_PLUGINS": "tests.scan.scan_test_plugins"})
    assert proc.returncode != 0  # the job died with its rank
    killed = read_rank_file(trace_dir / trace_file_name(1, 0, 0))  # rank 1 = dp 1 of stage 0
    assert killed.header["rank"] == KILLED_RANK and not killed.ended
    # Windows 0, 2, 4, 6, 8 finished before the kill at the start of iteration 9.
    assert [w["iterations"] for w in killed.windows] == [[i, i] for i in range(0, KILL_ITERATION, 2)]
    for f in (trace_dir / trace_file_name(d, p, 0) for d in (0, 1) for p in (0, 1)):
        read_rank_file(f)  # every file parses: whatever a killed process left is whole windows

    result = aggregate(trace_dir, tmp_path / "merged.json", jobs=2)
    assert any("no end record" in w and trace_file_name(1, 0, 0) in w for w in result.trace.warnings)
    trace, col = result.trace, result.collectives
    dp_groups = {gid for gid, g in enumerate(trace.groups) if g["desc"] == "DATA_PARALLEL_GROUP"}
    assert {tuple(trace.groups[g]["ranks"]) for g in dp_groups} == {(0, 1), (2, 3)}
    # DP gradient all-reduces of the windows every rank finished are matched on both replicas.
    c = trace.columns
    finished = c["iteration"] < KILL_ITERATION
    dp_rows = np.isin(c["group"], list(dp_groups)) & finished
    instances = np.unique(col.row_instance[dp_rows])
    assert len(instances) >= 2 * 5 and col.complete[instances].all()
    p2p_finished = finished[result.p2p.send_rows]
    assert p2p_finished.sum() == 4 * 4 * 5  # 4 ranks x 4 microbatches x 5 windows, all linked

    code = main(["aggregate", str(trace_dir), "-o", str(tmp_path / "cli.json")])
    captured = capsys.readouterr()
    assert code == 0 and "warning:" in captured.err and "Traceback" not in captured.err
    json.loads((tmp_path / "cli.json").read_text())
