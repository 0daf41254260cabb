"""Capture on demand against a running 4-rank job (PP=2 x DP=2 on CPU): `python -m megatron.scan
capture --job DIR --iterations 3` while it trains gives every rank exactly that window, from an
iteration they agreed on, beside its launch-time schedule."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from launch import ROOT, env, free_port, kill_tree
from megatron.scan.control import CaptureSchedule
from megatron.scan.load import load_directory
from megatron.scan.tracer import WindowSchedule

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "256",
         "--device", "cpu"]


def traced_iterations(directory) -> dict[int, list[list[int]]]:
    trace = load_directory(directory, jobs=1)
    return {rank: [[m["iteration"] for m in meta.get("metrics") or []] for meta in metas]
            for rank, metas in trace.windows.items()}


def capture_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron.scan", "capture", *args, "--wait", "60"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=90)


def while_training(tmp_path, flags: list[str], ask, ready=lambda: True):
    """Starts the 4-rank PP=2 job with `flags`, calls `ask()` once it passed iteration 10 and
    `ready()` holds, and waits for the job to end well. Returns (ask's result, the job's log)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "pretrain_gpt.py", *MODEL, "--pipeline-model-parallel-size", "2",
               "--trace", "--trace-dir", str(tmp_path), *flags]
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not ("iteration       10/" in log_path.read_text() and ready()) and time.monotonic() < deadline:
                assert job.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.3)
            asked = ask()
            assert job.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        finally:
            kill_tree(job.pid)
    return asked, log_path.read_text()


def test_a_capture_asked_of_a_running_job_traces_exactly_that_window_on_every_rank(tmp_path):
    asked, _ = while_training(tmp_path, ["--train-iters", "150", "--trace-interval", "1000",
                                         "--continuous-trace-iterations", "1"],
                              lambda: capture_cli("--job", str(tmp_path), "--iterations", "3"))
    assert asked.returncode == 0, asked.stdout + asked.stderr
    words = asked.stdout.split("iterations ")[1].split(" are traced")[0]
    start, end = (int(v) for v in words.split(".."))
    assert end == start + 2 and start >= 12, asked.stdout
    windows = traced_iterations(tmp_path)
    assert sorted(windows) == [0, 1, 2, 3]
    for rank, found in windows.items():
        # The launch-time window (iteration 0 of every 1000) and exactly the captured one.
        assert found == [[0], [start, start + 1, start + 2]], (rank, found)
    assert not list((tmp_path / "control").glob("request-*.json"))  # taken and answered


def test_a_schedule_change_and_captures_compose():
    schedule = CaptureSchedule(WindowSchedule(10, 2))
    schedule.captures.append((15, 3))
    schedule.changes.append((30, WindowSchedule(4, 1)))
    traced = [i for i in range(40) if schedule.is_traced(i)]
    ends = [i for i in range(40) if schedule.is_window_end(i)]
    assert traced == [0, 1, 10, 11, 15, 16, 17, 20, 21, 32, 36]
    assert ends == [1, 11, 17, 21, 32, 36]
    schedule.captures.append((21, 2))  # a capture starting inside a regular window closes it first
    assert schedule.is_window_end(20) and schedule.is_window_end(22) and not schedule.is_window_end(21)


def test_capture_through_rank_zeros_metrics_port_needs_the_token(tmp_path):
    """The same request over HTTP: refused without the token (401) and on another rank's port
    (409); with it, the CLI gets the agreed window and the trace has exactly that window."""
    import json
    import urllib.error
    import urllib.request

    from megatron.scan.metrics import read_targets

    token = tmp_path / "token"
    token.write_text("s3cret-token-of-this-test\n")

    def ask():
        targets = read_targets(tmp_path)
        codes = []
        for rank, headers in ((0, {}), (1, {"Authorization": "Bearer s3cret-token-of-this-test"})):
            request = urllib.request.Request(f"http://{targets[rank]}/capture", data=b'{"iterations": 2}',
                                             headers=headers)
            try:
                urllib.request.urlopen(request, timeout=10)
            except urllib.error.HTTPError as exc:
                codes.append((exc.code, json.loads(exc.read())["error"]))
        assert codes[0][0] == 401 and codes[1][0] == 409 and "rank 0" in codes[1][1], codes
        return capture_cli("--job", f"http://{targets[0]}", "--token-file", str(token), "--iterations", "2")

    asked, _ = while_training(tmp_path, ["--train-iters", "150", "--trace-interval", "1000",
                                         "--continuous-trace-iterations", "1", "--metrics-port", "0",
                                         "--metrics-control-token-file", str(token)],
                              ask, ready=lambda: len(read_targets(tmp_path)) >= 4)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    start = int(asked.stdout.split("iterations ")[1].split("..")[0])
    for rank, found in traced_iterations(tmp_path).items():
        assert found == [[0], [start, start + 1]], (rank, found)


def test_a_metrics_port_without_a_token_is_read_only():
    import urllib.error
    import urllib.request

    from megatron.scan.metrics import RankMetrics

    metrics = RankMetrics({"rank": 0, "world_size": 1})
    port = metrics.serve(0, "127.0.0.1")
    try:
        assert b"megascan_iterations_total" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
        try:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/capture", data=b"{}"))
            raise AssertionError("a capture was accepted by a read-only port")
        except urllib.error.HTTPError as exc:
            assert exc.code == 403
    finally:
        metrics.close()


def test_capture_works_with_the_zero_code_launcher(tmp_path):
    """A plain DDP script under `python -m megatron.scan launch` (optimizer steps are iterations):
    the same capture over rank 0's metrics port traces exactly the agreed steps on every rank."""
    from megatron.scan.metrics import read_targets

    token = tmp_path / "token"
    token.write_text("another-token-of-this-test\n")
    trace_dir = tmp_path / "trace"
    command = [sys.executable, "-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir), "--trace-interval",
               "1000", "--continuous-trace-iterations", "1", "--metrics-port", "0", "--metrics-control-token-file",
               str(token), "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(ROOT / "examples" / "scan" / "plain_ddp.py"), "--steps", "400", "--slow-rank", "1", "--slow-ms", "15"]
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while len(read_targets(trace_dir)) < 4 and time.monotonic() < deadline:
                assert job.poll() is None, log_path.read_text()[-3000:]
                time.sleep(0.2)
            asked = capture_cli("--job", f"http://{read_targets(trace_dir)[0]}", "--token-file", str(token),
                                "--iterations", "4")
            assert asked.returncode == 0, asked.stdout + asked.stderr + log_path.read_text()[-3000:]
            assert job.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        finally:
            kill_tree(job.pid)
    start = int(asked.stdout.split("iterations ")[1].split("..")[0])
    assert start < 398, asked.stdout  # taken while the job ran
    windows = traced_iterations(trace_dir)
    assert sorted(windows) == [0, 1, 2, 3]
    for rank, found in windows.items():
        assert found == [[0], [start, start + 1, start + 2, start + 3]], (rank, found)


def test_online_detection_thresholds_change_on_a_running_job(tmp_path):
    """`capture --online-detect-confirm 1 --online-detect-min-slowdown 3` while the job runs: rank 0
    answers with the settings now in force and the analyses after it use them."""
    # Long enough that the request comes well before the end: with two CPU hogs on this 2-core
    # host, 60 iterations of 40-50 ms were over before the command had started.
    asked, log = while_training(tmp_path, ["--train-iters", "200", "--trace-interval", "10",
                                           "--continuous-trace-iterations", "2", "--online-detect"],
                                lambda: capture_cli("--job", str(tmp_path), "--online-detect-confirm", "1",
                                                    "--online-detect-min-slowdown", "3"))
    assert asked.returncode == 0, asked.stdout + asked.stderr
    assert "online detection now uses confirm 1, min_slowdown 3" in asked.stdout, asked.stdout
    assert "online detection settings changed" in log
    final = json.loads((tmp_path / "online_abnormal.json").read_text())
    assert final["settings"] == {"confirm": 1, "min_slowdown": 3.0}
    read_at = int(re.search(r"rank 0 read the request after iteration (\d+)", asked.stdout).group(1))
    assert final["iterations"][1] > read_at  # the last analysis came after the change


def test_bad_threshold_requests_are_refused_with_the_reason(tmp_path):
    from megatron.scan.control import ControlExchange, write_request

    exchange = ControlExchange(tmp_path, 0, CaptureSchedule(WindowSchedule(5, 1)))
    write_request(tmp_path, {"online_detect_confirm": 2})
    exchange.after_iteration(3)
    answer = json.loads(next((tmp_path / "control").glob("agreed-*.json")).read_text())
    assert "--online-detect" in answer["error"]  # this job runs no online detection
    seen = []
    exchange.settings_listeners.append(lambda settings: seen.append(settings) or {"confirm": 2, "min_slowdown": 1.2})
    for bad, why in (({"online_detect_confirm": 0}, ">= 1"), ({"online_detect_min_slowdown": 0.5}, ">= 1.0"),
                     ({"online_detect_min_slowdown": "fast"}, "numbers")):
        for path in (tmp_path / "control").glob("agreed-*.json"):
            path.unlink()
        write_request(tmp_path, bad)
        exchange.after_iteration(4)
        answer = json.loads(next((tmp_path / "control").glob("agreed-*.json")).read_text())
        assert why in answer["error"], answer
    assert not seen and not exchange.schedule.captures
