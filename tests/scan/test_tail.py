"""Online detection reads a trace directory as the job writes it: each window once, when its line is
complete, and its tables are built once every rank has written it. The input it builds window by
window must be the one a load of the whole directory gives, down to the detectors' verdict."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from megatron.scan.aggregate import aggregate
from megatron.scan.detect import detect
from megatron.scan.detect.incremental import WindowedInput, differences
from megatron.scan.detect.model import from_aggregation
from megatron.scan.detect.online import analyze
from megatron.scan.detect.report import as_dict
from megatron.scan.load import MERGED_TYPES
from megatron.scan.synthetic import SyntheticRun, generate
from megatron.scan.tail import DirectoryTail
from megatron.scan.trace_format import read_rank_file


def _job(directory: Path, **kwargs) -> dict[str, list[bytes]]:
    """A synthetic job's files, as lines (header, one line per window, end record)."""
    run = SyntheticRun(**{"tp": 2, "pp": 2, "dp": 2, "iterations": 8, "window_iterations": 2, "seed": 3, **kwargs})
    paths = generate(run, directory)
    return {p.name: p.read_bytes().split(b"\n")[:-1] for p in paths}


def _write(directory: Path, lines: dict[str, list[bytes]], windows: dict[str, int]) -> None:
    """Each file with its header and its first `windows[name]` window lines."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, file_lines in lines.items():
        (directory / name).write_bytes(b"\n".join(file_lines[:1 + windows[name]]) + b"\n")


def test_a_window_is_read_once_its_line_is_complete_and_waits_are_bounded(tmp_path):
    lines = _job(tmp_path / "job")
    names = sorted(lines)
    _write(tmp_path / "run", lines, {name: 1 for name in names})
    tail = DirectoryTail(tmp_path / "run")
    assert tail.counts() == {name: 1 for name in names}
    path = tmp_path / "run" / names[0]
    second = lines[names[0]][2] + b"\n"
    with open(path, "ab") as f:
        f.write(second[:len(second) // 2])  # the writer has not finished the line
    assert tail.counts()[names[0]] == 1
    with open(path, "ab") as f:
        f.write(second[len(second) // 2:])
    assert tail.counts()[names[0]] == 2
    # What was read piecewise is what a reader of the whole file gets.
    whole = read_rank_file(path)
    part = tail.files[names[0]].part(0, 2)
    for column, kind in MERGED_TYPES.items():
        assert np.array_equal(part.columns[column], whole.columns[column].astype(kind)), column
    assert part.windows == whole.windows and part.names == whole.names and part.groups == whole.groups
    start = time.monotonic()
    tail.wait_for(world_size=len(names), windows=2, wait_s=0.5, poll_s=0.05)  # the others' second windows never come
    assert time.monotonic() - start >= 0.5
    start = time.monotonic()
    tail.wait_for(world_size=len(names), windows=1, wait_s=5.0)
    assert time.monotonic() - start < 1.0


def _verdict(data) -> str:
    report = as_dict(detect(data))
    report.pop("notes", None)  # the whole-directory load also notes each rank's missing end record
    return json.dumps(report, default=str)


def test_input_built_window_by_window_is_the_whole_directory_s(tmp_path):
    """Clock errors and drift on some hosts; at every step one rank is a window behind the others
    (its windows are a provisional part, built again until it catches up)."""
    lines = _job(tmp_path / "job", dp=4, iterations=12, window_iterations=3, offsets_ms={5: 3.0, 9: -2.0},
                 drift_ppm={7: 20.0})
    names = sorted(lines)
    late = names[5]
    run = tmp_path / "run"
    source = WindowedInput(run)
    for written in range(1, 5):
        for behind in (1, 0):
            _write(run, lines, {name: written - behind if name == late else written for name in names})
            data = source.build()
            whole = from_aggregation(aggregate(run, None, jobs=1))
            assert differences(data, whole) == [], (written, behind)
            assert _verdict(data) == _verdict(whole), (written, behind)
            assert source.done == written - behind  # windows every rank has are built once and kept
            # the compute statistics joined from each window's (differences compared them)
            assert data.compute_stats is not None
    tail = source.tail.files[names[0]]
    assert all(columns is None for columns in tail.columns)  # the events of built windows were let go


def test_a_restarted_job_s_directory_is_read_whole(tmp_path):
    lines = _job(tmp_path / "job", iterations=8, window_iterations=4)
    run = tmp_path / "run"
    _write(run, lines, {name: 2 for name in lines})
    name = sorted(lines)[0]
    header = json.loads(lines[name][0])
    restarted = [json.dumps({**header, "attempt": 1, "start_iteration": 4}).encode(), lines[name][2]]
    (run / name.replace(".json", "-attempt1.json")).write_bytes(b"\n".join(restarted) + b"\n")
    source = WindowedInput(run)
    assert source.build() is None and "restart" in source.unusable
    assert all(c is None for t in source.tail.files.values() for c in t.columns)  # no second copy of the events
    online = analyze(run, 0, 7, {}, source=source)
    whole = analyze(run, 0, 7, {})
    assert online is not None and online == whole


def test_when_aligned_clocks_leave_the_whole_trace_worse_every_window_is_on_raw_clocks(tmp_path):
    """Without clock errors the fitted corrections are noise; each window's alone passes, but over
    the whole trace they leave the collective finish spread worse, and a whole load keeps every
    clock raw. Built window by window, the input must do the same."""
    lines = _job(tmp_path / "job")
    run = tmp_path / "run"
    source = WindowedInput(run)
    for written in range(1, 5):
        _write(run, lines, {name: written for name in lines})
        data = source.build()
    aggregation = aggregate(run, None, jobs=1)
    assert any("every clock kept raw" in note for note in aggregation.alignment.notes)
    whole = from_aggregation(aggregation)
    assert differences(data, whole) == []
    assert _verdict(data) == _verdict(whole)


def test_with_a_history_each_analysis_covers_the_newest_windows_and_lets_older_ones_go(tmp_path):
    """--online-detect-history: at every step the input is a whole load of a directory holding only
    the newest windows with at least `history` iterations (5 of 3-iteration windows: the newest 2),
    down to the verdict; older windows' tables and metrics are let go, so a long run's memory and
    analysis time stay bounded."""
    lines = _job(tmp_path / "job", dp=4, iterations=18, window_iterations=3, offsets_ms={5: 3.0, 9: -2.0},
                 drift_ppm={7: 20.0})
    names = sorted(lines)
    run = tmp_path / "run"
    source = WindowedInput(run, history=5)
    for written in range(1, 7):
        _write(run, lines, {name: written for name in names})
        data = source.build()
        kept = min(written, 2)
        only = tmp_path / f"only{written}"  # header and the newest `kept` windows of every file
        only.mkdir()
        for name, file_lines in lines.items():
            (only / name).write_bytes(b"\n".join([file_lines[0], *file_lines[1 + written - kept:1 + written]]) + b"\n")
        whole = from_aggregation(aggregate(only, None, jobs=1))
        assert np.unique(data.compute["iteration"]).tolist() == list(range(3 * (written - kept), 3 * written))
        assert differences(data, whole) == [], written
        assert _verdict(data) == _verdict(whole), written
        assert len(source.committed) == kept and source.forgotten == written - kept
    tail = source.tail.files[names[0]]
    assert all(set(meta) == {"window", "iterations"} for meta in tail.windows[:4])  # no metrics kept
    assert all("metrics" in meta for meta in tail.windows[4:])


def test_the_analysis_process_covers_the_history_asked_for(tmp_path):
    """--online-detect-history reaches the analysis process: with 6, each analysis of a job of
    3-iteration windows covers its newest 2 windows, and says so in online_abnormal.json."""
    from megatron.scan.detect.online import OnlineDetector

    lines = _job(tmp_path / "job", dp=4, iterations=18, window_iterations=3)
    detector = OnlineDetector(tmp_path / "run", world_size=len(lines), history=6, wait_s=5.0)
    try:
        for written in range(2, 7):
            _write(tmp_path / "run", lines, {name: written for name in lines})
            detector.submit(written, 3 * written - 6, 3 * written - 1)
            deadline = time.monotonic() + 60
            path = tmp_path / "run" / "online_abnormal.json"
            while time.monotonic() < deadline and not (
                    path.exists() and json.loads(path.read_text())["history"][1] == 3 * written - 1):
                time.sleep(0.05)
            assert json.loads(path.read_text())["history"] == [3 * written - 6, 3 * written - 1]
    finally:
        detector.close()
    assert detector.worker.returncode == 0


def test_the_default_history_keeps_ranks_times_iterations_bounded():
    """50 traced iterations for small jobs; fewer for large ones, so one analysis's memory and
    time stay near those measured at 4,096 ranks x 20 iterations; never fewer than 20."""
    from megatron.scan.detect.online import default_history

    assert [default_history(n) for n in (1, 4, 1024, 1638, 2048, 4096, 16384)] == [50, 50, 50, 50, 40, 20, 20]
