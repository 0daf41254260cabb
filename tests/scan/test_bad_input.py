"""Aggregation of bad trace directories: clear messages naming the problem, never a traceback."""
from __future__ import annotations

import json
import shutil

import pytest

from launch import python
from megatron.scan.cli import main
from megatron.scan.synthetic import SyntheticRun, generate
from megatron.scan.trace_format import read_rank_file, trace_file_name


def aggregate_cli(directory, tmp_path, *extra) -> tuple[int, str, str]:
    output = tmp_path / "out.json"
    return main(["aggregate", str(directory), "-o", str(output), *extra]), output


@pytest.fixture
def run_dir(tmp_path):
    directory = tmp_path / "run"
    generate(SyntheticRun(tp=2, pp=2, dp=1, iterations=2, seed=1), directory)
    return directory


def test_empty_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _ = aggregate_cli(tmp_path / "empty", tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and "no trace files (benchmark-data-*.json)" in err and "--trace-dir" in err


def test_missing_directory(tmp_path, capsys):
    code, _ = aggregate_cli(tmp_path / "nowhere", tmp_path)
    assert code == 2 and "does not exist" in capsys.readouterr().err


def test_one_corrupt_file_is_named_and_skipped(run_dir, tmp_path, capsys):
    corrupt = run_dir / trace_file_name(0, 1, 1)
    corrupt.write_bytes(b"\x00garbage{{{")
    code, output = aggregate_cli(run_dir, tmp_path)
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"skipped {corrupt}: first line is not JSON" in err
    assert "no trace for rank(s) 3 of 4" in err
    data = json.loads(output.read_text())
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}


def test_all_files_corrupt(run_dir, tmp_path, capsys):
    for path in run_dir.iterdir():
        path.write_text("")
    code, _ = aggregate_cli(run_dir, tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and "none of the 4 trace files" in err and "empty file" in err


def test_torn_last_window_is_dropped_with_a_warning(run_dir, tmp_path, capsys):
    path = run_dir / trace_file_name(0, 0, 0)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1] + lines[1][: len(lines[1]) // 2])  # a crash in the middle of a write
    assert len(read_rank_file(path).windows) == 1
    code, _ = aggregate_cli(run_dir, tmp_path)
    err = capsys.readouterr().err
    assert code == 0 and "is torn; ignored" in err and f"{path}: no end record" in err


def test_mismatched_iteration_counts(run_dir, tmp_path, capsys):
    path = run_dir / trace_file_name(0, 1, 0)
    header = path.read_text().splitlines()[0]
    path.write_text(header + "\n")  # this rank recorded no window at all
    code, output = aggregate_cli(run_dir, tmp_path)
    err = capsys.readouterr().err
    assert code == 0
    assert "rank 2 traced 0 iteration(s) (none) but most ranks traced 2 (0-1)" in err
    summary = json.loads(output.read_text())["otherData"]["megascan"]
    assert summary["collective_instances_incomplete"] > 0


def test_two_runs_mixed_in_one_directory(run_dir, tmp_path, capsys):
    other = tmp_path / "other"
    generate(SyntheticRun(tp=2, pp=2, dp=1, iterations=2, seed=2), other)
    intruder = run_dir / "benchmark-data-0-pipeline-0-tensor-0-other.json"
    shutil.copy(other / trace_file_name(0, 0, 0), intruder)
    code, _ = aggregate_cli(run_dir, tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and "mixes trace files of 2 different runs" in err and "--run-id" in err
    assert "Traceback" not in err
    wanted = read_rank_file(run_dir / trace_file_name(0, 1, 0)).header["run_id"]
    code, output = aggregate_cli(run_dir, tmp_path, "--run-id", wanted)
    assert code == 0
    assert json.loads(output.read_text())["otherData"]["megascan"]["run_id"] == wanted


def test_bad_input_through_the_script_has_no_traceback(tmp_path):
    proc = python(["scripts/aggregate.py", "-b", str(tmp_path), "-o", str(tmp_path / "x.json")])
    assert proc.returncode == 2 and proc.stderr.startswith("error: no trace files") and "Traceback" not in proc.stderr
