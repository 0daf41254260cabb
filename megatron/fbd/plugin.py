"""The MegaFBD trainer plugin: flags, layout checks, process-group installation and the
disaggregated step runner, wired into the spine's plugin contract."""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch.distributed as dist

from megatron.app.config import ConfigError
from megatron.app.plugins import Plugin, RankRole, register_plugin
from megatron.fbd.groups import create_groups, install_parallel_state
from megatron.fbd.layout import FBDLayout, Instance, build_layout
from megatron.fbd.runner import BackwardStep, ForwardStep
from megatron.fbd.threads import ForwardHost, make_coordinator, weight_group


def add_fbd_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("MegaFBD forward-backward disaggregation")
    g.add_argument("--forward-backward-disaggregating", action="store_true",
                   help="run each logical rank as a forward instance and a backward instance on two ranks "
                        "(data-parallel size halves)")
    g.add_argument("--ignore-forward-tensor-parallel", action="store_true",
                   help="merge the forward instances of one TP group into one rank holding the full stage")
    g.add_argument("--forward-device", choices=["cuda", "cpu"], default=None,
                   help="device of the forward instances (default: the --device of the run)")
    g.add_argument("--forward-instances-per-process", type=int, default=1, metavar="N",
                   help="host N forward instances per process as threads, their collectives through the "
                        "communication coordinator; supported: N = pp with TP=1 (one process per replica)")
    g.add_argument("--fbd-loss-log", default=None, metavar="DIR",
                   help="the last stage's forward and backward instances append each microbatch's loss "
                        "to DIR/{fwd,bwd}-replica{r}.jsonl (forward loss vs the backward's recomputation)")


def layout_problems(cfg, layout_error: str | None, tracing: bool = False) -> list[str]:
    """Flag combinations FBD cannot run, each with the reason and what to do (`tracing`: the
    MegaScan tracer plugin is on)."""
    args, t, m = cfg.args, cfg.training, cfg.model
    problems = [layout_error] if layout_error else []
    if not args.forward_backward_disaggregating:
        used = [f for f, on in (("--ignore-forward-tensor-parallel", args.ignore_forward_tensor_parallel),
                                ("--forward-device", args.forward_device is not None),
                                ("--fbd-loss-log", args.fbd_loss_log is not None),
                                ("--forward-instances-per-process", args.forward_instances_per_process != 1))
                if on]
        return [f"{' and '.join(used)} only apply with --forward-backward-disaggregating; add it or drop them"]
    if t.device == "cuda":
        problems.append("--device cuda: the disaggregated step runs on the CPU backend (gloo) only in this "
                        "version; use --device cpu")
    if args.forward_device == "cuda":
        problems.append("--forward-device cuda needs CUDA backward instances, which this version does not run; "
                        "drop --forward-device or use --forward-device cpu")
    if cfg.parallel.num_layers_per_virtual_pipeline_stage and args.forward_instances_per_process > 1:
        problems.append(f"--num-layers-per-virtual-pipeline-stage with --forward-instances-per-process "
                        f"{args.forward_instances_per_process}: a forward host builds one model chunk per stage; "
                        "drop the virtual pipeline or host one forward instance per process")
    if args.forward_instances_per_process > 1:
        n = args.forward_instances_per_process
        if tracing:
            problems.append(f"--trace with --forward-instances-per-process {n}: the trace observer records one "
                            "track per process and is not thread-safe; trace with one instance per process")
    if args.ignore_forward_tensor_parallel:
        if m.attention_dropout > 0 and cfg.parallel.tensor_model_parallel_size > 1:
            problems.append(f"--attention-dropout {m.attention_dropout} with --ignore-forward-tensor-parallel: the "
                            "merged forward instance draws attention dropout from one TP stream while each "
                            "backward TP rank draws from its own, so recomputation would differ; use 0")
    return problems


@register_plugin
class FBDPlugin(Plugin):
    """`--forward-backward-disaggregating`: forward and backward instances on separate ranks."""

    name = "fbd"
    flag = "--forward-backward-disaggregating"
    conflicts = {"dpp": "FBD replaces the whole step (forward instances run ahead), so a dynamic pipeline "
                        "executor has nothing to schedule; use one or the other"}

    def __init__(self) -> None:
        self.layout: FBDLayout | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_fbd_arguments(parser)

    def enabled(self, args: argparse.Namespace) -> bool:
        # Enabled by any of its flags, so that a stray sub-flag is reported rather than ignored.
        return bool(args.forward_backward_disaggregating or args.ignore_forward_tensor_parallel
                    or args.forward_device is not None or args.fbd_loss_log is not None
                    or args.forward_instances_per_process != 1)

    def configure_layout(self, cfg):
        p = cfg.parallel
        layout_error = None
        try:
            self.layout = build_layout(p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                       bool(cfg.args.ignore_forward_tensor_parallel),
                                       cfg.args.forward_instances_per_process)
        except ConfigError as exc:
            layout_error = str(exc)
        problems = layout_problems(cfg, layout_error, tracing="scan" in self.peers)
        if problems:
            raise ConfigError("invalid configuration for forward-backward disaggregation:\n  " + "\n  ".join(problems))
        # The backward instances are the training mesh: tp x pp x dp/2; validation checks it.
        parallel = dataclasses.replace(p, world_size=self.layout.mesh_size)
        me = self.layout.instance(int(os.environ.get("RANK", "0")))
        if me.is_forward and self.layout.ignore_forward_tp:
            # This rank's model: the whole stage (TP=1), one per replica and stage.
            parallel = dataclasses.replace(parallel, tensor_model_parallel_size=1,
                                           world_size=self.layout.pp * self.layout.replicas)
        return dataclasses.replace(cfg, parallel=parallel)

    def rank_role(self, cfg, rank: int) -> RankRole:
        """fwd or bwd; the forward instance is secondary (its backward instance prints the log and
        writes checkpoints)."""
        me = self.layout.instance(rank)
        return RankRole(name=me.role, secondary=me.is_forward)

    def model_parallel_initializer(self, cfg):
        layout = self.layout

        def initialize(tp: int, pp: int, vpp: int | None) -> None:
            if dist.get_world_size() != layout.world_size:
                raise ConfigError(f"FBD layout is for {layout.world_size} ranks, but the job has {dist.get_world_size()}")
            install_parallel_state(layout, create_groups(layout), dist.get_rank(), vpp)
            if dist.get_rank() == 0:
                print(layout.physical_map() + "\n" + layout.virtual_map(), flush=True)

        return initialize

    def make_step_runner(self, ctx):
        return make_step(ctx, self.layout, self.layout.instance(ctx.rank))

    def load_checkpoint(self, ctx):
        """A forward instance receives its weights from its backward instance(s) at the start of every
        iteration, so it resumes only the iteration, consumed samples and RNG state, from the file of
        its backward twin (TP rank 0's for a merged forward instance, stage 0's for a threaded host).
        The backward instances load everything as usual."""
        me = self.layout.instance(ctx.rank)
        if not me.is_forward:
            return None
        from megatron.app import checkpoint as ckpt

        return ckpt.load_progress(ctx.cfg.checkpoint.load, ctx.cfg, me.tp_rank, me.stage,
                                  any_tensor_parallel_size=self.layout.ignore_forward_tp)

    def make_evaluator(self, ctx):
        """Evaluation runs on the backward instances (the training mesh, a complete pipeline holding
        the weights just stepped); forward instances would only hold the previous iteration's."""
        if self.layout.instance(ctx.rank).is_forward:
            return lambda ctx, iteration: None
        return None

    def shutdown(self, ctx) -> None:
        # Threaded forward hosts: every process leaves the coordinator's rounds together.
        runner = ctx.step_runner
        coordinator = getattr(runner, "coordinator", None)
        if coordinator is not None:
            coordinator.close(timeout=60)


def make_step(ctx, layout: FBDLayout, me: Instance):
    """This rank's step runner: its forward or backward instance (a forward host of threads when
    several forward instances share a process)."""
    if layout.threaded:
        coordinator = make_coordinator(layout)  # collective: every rank builds it, in the same order
        if me.is_forward:
            return ForwardHost(ctx, layout, coordinator)
        return BackwardStep(ctx, layout, me, coordinator, weight_group(layout, me.replica, me.stage))
    return (ForwardStep if me.is_forward else BackwardStep)(ctx, layout, me)
