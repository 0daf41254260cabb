"""Progress lines of long steps (aggregation, detection): on stderr only, one final line per step
and periodic ones in between, absent with --quiet or MEGATRON_PROGRESS=0, and the outputs (the
summary on stdout, the merged trace, --json) the same with or without them."""
from __future__ import annotations

import io
import json
import re

import pytest

from launch import python
from megatron.app.progress import ENV, Reporter, progress_enabled, reporter
from megatron.scan.cli import main
from megatron.scan.synthetic import SyntheticRun, generate

RANKS = 8
LINE = re.compile(r"^\[(\w+)\] (.+?)(?: \[[#.]+\])?(?: (\d+)/(\d+)(?: \w+)?)? \((\d+\.\d) s\)$")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("progress") / "run"
    generate(SyntheticRun(tp=2, pp=2, dp=2, iterations=2, seed=3), directory)
    return directory


def progress_lines(text: str, tool: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"[{tool}] ")]


def events(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_aggregation_reports_each_step_on_stderr_only(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert main(["aggregate", str(run_dir), "-o", str(tmp_path / "with.json"), "-j", "2"]) == 0
    shown = capsys.readouterr()
    lines = progress_lines(shown.err, "aggregate")
    assert f"[aggregate] loading rank files {RANKS}/{RANKS} (" in shown.err
    assert f"[aggregate] merging rank files {RANKS}/{RANKS} (" in shown.err
    for step in ("matching collectives and P2P messages 2/2", "aligning clocks", "writing the merged trace"):
        assert any(step in line for line in lines), (step, shown.err)
    for line in lines:
        match = LINE.match(line)
        assert match, line
        if match.group(3):
            assert int(match.group(3)) <= int(match.group(4)), line
    assert "[aggregate]" not in shown.out and shown.out.startswith(f"wrote {tmp_path / 'with.json'}: {RANKS} ranks")

    monkeypatch.setenv(ENV, "0")
    assert main(["aggregate", str(run_dir), "-o", str(tmp_path / "without.json"), "-j", "2"]) == 0
    silent = capsys.readouterr()
    assert "[aggregate]" not in silent.err
    assert silent.out.replace("without.json", "with.json") == shown.out  # the same summary, byte for byte
    assert events(tmp_path / "without.json") == events(tmp_path / "with.json")

    monkeypatch.delenv(ENV)
    assert main(["aggregate", str(run_dir), "-o", str(tmp_path / "quiet.json"), "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.out == "" and "[aggregate]" not in quiet.err


def test_detection_progress_stays_out_of_json_and_is_silenceable(run_dir, tmp_path):
    shown = python(["-m", "megatron.scan", "detect", str(run_dir), "--json", "--output-dir", str(tmp_path / "a")],
                   extra_env={ENV: "1"})
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)  # nothing but the JSON on stdout
    lines = progress_lines(shown.stderr, "detect")
    assert any(f"loading rank files {RANKS}/{RANKS}" in line for line in lines), shown.stderr
    assert any(re.search(rf"analyzing {RANKS} ranks .* 4/4 \(", line) for line in lines), shown.stderr
    assert any("writing reports" in line for line in lines)
    silent = python(["-m", "megatron.scan", "detect", str(run_dir), "--json", "--output-dir", str(tmp_path / "b")],
                    extra_env={ENV: "0"})
    assert silent.returncode == 0 and "[detect]" not in silent.stderr, silent.stderr
    assert json.loads(silent.stdout) == report


def test_aggregate_script_with_detection(run_dir, tmp_path):
    args = ["scripts/aggregate.py", "-b", str(run_dir), "-o", str(tmp_path / "merged.json"), "-d"]
    shown = python(args, extra_env={ENV: "1"})
    assert shown.returncode == 0, shown.stderr
    assert progress_lines(shown.stderr, "aggregate") and progress_lines(shown.stderr, "detect")
    assert "[aggregate]" not in shown.stdout and "[detect]" not in shown.stdout
    # Detection reads the aggregation that wrote the merged trace: the rank files are loaded once,
    # and the verdict is the one `detect` gives on its own.
    assert not any("loading rank files" in line for line in progress_lines(shown.stderr, "detect")), shown.stderr
    alone = python(["-m", "megatron.scan", "detect", str(run_dir), "--json", "--output-dir", str(tmp_path / "alone")])
    assert json.loads((run_dir / "abnormal.json").read_text()) == json.loads(alone.stdout)
    quiet = python([*args, "--quiet"], extra_env={ENV: "1"})
    assert quiet.returncode == 0 and "[aggregate]" not in quiet.stderr and "[detect]" not in quiet.stderr
    assert "[detect]" not in quiet.stdout


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_lines_are_throttled_and_end_with_a_final_one():
    stream = _Stream(tty=False)
    with Reporter("tool", stream=stream).step("counting", 1000) as step:
        for _ in range(1000):
            step.update()  # far faster than the 2 s interval: no line until the step ends
    assert re.fullmatch(r"\[tool\] counting 1000/1000 \(\d+\.\d s\)\n", stream.getvalue())

    stream = _Stream(tty=False)
    items = list(Reporter("tool", stream=stream, interval=0).iterate("items", range(3)))
    assert items == [0, 1, 2]
    assert [line.split(" (")[0] for line in stream.getvalue().splitlines()] == [
        "[tool] items 1/3", "[tool] items 2/3", "[tool] items 3/3"]  # no repeat of the last line

    terminal = _Stream(tty=True)
    with Reporter("tool", stream=terminal, interval=0).step("bar", 4) as step:
        step.update(2)
    drawn = terminal.getvalue()
    assert drawn.startswith("\r[tool] bar [##########..........] 2/4 (") and drawn.endswith("\x1b[K\n")
    assert drawn.count("\n") == 1  # redrawn in place, one line break when the step ends


def test_silenced(monkeypatch):
    stream = _Stream(tty=True)
    for value in ("0", "off", "false", "no"):
        monkeypatch.setenv(ENV, value)
        assert not progress_enabled()
        with reporter("tool", stream=stream).step("nothing", 2) as step:
            step.update(2)
    monkeypatch.setenv(ENV, "1")
    assert progress_enabled() and not progress_enabled(quiet=True)
    with reporter("tool", quiet=True, stream=stream).step("nothing", 2) as step:
        step.update(2)
    assert stream.getvalue() == ""
