"""One MegaScan session for the trainer's --trace and `python -m megatron.scan launch`: the launcher
takes the trainer's trace flags with their defaults, its workers get the same TraceConfig, and a
launched job traces what the same flags trace in the trainer (the dense start included)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

from launch import ROOT, free_port, python

from megatron.app.config import ConfigError
from megatron.scan import launcher
from megatron.scan.plugin import ScanPlugin, TraceConfig
from megatron.scan.session import DENSE_ITERATIONS, SESSION_VARIABLE, LaunchOptions

SCRIPT = ROOT / "examples" / "scan" / "plain_ddp.py"


def _trainer_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    ScanPlugin().add_arguments(parser)
    return parser


def _launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    launcher.add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def test_launch_takes_every_trace_flag_of_the_trainer_with_its_default_and_help():
    trainer, launch = _options(_trainer_parser()), _options(_launch_parser())
    assert {"--trace-interval", "--continuous-trace-iterations", "--trace-dense-iterations", "--trace-gather",
            "--trace-gather-rate", "--trace-granularity", "--trace-dir"} <= set(trainer)
    missing = set(trainer) - set(launch)
    assert not missing, f"trace flags the trainer has and launch lacks: {sorted(missing)}"
    for option, action in trainer.items():
        other = launch[option]
        assert (other.dest, other.default, other.help, other.choices, other.nargs, other.metavar) == \
               (action.dest, action.default, action.help, action.choices, action.nargs, action.metavar), option


def _through_the_environment(flags: list[str], tmp_path: Path) -> LaunchOptions:
    args = _launch_parser().parse_args(["--trace-dir", str(tmp_path), *flags])
    env = launcher.launch_environment(launcher.launch_options(args), base={})
    assert env["MEGASCAN_TRACE_DIR"] == str(tmp_path.resolve())
    return launcher.options_from_environment(env)


@pytest.mark.parametrize("flags, windows", [
    ([], (5, 2, DENSE_ITERATIONS)),  # the defaults: the dense start, then 2 in every 5
    (["--trace-interval", "4", "--continuous-trace-iterations", "2"], (4, 2, 0)),  # exactly as asked
    (["--trace-interval", "6", "--continuous-trace-iterations", "1", "--trace-dense-iterations", "3"], (6, 1, 3)),
])
def test_the_workers_get_the_trainers_config_for_the_same_flags(flags, windows, tmp_path):
    extra = ["--trace-gather", "off", "--trace-gather-rate", "3", "--trace-granularity", "coarse",
             "--trace-clock-skew", "1:25:4"]
    worker = _through_the_environment(flags + extra, tmp_path)
    trainer = TraceConfig.from_args(_trainer_parser().parse_args(["--trace", "--trace-dir", str(tmp_path.resolve()),
                                                                  *flags, *extra]))
    assert worker.trace == trainer
    assert (worker.trace.interval, worker.trace.continuous, worker.trace.dense) == windows
    assert (worker.hang_timeout, worker.metrics_port) == (300.0, None)


def test_the_launchers_own_flags_reach_the_workers(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-token-for-this-test\n")
    worker = _through_the_environment(["--hang-timeout", "0", "--metrics-port", "9400",
                                       "--metrics-control-token-file", str(token)], tmp_path)
    assert (worker.hang_timeout, worker.metrics_port, worker.metrics_control_token_file) == (0.0, 9400, str(token))


def test_an_environment_written_by_hand_is_read_through_the_same_flags(tmp_path):
    """Without MEGASCAN_SESSION (the variables of earlier versions): the flags they stand for,
    with the flags' defaults, so windows given there are traced exactly as asked."""
    bare = launcher.options_from_environment({"MEGASCAN_TRACE_DIR": str(tmp_path)})
    assert bare.trace == _through_the_environment([], tmp_path).trace
    given = launcher.options_from_environment({"MEGASCAN_TRACE_DIR": str(tmp_path), "MEGASCAN_TRACE_INTERVAL": "4",
                                               "MEGASCAN_CONTINUOUS_ITERATIONS": "2", "MEGASCAN_HANG_TIMEOUT": "60",
                                               "MEGASCAN_TRACE_GATHER": "off"})
    assert (given.trace.interval, given.trace.continuous, given.trace.dense, given.trace.gather) == (4, 2, 0, False)
    assert given.hang_timeout == 60.0
    with pytest.raises(ValueError, match="MEGASCAN_"):
        launcher.options_from_environment({"MEGASCAN_TRACE_DIR": str(tmp_path), "MEGASCAN_TRACE_INTERVAL": "five"})


def test_the_trace_dir_variable_names_the_directory(tmp_path):
    """A printed environment edited per node (its own disk) writes where MEGASCAN_TRACE_DIR says."""
    args = _launch_parser().parse_args(["--trace-dir", str(tmp_path / "a")])
    env = launcher.launch_environment(launcher.launch_options(args), base={})
    env["MEGASCAN_TRACE_DIR"] = str(tmp_path / "b")
    assert launcher.options_from_environment(env).trace.directory == tmp_path / "b"


def test_bad_flags_stop_the_launch_before_the_job_starts(tmp_path, capsys):
    for flags, message in ((["--trace-interval", "0"], "--trace-interval must be >= 1"),
                           (["--trace-interval", "3", "--continuous-trace-iterations", "4"],
                            "--continuous-trace-iterations must be in [1, --trace-interval (3)]"),
                           (["--trace-dense-iterations", "-1"], "--trace-dense-iterations must be >= 0"),
                           (["--hang-timeout", "-1"], "--hang-timeout must be >= 0")):
        args = _launch_parser().parse_args(["--trace-dir", str(tmp_path), "--print-env", *flags])
        assert launcher.run(args) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ConfigError):
        launcher.launch_options(_launch_parser().parse_args(["--trace-gather-rate", "0"]))


def test_the_session_variable_is_versioned(tmp_path):
    options = _through_the_environment([], tmp_path)
    assert LaunchOptions.from_json(options.to_json()) == options
    text = options.to_json().replace('"version":1', '"version":99')
    with pytest.raises(ValueError, match=SESSION_VARIABLE):
        LaunchOptions.from_json(text)
    assert dataclasses.replace(options, hang_timeout=5.0) != options


def _traced_iterations(path: Path) -> list[int]:
    from megatron.scan.trace_format import read_rank_file

    trace = read_rank_file(path)
    assert trace.ended, path
    return [m["iteration"] for w in trace.windows for m in w["metrics"]]


def test_a_launch_job_at_default_flags_traces_its_first_20_steps(tmp_path):
    trace_dir = tmp_path / "trace"
    proc = python(["-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir), "--",
                   sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), "--steps", "24"], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from megatron.scan.trace_format import read_rank_file

    for rank in (0, 1):
        path = trace_dir / f"benchmark-data-{rank}-pipeline-0-tensor-0.json"
        # Every one of the first 20 steps, then 2 in every 5 (steps 20-21 of 20-24).
        assert _traced_iterations(path) == list(range(20)) + [20, 21]
        header = read_rank_file(path).header
        assert header["trace"] == {"interval": 5, "continuous": 2, "dense_until": 20, "granularity": "coarse"}
    assert len({read_rank_file(p).header["run_id"] for p in trace_dir.glob("benchmark-data-*.json")}) == 1


def test_a_launch_job_traces_exactly_the_windows_asked(tmp_path):
    """One process started by `launch` directly (no torchrun), the dense start given explicitly."""
    trace_dir = tmp_path / "trace"
    proc = python(["-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir), "--trace-interval", "6",
                   "--continuous-trace-iterations", "1", "--trace-dense-iterations", "3", "--",
                   sys.executable, str(SCRIPT), "--steps", "14"], timeout=120,
                  extra_env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _traced_iterations(trace_dir / "benchmark-data-0-pipeline-0-tensor-0.json") == [0, 1, 2, 6, 12]
