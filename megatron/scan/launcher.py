"""Zero-code-change tracing of any torch.distributed program: `python -m megatron.scan launch --
torchrun ... script.py` (or the MEGASCAN_* environment form) writes the same per-rank trace files,
hang dumps, crash files and metrics as the trainer, from collectives, point-to-point transfers, DDP
buckets, optimizer steps, the data wait, and the forward and backward per microbatch of the model
being trained (the outermost module called with grad whose parameters an optimizer holds). In a
megatron-core program the pipeline schedule's own forward and backward per (chunk, microbatch) are
recorded instead, and each rank's TP/PP/DP coordinates come from megatron-core's parallel state, so
pipeline stages are told apart. This module is the command;
what runs in each worker is megatron.scan.launch_session."""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding megatron/


# ------------------------------------------------------------------------------ the launch command


def launch_environment(args: argparse.Namespace, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that arms tracing in every worker the command starts."""
    env = dict(os.environ if base is None else base)
    paths = [str(BOOTSTRAP_DIR), str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["MEGASCAN_TRACE_DIR"] = str(Path(args.trace_dir).resolve())
    env["MEGASCAN_RUN_ID"] = env.get("MEGASCAN_RUN_ID") or uuid.uuid4().hex[:16]
    env["MEGASCAN_TRACE_INTERVAL"] = str(args.trace_interval)
    env["MEGASCAN_CONTINUOUS_ITERATIONS"] = str(args.continuous_trace_iterations)
    env["MEGASCAN_HANG_TIMEOUT"] = str(args.hang_timeout)
    env["MEGASCAN_TRACE_GATHER"] = args.trace_gather
    if args.metrics_port is not None:
        env["MEGASCAN_METRICS_PORT"] = str(args.metrics_port)
    if args.metrics_control_token_file:
        env["MEGASCAN_METRICS_CONTROL_TOKEN_FILE"] = str(Path(args.metrics_control_token_file).resolve())
    return env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-dir", default="trace", metavar="DIR", help="where rank files, dumps and crash files go")
    parser.add_argument("--trace-interval", type=int, default=5, metavar="N",
                        help="a traced window starts every N optimizer steps")
    parser.add_argument("--continuous-trace-iterations", type=int, default=2, metavar="K", help="steps per window")
    parser.add_argument("--trace-gather", choices=["auto", "off"], default="auto",
                        help="auto: ranks whose --trace-dir is not rank 0's (a node's own disk) also stream their trace "
                             "files to rank 0's --trace-dir in the background; off: each node keeps only its own")
    parser.add_argument("--hang-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="dump stacks and collectives after SECONDS without progress (0: off)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on PORT + local rank (0: ephemeral)")
    parser.add_argument("--metrics-control-token-file", default=None, metavar="FILE",
                        help="accept POST /capture on rank 0's metrics port from callers presenting the token in FILE "
                             "(`Authorization: Bearer TOKEN`); without it the port is read-only")
    parser.add_argument("--print-env", action="store_true",
                        help="print the environment-variable form instead of running COMMAND")
    parser.add_argument("job", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="torchrun ... script.py args")


def run(args: argparse.Namespace) -> int:
    command = list(args.job)
    if command and command[0] == "--":
        command = command[1:]
    if args.trace_interval < 1 or not 1 <= args.continuous_trace_iterations <= args.trace_interval:
        print("error: need --trace-interval >= 1 and 1 <= --continuous-trace-iterations <= --trace-interval",
              file=sys.stderr)
        return 2
    if args.metrics_control_token_file:
        from megatron.scan.control import read_control_token

        try:
            read_control_token(args.metrics_control_token_file)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    env = launch_environment(args)
    if args.print_env:
        for key in ("PYTHONPATH", "MEGASCAN_TRACE_DIR", "MEGASCAN_RUN_ID", "MEGASCAN_TRACE_INTERVAL",
                    "MEGASCAN_CONTINUOUS_ITERATIONS", "MEGASCAN_HANG_TIMEOUT", "MEGASCAN_METRICS_PORT", "MEGASCAN_TRACE_GATHER",
                    "MEGASCAN_METRICS_CONTROL_TOKEN_FILE"):
            if key in env:
                print(f"export {key}={env[key]}")
        return 0
    if not command:
        print("error: nothing to launch; usage: python -m megatron.scan launch [options] -- torchrun ... script.py",
              file=sys.stderr)
        return 2
    Path(env["MEGASCAN_TRACE_DIR"]).mkdir(parents=True, exist_ok=True)
    try:
        os.execvpe(command[0], command, env)  # the job replaces us: its exit code and signals are the user's
    except OSError as exc:
        print(f"error: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
