"""`bash run_single.sh`, the README's first command: trains with MegaScan tracing, merges the trace,
runs slow-rank detection, and ends with a summary that names every output and the next commands;
the MegaScope command it prints serves the checkpoint it trained."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from launch import ROOT, env, free_port


def _script_env(tmp_path) -> dict:
    result = env()
    result.update(VIRTUAL_ENV=sys.prefix, PATH=os.path.dirname(sys.executable) + os.pathsep + result["PATH"],
                  OUTPUT_DIR=str(tmp_path / "out"), DATA_DIR=str(tmp_path / "data"),
                  PET_MASTER_PORT=str(free_port()))  # torchrun's --master-port, away from other tests' jobs
    result.pop("TRACE", None)
    return result


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("run_single")
    done = subprocess.run(["bash", "run_single.sh", "--", "--train-iters", "3", "--num-layers", "2",
                           "--hidden-size", "64", "--eval-iters", "1"],
                          cwd=ROOT, env=_script_env(tmp_path), capture_output=True, text=True, timeout=600)
    return tmp_path / "out", done


def test_demo_traces_aggregates_detects_and_saves(demo_run):
    out, done = demo_run
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    trace = out / "trace"
    merged = json.loads((trace / "merged_trace.json").read_text())
    assert {event.get("name") for event in merged["traceEvents"]} >= {"forward", "backward"}
    assert "<html" in (trace / "report.html").read_text().lower()
    assert "verdict" in (trace / "detection.txt").read_text()
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert " iteration        3/" in (out / "train.log").read_text()


def test_summary_names_the_outputs_and_next_commands(demo_run):
    out, done = demo_run
    summary = done.stdout.split("\noutputs:\n", 1)[1]
    for expected in (f"{out}/train.log", f"{out}/trace/merged_trace.json", "https://ui.perfetto.dev",
                     f"{out}/trace/report.html", f"{out}/checkpoints",
                     "bash run_single.sh -- --use-dpp", "bash run_single.sh -- --forward-backward-disaggregating",
                     f"python -m megatron.scope serve --load {out}/checkpoints"):
        assert expected in summary, f"{expected!r} not in the summary:\n{summary}"


def test_printed_megascope_command_serves_the_demo_checkpoint(demo_run):
    pytest.importorskip("aiohttp", reason="the MegaScope server needs aiohttp")
    out, done = demo_run
    line = next(line for line in done.stdout.splitlines() if "python -m megatron.scope serve" in line)
    command = shlex.split(line.split("#", 1)[0])
    assert command[0] == "python"
    run_env = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    process = subprocess.Popen([sys.executable, *command[1:], "--port", "0"], cwd=ROOT, env=run_env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline, seen = time.monotonic() + 180, []
        while time.monotonic() < deadline:
            text = process.stdout.readline()
            seen.append(text)
            if re.search(r"open http://127\.0\.0\.1:\d+/\?token=", text) or not text:
                break
        assert any("serving checkpoints@3" in s for s in seen) and re.search(r"open http://", "".join(seen)), \
            "".join(seen)[-3000:]
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
