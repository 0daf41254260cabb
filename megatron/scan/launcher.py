"""Zero-code-change tracing of any torch.distributed program: `python -m megatron.scan launch --
torchrun ... script.py` (or the MEGASCAN_* environment form) writes the same per-rank trace files,
hang dumps, crash files and metrics as the trainer, from collectives, point-to-point transfers, DDP
buckets, optimizer steps, the data wait, and the forward and backward per microbatch of the model
being trained (the outermost module called with grad whose parameters an optimizer holds). In a
megatron-core program the pipeline schedule's own forward and backward per (chunk, microbatch) are
recorded instead, and each rank's TP/PP/DP coordinates come from megatron-core's parallel state, so
pipeline stages are told apart. This module is the command: it takes the trainer's `--trace` flags
(megatron.scan.session, the same names, defaults and meaning) plus its own, and hands the workers
the parsed configuration in MEGASCAN_SESSION; what runs in each worker is megatron.scan.launch_session."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import uuid
from pathlib import Path

from megatron.app.config import ConfigError
from megatron.scan.session import (
    DEFAULT_HANG_TIMEOUT_S,
    LEGACY_TRACE_VARIABLES,
    SESSION_VARIABLE,
    TRACE_DIR_VARIABLE,
    LaunchOptions,
    TraceConfig,
    add_trace_arguments,
    arguments_from_variables,
)

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "bootstrap"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding megatron/
# What `--print-env` prints (MEGASCAN_TRACE_DIR is the switch the bootstrap looks for).
EXPORTED = ("PYTHONPATH", TRACE_DIR_VARIABLE, "MEGASCAN_RUN_ID", SESSION_VARIABLE)
# The variables earlier versions exported one per flag, still read where MEGASCAN_SESSION is not
# set (an environment written out by hand): as the flags they stood for, so with today's defaults.
LEGACY_VARIABLES = (*LEGACY_TRACE_VARIABLES, ("MEGASCAN_HANG_TIMEOUT", "--hang-timeout"),
                    ("MEGASCAN_METRICS_PORT", "--metrics-port"),
                    ("MEGASCAN_METRICS_CONTROL_TOKEN_FILE", "--metrics-control-token-file"))


# ------------------------------------------------------------------------------ the launch command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)  # the trainer's --trace flags, with its defaults: one configuration for both
    g = parser.add_argument_group("launch")
    g.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S, metavar="SECONDS",
                   help=f"dump stacks and collectives after SECONDS without progress (default "
                        f"{DEFAULT_HANG_TIMEOUT_S:g}; 0: off)")
    g.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on PORT + local rank (0: ephemeral)")
    g.add_argument("--metrics-control-token-file", default=None, metavar="FILE",
                   help="accept POST /capture on rank 0's metrics port from callers presenting the token in FILE "
                        "(`Authorization: Bearer TOKEN`); without it the port is read-only")
    g.add_argument("--inject-slowdown", action="append", default=[], metavar="RANK:FACTOR[:START_STEP]",
                   help="validation: make global rank RANK's device FACTOR x slower from optimizer step START_STEP "
                        "on (default 0): each call of the model's repeated blocks (its transformer layers) takes "
                        "FACTOR x as long, or each call of a module holding parameters (a Linear) where the model "
                        "has no such blocks; "
                        "repeatable (factors compound)")
    g.add_argument("--print-env", action="store_true",
                   help="print the environment-variable form instead of running COMMAND")
    parser.add_argument("job", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="torchrun ... script.py args")


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The configuration the workers get; raises ConfigError listing every problem with the flags."""
    problems = []
    try:
        trace = TraceConfig.from_args(args)
    except ConfigError as exc:
        problems.append(str(exc))
    if args.hang_timeout < 0:
        problems.append(f"--hang-timeout must be >= 0 seconds, got {args.hang_timeout:g}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        problems.append(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    token_file = None
    if args.metrics_control_token_file:
        from megatron.scan.control import read_control_token

        token_file = str(Path(args.metrics_control_token_file).resolve())
        try:
            read_control_token(token_file)
        except ValueError as exc:
            problems.append(str(exc))
    from megatron.scan.inject import Slowdown

    for text in args.inject_slowdown:
        try:
            Slowdown.parse(text)
        except ConfigError as exc:
            problems.append(str(exc).replace("(e.g. 2:1.5:10)", "(e.g. 2:1.25: rank 2 computes 1.25x slower)"))
    if problems:
        raise ConfigError("; ".join(problems))
    return LaunchOptions(trace=trace.launched(), hang_timeout=args.hang_timeout, metrics_port=args.metrics_port,
                         metrics_control_token_file=token_file, inject_slowdown=tuple(args.inject_slowdown))


def launch_environment(options: LaunchOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that arms tracing in every worker the command starts."""
    env = dict(os.environ if base is None else base)
    paths = [str(BOOTSTRAP_DIR), str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env[TRACE_DIR_VARIABLE] = str(options.trace.directory)
    env["MEGASCAN_RUN_ID"] = env.get("MEGASCAN_RUN_ID") or uuid.uuid4().hex[:16]
    env[SESSION_VARIABLE] = options.to_json()
    for variable, _ in LEGACY_VARIABLES:  # one source of configuration: none left over from an older launch
        env.pop(variable, None)
    return env


def options_from_environment(environ) -> LaunchOptions:
    """A worker's configuration: MEGASCAN_SESSION, or the variables of earlier versions read
    through the launch command's own flags; its trace section is TraceConfig.from_env's (which
    takes the directory MEGASCAN_TRACE_DIR names, where set)."""
    text = environ.get(SESSION_VARIABLE)
    if text:
        options = LaunchOptions.from_json(text)
    else:
        options = launch_options(arguments_from_variables(environ, LEGACY_VARIABLES,
                                                          build_parser("MEGASCAN_* variables")))
    return dataclasses.replace(options, trace=TraceConfig.from_env(environ))


def build_parser(prog: str = "python -m megatron.scan launch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="trace any torch.distributed job: launch -- torchrun ...")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command on its own (`python -m megatron.scan launch` reaches `run` through the CLI)."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    command = list(args.job)
    if command and command[0] == "--":
        command = command[1:]
    try:
        options = launch_options(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = launch_environment(options)
    if args.print_env:
        for key in EXPORTED:
            print(f"export {key}={shlex.quote(env[key])}")
        return 0
    if not command:
        print("error: nothing to launch; usage: python -m megatron.scan launch [options] -- torchrun ... script.py",
              file=sys.stderr)
        return 2
    options.trace.directory.mkdir(parents=True, exist_ok=True)
    try:
        os.execvpe(command[0], command, env)  # the job replaces us: its exit code and signals are the user's
    except OSError as exc:
        print(f"error: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached
