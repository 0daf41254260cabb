"""One MegaScan session, however it is started: the `--trace` flags and their typed configuration
(`TraceConfig`), shared by the trainer's plugin and `python -m megatron.scan launch`, and the
construction of what records one rank's trace from it (`start_trace`): the gloo side group and the
job's run id, the header and the writer, gathering to rank 0, the window schedule with its dense
start, the capture exchange and the tracer. A launch job's workers get the launcher's parsed
configuration as JSON in MEGASCAN_SESSION (`LaunchOptions`), so they trace what the same flags
trace in the trainer, with the same defaults; they read it with `TraceConfig.from_env`.

The trace directory is resolved once, by TraceConfig: the trainer's other MegaScan plugins take
it from the scan plugin's config (`shared_trace_config`). The watchdog with crash capture and the
metrics server are built by `watchdog.start_watchdog` and `metrics.start_rank_metrics`, next to
their classes: those modules' plugins import this one, so this module cannot import them. Nothing
here imports torch at import time: the launch command and the workers' start-up stay free of it
until a process group exists."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from megatron.app.config import ConfigError
from megatron.scan.gather import CHUNK, DEFAULT_RATE_MB

# Iterations traced without a gap at the start of a run (--trace-dense-iterations), and the windows.
DENSE_ITERATIONS = 20
DEFAULT_INTERVAL = 5
DEFAULT_CONTINUOUS = 2
DEFAULT_HANG_TIMEOUT_S = 300.0
SESSION_VARIABLE = "MEGASCAN_SESSION"
# The directory a launched worker writes to: set by `launch`, edited per node in a printed
# environment (each node its own disk); set alone, it also asks for tracing.
TRACE_DIR_VARIABLE = "MEGASCAN_TRACE_DIR"
# The trace flags' variables of earlier versions of `launch`, one per flag, still read where
# MEGASCAN_SESSION is not set (an environment written out by hand): as the flags they stand for.
LEGACY_TRACE_VARIABLES = (("MEGASCAN_TRACE_INTERVAL", "--trace-interval"),
                          ("MEGASCAN_CONTINUOUS_ITERATIONS", "--continuous-trace-iterations"),
                          ("MEGASCAN_TRACE_GATHER", "--trace-gather"))
_SESSION_VERSION = 1


def parse_clock_skew(text: str) -> tuple[int, float, float]:
    """`RANK:OFFSET_MS[:DRIFT_PPM]` -> (rank, offset ms, drift ppm)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"--trace-clock-skew wants RANK:OFFSET_MS[:DRIFT_PPM], got {text!r}")
    try:
        return int(parts[0]), float(parts[1]), float(parts[2]) if len(parts) == 3 else 0.0
    except ValueError:
        raise ValueError(f"--trace-clock-skew wants RANK:OFFSET_MS[:DRIFT_PPM] with numbers, got {text!r}") from None


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """MegaScan's typed section, from its flags: what the tracer records and where MegaScan's
    plugins (tracer, watchdog, metrics, online detection) and the launcher's ranks write."""

    enabled: bool
    directory: Path
    interval: int
    continuous: int
    granularity: str
    clock_skews: dict[int, tuple[float, float]]
    gather: bool = True
    gather_rate_mb: float = DEFAULT_RATE_MB
    dense: int = 0  # --trace-dense-iterations

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TraceConfig":
        """Raise ConfigError listing every problem with the flags."""
        problems = []
        windows_chosen = args.trace_interval is not None or args.continuous_trace_iterations is not None
        interval = DEFAULT_INTERVAL if args.trace_interval is None else args.trace_interval
        continuous = DEFAULT_CONTINUOUS if args.continuous_trace_iterations is None else args.continuous_trace_iterations
        # Windows chosen on the command line are traced exactly as asked; the dense start belongs
        # to the default settings (or to an explicit --trace-dense-iterations).
        dense = args.trace_dense_iterations if args.trace_dense_iterations is not None else \
            0 if windows_chosen else DENSE_ITERATIONS
        if interval < 1:
            problems.append(f"--trace-interval must be >= 1, got {interval}")
        if not 1 <= continuous <= max(1, interval):
            problems.append(f"--continuous-trace-iterations must be in [1, --trace-interval ({interval})], "
                            f"got {continuous}")
        if dense < 0:
            problems.append(f"--trace-dense-iterations must be >= 0 (0: no dense start), got {dense}")
        if not args.trace_gather_rate > 0:
            problems.append(f"--trace-gather-rate must be > 0 MB/s, got {args.trace_gather_rate}")
        skews = {}
        for text in args.trace_clock_skew:
            try:
                rank, offset_ms, drift_ppm = parse_clock_skew(text)
                skews[rank] = (offset_ms, drift_ppm)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ConfigError("; ".join(problems))
        return cls(enabled=bool(args.trace), directory=Path(args.trace_dir), interval=interval,
                   continuous=continuous, granularity=args.trace_granularity, dense=dense,
                   clock_skews=skews, gather=args.trace_gather == "auto", gather_rate_mb=args.trace_gather_rate)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "directory": str(self.directory),
                "clock_skews": {str(rank): list(skew) for rank, skew in self.clock_skews.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TraceConfig":
        # JSON keys are strings and tuples come back as lists.
        return cls(**{**data, "directory": Path(data["directory"]),
                      "clock_skews": {int(rank): (float(skew[0]), float(skew[1]))
                                      for rank, skew in data.get("clock_skews", {}).items()}})

    def launched(self) -> "TraceConfig":
        """The configuration of a launched job: it always traces, and its workers may start in
        another directory than the launch command (the directory made absolute)."""
        return replace(self, enabled=True, directory=self.directory.resolve())

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "TraceConfig":
        """A launched worker's configuration: the one `launch` parsed (MEGASCAN_SESSION) or, in an
        environment written by hand without it, the trace flags LEGACY_TRACE_VARIABLES stand for
        (with the flags' defaults); in the directory MEGASCAN_TRACE_DIR names wherever it is set.
        Raises ValueError (ConfigError for values the flags refuse)."""
        text = environ.get(SESSION_VARIABLE)
        if text:
            config = LaunchOptions.from_json(text).trace
        else:
            parser = argparse.ArgumentParser(prog="MEGASCAN_* variables", add_help=False)
            add_trace_arguments(parser)
            config = cls.from_args(arguments_from_variables(environ, LEGACY_TRACE_VARIABLES, parser)).launched()
        directory = environ.get(TRACE_DIR_VARIABLE)
        if directory and Path(directory) != config.directory:
            config = replace(config, directory=Path(directory))
        return config


def launch_requested(environ: Mapping[str, str]) -> bool:
    """Whether `launch` (or its printed environment) asked this process to trace."""
    return bool(environ.get(SESSION_VARIABLE) or environ.get(TRACE_DIR_VARIABLE))


def arguments_from_variables(environ: Mapping[str, str], variables: tuple[tuple[str, str], ...],
                             parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The flags that environment `variables` ((variable, flag) pairs) stand for, parsed by
    `parser`; ValueError where a value is not one the flag takes (argparse would exit)."""
    argv = []
    for variable, flag in variables:
        if environ.get(variable):
            argv += [flag, environ[variable]]
    try:
        return parser.parse_args(argv)
    except SystemExit:  # argparse exits on a bad value; a worker must not
        raise ValueError(f"cannot read the MEGASCAN_* variables as flags: {' '.join(argv)}") from None


def shared_trace_config(peers: Mapping[str, Any], args: argparse.Namespace) -> TraceConfig:
    """The trace configuration MegaScan's other trainer plugins (watchdog, metrics, online
    detection) write by: the scan plugin's public `config`, built once from the flags, where
    --trace is on (they follow the scan plugin, so it is configured first); without --trace the
    same constructor on the same flags (`enabled` False): a watchdog or a metrics server without
    tracing writes to --trace-dir all the same."""
    scan = peers.get("scan")
    return scan.config if scan is not None else TraceConfig.from_args(args)


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--trace` flags: the trainer's and `launch`'s alike (the launcher adds only its own)."""
    g = parser.add_argument_group("MegaScan tracing")
    g.add_argument("--trace", action="store_true", help="record per-rank traces of the training run "
                                                        "(implied by `launch`)")
    g.add_argument("--trace-dir", default="trace", metavar="DIR",
                   help="where the per-rank trace files go (and hang dumps, crash files, metrics targets)")
    g.add_argument("--trace-interval", type=int, default=None, metavar="N",
                   help=f"a traced window starts every N iterations (default {DEFAULT_INTERVAL})")
    g.add_argument("--continuous-trace-iterations", type=int, default=None, metavar="K",
                   help=f"iterations per traced window (K <= N, default {DEFAULT_CONTINUOUS})")
    g.add_argument("--trace-dense-iterations", type=int, default=None, metavar="M",
                   help=f"trace every one of the run's first M iterations (in windows of N), then K in every N: "
                        f"with 2 in 5 alone a 20-iteration run traces 8, too few to tell a rank 1.2x slower from "
                        f"noise on a busy host. Default {DENSE_ITERATIONS} when the windows are left at their "
                        f"defaults, 0 (windows only, exactly as asked) when --trace-interval or "
                        f"--continuous-trace-iterations is given")
    g.add_argument("--trace-granularity", choices=["full", "coarse"], default="full",
                   type=lambda value: "coarse" if value == "base" else value,
                   help="coarse (or base, its name in MegatronApp): per-microbatch forward/backward, P2P, "
                        "collectives, steps; full (the default) adds per-layer scopes, so that ranks without a "
                        "same-stage peer (PP-only layouts) are compared layer by layer (their cost: "
                        "docs/megascan.md). `launch` has no layer scopes: its header says what it recorded")
    g.add_argument("--trace-gather", choices=["auto", "off"], default="auto",
                   help="auto: ranks whose --trace-dir is not rank 0's (each node writing its own disk) also stream "
                        "their trace files to rank 0's --trace-dir in the background over a gloo side group, so "
                        "aggregation and online detection on rank 0's node see the whole job; off: each node "
                        "keeps only its own files")
    g.add_argument("--trace-gather-rate", type=float, default=DEFAULT_RATE_MB, metavar="MB_PER_S",
                   help=f"with --trace-gather auto: at most this many MB/s per sending rank (default "
                        f"{DEFAULT_RATE_MB:g}); memory is one {CHUNK >> 20} MiB chunk per sender, the backlog stays "
                        f"in the rank's own file")
    g.add_argument("--trace-clock-skew", action="append", default=[], metavar="RANK:OFFSET_MS[:DRIFT_PPM]",
                   help="testing: make RANK's host clock look OFFSET_MS off (and DRIFT_PPM fast) in its trace")


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """What `launch` hands its workers: the trace configuration, parsed once by the command, and
    the launcher's own flags (the trainer has these as its watchdog and metrics plugins' flags)."""

    trace: TraceConfig
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    metrics_port: int | None = None
    metrics_control_token_file: str | None = None
    inject_slowdown: tuple[str, ...] = ()  # RANK:FACTOR[:START_STEP] (validation: a slower device)

    def to_json(self) -> str:
        return json.dumps({"version": _SESSION_VERSION, "trace": self.trace.to_dict(),
                           "hang_timeout": self.hang_timeout, "metrics_port": self.metrics_port,
                           "metrics_control_token_file": self.metrics_control_token_file,
                           "inject_slowdown": list(self.inject_slowdown)},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LaunchOptions":
        data = json.loads(text)
        if data.get("version") != _SESSION_VERSION:
            raise ValueError(f"{SESSION_VARIABLE} has version {data.get('version')!r}; this MegaScan reads "
                             f"{_SESSION_VERSION} (the launch command and the workers run different versions?)")
        return cls(trace=TraceConfig.from_dict(data["trace"]), hang_timeout=float(data["hang_timeout"]),
                   metrics_port=data.get("metrics_port"),
                   metrics_control_token_file=data.get("metrics_control_token_file"),
                   inject_slowdown=tuple(data.get("inject_slowdown", ())))


class TraceSession:
    """One rank's tracing as `start_trace` built it. The caller installs what observes its program
    (collective wrappers, P2P, layer scopes, optimizer hooks) and drives iterations."""

    def __init__(self, config, run_id, side, writer, gathering, schedule, control, tracer) -> None:
        self.config, self.run_id, self.side = config, run_id, side
        self.writer, self.gathering, self.schedule = writer, gathering, schedule
        self.control, self.tracer = control, tracer
        self.closed = False

    def close(self, reason: str, *, end: dict[str, Any] | None = None, settle_control: bool = True,
              control_timeout: float | None = None, gather_timeout: float = 120.0, lock=None) -> None:
        """Ends the trace file and sends what rank 0 lacks. `settle_control`: wait (at most
        `control_timeout`) for the last capture broadcast, which only a rank whose peers got as far
        should do. Idempotent: a process closes at the end of training and again at exit."""
        if self.closed:
            return
        self.closed = True
        if settle_control:
            self.control.close(control_timeout)
        tracer = self.tracer
        if not tracer.closed:
            with lock or contextlib.nullcontext():  # the launcher's hooks may record from other threads
                tracer.close({"reason": reason, **(end or {})})
            if tracer.writer.error is not None:
                print(f"[megascan] warning: trace writer failed on {tracer.writer.path}: {tracer.writer.error!r}",
                      file=sys.stderr, flush=True)
        gathering, self.gathering = self.gathering, None
        if gathering is not None:  # the file is complete: the rest of it goes to rank 0
            gathering.close(timeout=gather_timeout)


def start_trace(config: TraceConfig, *, rank: int, world_size: int, run_id: str, coordinates: dict[str, int],
                sizes: dict[str, int], timer, start_iteration: int = 0, granularity: str | None = None,
                role: str | None = None, extra: dict[str, Any] | None = None) -> TraceSession:
    """Every rank of the job calls this alike, once its process group exists (it creates groups).
    `run_id`: this rank's proposal, rank 0's wins; `granularity`: what the header says is recorded,
    where that is not the flag's (the launcher has no layer scopes); `extra`: more header fields."""
    import torch.distributed as dist

    from megatron.scan.control import CaptureSchedule, ControlExchange
    from megatron.scan.trace_format import (
        ClockSkew,
        TraceWriter,
        earlier_attempt,
        elastic_identity,
        header_fields,
        trace_file_name,
    )
    from megatron.scan.tracer import Tracer, WindowSchedule

    joined = dist.get_world_size() if dist.is_initialized() else 1
    # A torchrun restart (--max-restarts), or the same command run again from its checkpoint,
    # continues the run: rank 0 finds the files the earlier attempt wrote, proposes their run id
    # and the next attempt number, and this attempt's files carry that number (the loader joins them).
    attempt, elastic = 0, elastic_identity()
    if rank == 0:
        earlier = earlier_attempt(config.directory, elastic, resumed=start_iteration > 0, world_size=world_size,
                                  sizes=sizes)
        if earlier is not None:
            attempt, run_id = earlier[0] + 1, earlier[1]
    # A gloo side group for MegaScan's own exchanges (the run id now, capture decisions later),
    # created by every rank alike, so that they never queue behind the program's NCCL work.
    side = dist.new_group(backend="gloo") if joined > 1 else None
    if side is not None:  # one id for the whole job, so files of two runs in one directory are told apart
        holder = [run_id, attempt, elastic]
        dist.broadcast_object_list(holder, src=0, group=side)
        run_id, attempt, elastic = holder
    dense_until = start_iteration + config.dense
    header = header_fields(
        rank=rank, world_size=world_size, run_id=run_id, coordinates=coordinates, sizes=sizes,
        extra={**(extra or {}), "start_iteration": start_iteration, "attempt": attempt, "elastic_id": elastic,
               "trace": {"interval": config.interval, "continuous": config.continuous,
                         "granularity": granularity or config.granularity, "dense_until": dense_until}})
    skew = None
    if rank in config.clock_skews:
        offset_ms, drift_ppm = config.clock_skews[rank]
        skew = ClockSkew(offset_ns=int(offset_ms * 1e6), drift=drift_ppm * 1e-6,
                         reference_ns=header["clock_reference"]["monotonic_ns"])
    path = config.directory / trace_file_name(coordinates["dp"], coordinates["pp"], coordinates["tp"], role or None,
                                              attempt)
    writer = TraceWriter(path, header, skew=skew)
    gathering = None
    if config.gather:  # nodes without a shared file system: the others' files stream to rank 0's directory
        from megatron.scan.gather import Gathering

        gathering = Gathering(writer, run_id, rank, joined, rate_mb=config.gather_rate_mb)
    # Windows on demand (`python -m megatron.scan capture`): rank 0 reads requests, every rank
    # learns the agreed window over the side group.
    schedule = CaptureSchedule(WindowSchedule(config.interval, config.continuous, dense_until=dense_until))
    control = ControlExchange(config.directory, rank, schedule, side)
    tracer = Tracer(writer=writer, timer=timer, schedule=schedule)
    return TraceSession(config, run_id, side, writer, gathering, schedule, control, tracer)
