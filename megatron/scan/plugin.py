"""The MegaScan trainer plugin: `--trace` flags, and the wiring of tracer, collective observer,
layer scopes and trace writer into the spine's hooks."""
from __future__ import annotations

import argparse
import atexit
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron.app.config import ConfigError
from megatron.app.observer import set_observer
from megatron.app.plugins import Plugin, register_plugin
from megatron.scan.gather import CHUNK, DEFAULT_RATE_MB, Gathering
from megatron.scan.layers import LayerScopes, transformer_layers
from megatron.scan.timers import build_timer
from megatron.scan.trace_format import ClockSkew, TraceWriter, header_fields, trace_file_name
from megatron.scan.tracer import Tracer, WindowSchedule


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
    plugins (tracer, watchdog, metrics, online detection) write."""

    enabled: bool
    directory: Path
    interval: int
    continuous: int
    granularity: str
    clock_skews: dict[int, tuple[float, float]]
    gather: bool = True
    gather_rate_mb: float = DEFAULT_RATE_MB

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TraceConfig":
        """Raise ConfigError listing every problem with the flags."""
        problems = []
        if args.trace_interval < 1:
            problems.append(f"--trace-interval must be >= 1, got {args.trace_interval}")
        if not 1 <= args.continuous_trace_iterations <= max(1, args.trace_interval):
            problems.append(f"--continuous-trace-iterations must be in [1, --trace-interval ({args.trace_interval})], "
                            f"got {args.continuous_trace_iterations}")
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
        return cls(enabled=bool(args.trace), directory=Path(args.trace_dir), interval=args.trace_interval,
                   continuous=args.continuous_trace_iterations, granularity=args.trace_granularity,
                   clock_skews=skews, gather=args.trace_gather == "auto", gather_rate_mb=args.trace_gather_rate)


def output_directory(args: argparse.Namespace) -> Path:
    """Where MegaScan's plugins write (--trace-dir), with or without --trace."""
    return Path(args.trace_dir)


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("MegaScan tracing")
    g.add_argument("--trace", action="store_true", help="record per-rank traces of the training run")
    g.add_argument("--trace-dir", default="trace", metavar="DIR", help="where the per-rank trace files go")
    g.add_argument("--trace-interval", type=int, default=5, metavar="N",
                   help="a traced window starts every N iterations")
    g.add_argument("--continuous-trace-iterations", type=int, default=2, metavar="K",
                   help="iterations per traced window (K <= N)")
    g.add_argument("--trace-granularity", choices=["full", "coarse"], default="coarse",
                   type=lambda value: "coarse" if value == "base" else value,
                   help="coarse (or base, its name in MegatronApp): per-microbatch forward/backward, P2P, "
                        "collectives, steps; full adds per-layer scopes")
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


@register_plugin
class ScanPlugin(Plugin):
    """`--trace`: record windows of iterations on every rank into DIR/benchmark-data-*.json."""

    name = "scan"
    flag = "--trace"
    enables = ("scan_watchdog",)  # the hang watchdog is on with --trace unless --hang-timeout 0

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_trace_arguments(parser)

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(args.trace)

    def configure(self, cfg) -> None:
        self.config = TraceConfig.from_args(cfg.args)
        self.tracer = None

    def setup(self, ctx) -> None:
        config, cfg = self.config, ctx.cfg
        # One id for the whole run, so files of two runs mixed in a directory are told apart.
        holder = [uuid.uuid4().hex[:16] if ctx.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(holder, src=0)
        p = cfg.parallel
        header = header_fields(
            rank=ctx.rank,
            world_size=dist.get_world_size() if dist.is_initialized() else p.world_size,
            run_id=holder[0],
            coordinates={"dp": ctx.dp_rank, "pp": ctx.pp_rank, "tp": ctx.tp_rank},
            sizes={"dp": p.data_parallel_size, "pp": p.pipeline_model_parallel_size,
                   "tp": p.tensor_model_parallel_size, "vpp": cfg.num_chunks},
            extra={
                "device": ctx.backend.name,
                "timing": "cuda-events" if ctx.backend.name == "cuda" else "host-monotonic",
                "trace": {"interval": config.interval, "continuous": config.continuous,
                          "granularity": config.granularity},
                "num_microbatches": cfg.num_microbatches,
                "schedule": [str(task) for task in ctx.schedule],
                "train_iters": cfg.training.train_iters,
                "start_iteration": ctx.iteration,
                **({"role": ctx.role} if ctx.role else {}),
            },
        )
        skew = None
        if ctx.rank in config.clock_skews:
            offset_ms, drift_ppm = config.clock_skews[ctx.rank]
            skew = ClockSkew(offset_ns=int(offset_ms * 1e6), drift=drift_ppm * 1e-6,
                             reference_ns=header["clock_reference"]["monotonic_ns"])
        path = config.directory / trace_file_name(ctx.dp_rank, ctx.pp_rank, ctx.tp_rank, ctx.role or None)
        writer = TraceWriter(path, header, skew=skew)
        # Nodes without a shared file system: the other nodes' files stream to rank 0's directory.
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.gathering = (Gathering(writer, holder[0], ctx.rank, world, rate_mb=config.gather_rate_mb)
                          if config.gather else None)
        from megatron.scan.control import CaptureSchedule, ControlExchange

        # Windows on demand (`python -m megatron.scan capture`): rank 0 reads requests, all ranks
        # learn the agreed window over a gloo side group (created here, by every rank alike).
        schedule = CaptureSchedule(WindowSchedule(config.interval, config.continuous))
        side = dist.new_group(backend="gloo") if dist.is_initialized() and dist.get_world_size() > 1 else None
        self.control = ControlExchange(config.directory, ctx.rank, schedule, side)
        self.tracer = Tracer(writer=writer, timer=build_timer(ctx.backend.name, ctx.backend.device),
                             schedule=schedule)
        if config.granularity == "full":
            self.tracer.layer_scopes = LayerScopes(self.tracer, transformer_layers(ctx.chunks))
        self.tracer.collectives.install()
        from megatron.app.mcore_schedule import MegatronCoreSchedule

        if isinstance(ctx.executor, MegatronCoreSchedule):
            self.tracer.trace_point_to_point()  # megatron-core's P2P, which no executor span surrounds
        set_observer(self.tracer)
        self.train_iters = cfg.training.train_iters
        # A rank that dies with an exception still gets its finished windows onto disk.
        atexit.register(self._close, "exit")

    def before_iteration(self, ctx, iteration: int) -> None:
        self.tracer.begin_iteration(iteration)

    def after_iteration(self, ctx, iteration: int, metrics) -> None:
        self.control.after_iteration(iteration)  # first: a window agreed on may close the current one
        self.tracer.end_iteration(iteration, metrics, last=iteration + 1 >= self.train_iters)

    def shutdown(self, ctx) -> None:
        self._close("shutdown")

    def _close(self, reason: str) -> None:
        control = getattr(self, "control", None)
        if control is not None and reason == "shutdown":
            control.close()
        if self.tracer is not None and not self.tracer.closed:
            self.tracer.close({"reason": reason})
            if self.tracer.writer.error is not None:
                print(f"[megascan] warning: trace writer failed on {self.tracer.writer.path}: "
                      f"{self.tracer.writer.error!r}", file=sys.stderr, flush=True)
        gathering, self.gathering = getattr(self, "gathering", None), None
        if gathering is not None:  # the file is complete: the rest of it goes to rank 0
            gathering.close(timeout=600.0 if reason == "shutdown" else 30.0)
