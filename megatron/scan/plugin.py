"""The MegaScan trainer plugin: `--trace` flags, and the wiring of the session megatron.scan.session
builds (tracer, trace writer, gathering, capture exchange) plus the collective observer and layer
scopes into the spine's hooks. The flags and their configuration live in the session module, which
`python -m megatron.scan launch` shares; they are re-exported here, where the trainer finds them."""
from __future__ import annotations

import argparse
import atexit
import uuid

import torch.distributed as dist

from megatron.app.observer import set_observer
from megatron.app.plugins import Plugin, register_plugin
from megatron.scan.layers import LayerScopes, transformer_layers
from megatron.scan.session import (  # noqa: F401 - re-exported: the trainer's names for them
    DEFAULT_CONTINUOUS,
    DEFAULT_INTERVAL,
    DENSE_ITERATIONS,
    TraceConfig,
    add_trace_arguments,
    parse_clock_skew,
    start_trace,
)
from megatron.scan.timers import build_timer


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
        # Public: the plugins that follow (watchdog, metrics, online detection) write where it says.
        self.config = TraceConfig.from_args(cfg.args)
        self.tracer = None

    def setup(self, ctx) -> None:
        config, cfg, p = self.config, ctx.cfg, ctx.cfg.parallel
        self.session = session = start_trace(
            config, rank=ctx.rank, world_size=dist.get_world_size() if dist.is_initialized() else p.world_size,
            run_id=uuid.uuid4().hex[:16],
            coordinates={"dp": ctx.dp_rank, "pp": ctx.pp_rank, "tp": ctx.tp_rank},
            sizes={"dp": p.data_parallel_size, "pp": p.pipeline_model_parallel_size,
                   "tp": p.tensor_model_parallel_size, "vpp": cfg.num_chunks},
            timer=build_timer(ctx.backend.name, ctx.backend.device), start_iteration=ctx.iteration,
            role=ctx.role or None,
            extra={
                "device": ctx.backend.name,
                "timing": "cuda-events" if ctx.backend.name == "cuda" else "host-monotonic",
                "num_microbatches": cfg.num_microbatches,
                "schedule": [str(task) for task in ctx.schedule],
                "train_iters": cfg.training.train_iters,
                **({"role": ctx.role} if ctx.role else {}),
            })
        # Public for the plugins that follow (online detection reads the schedule, listens to control).
        self.control, self.tracer, self.gathering = session.control, session.tracer, session.gathering
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
        session = getattr(self, "session", None)
        if session is not None:
            # At exit the peers may be gone: no waiting on the last capture broadcast, less on gathering.
            shutdown = reason == "shutdown"
            session.close(reason, settle_control=shutdown, gather_timeout=600.0 if shutdown else 30.0)
