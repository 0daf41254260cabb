"""The trainer: config -> distributed -> model chunks -> data -> loop -> shutdown.

Each iteration runs the pipeline schedule, syncs gradients, steps the optimizer, logs, and
checkpoints. Plugins hook in through megatron.app.plugins; nothing here tests their flags.
(Over 400 lines: set-up, the step's actions and the loop are one sequence, read together.)
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron.app import checkpoint as ckpt
from megatron.app import megatron_lm
from megatron.app.activation_memory import report_peak
from megatron.app.arguments import build_parser, config_from_args
from megatron.app.config import ConfigError, RunConfig, validate
from megatron.app.data import DataError
from megatron.app.device import DeviceBackend, DeviceError, build_backend, enable_deterministic_mode
from megatron.app.executor import (IterationPlan, IterationResult, IterationSteps, LossOptions, PipelineExecutor,
                                   StageContext, activation_shape)
from megatron.app.learning_rate import set_learning_rate
from megatron.app.logs import MetricsLogger, print_rank_0
from megatron.app.mcore_schedule import MegatronCoreSchedule
from megatron.app.microbatches import MicrobatchPlan
from megatron.app.model import build_model_chunks, count_parameters, unwrap_model
from megatron.app.observer import span
from megatron.app.plugins import PluginSet, RankRole, available_plugins, resolve_plugins
from megatron.app.schedule import ZERO_BUBBLE_SCHEDULES, PipelineLayout, build_schedule
from megatron.app.tokenizer import TokenizerError
from megatron.app.training_data import TrainingData
from megatron.app.transport import TorchDistributedTransport


@dataclass(kw_only=True)
class TrainContext:
    """Everything a plugin may look at or replace, built once per run."""

    cfg: RunConfig
    backend: DeviceBackend
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    # What this rank is where a plugin splits ranks into roles (its `rank_role`): the role's name
    # (in trace file names), and whether the rank is secondary: it mirrors state held by another
    # rank, joins every collective, but prints no training log and writes no checkpoint files.
    role: str = ""
    secondary: bool = False
    chunks: list = field(default_factory=list)
    optimizer: Any = None
    executor: Any = None
    transport: Any = None  # the P2P transport, made once and wrapped by the plugins (`make_transport`)
    data: TrainingData | None = None
    schedule: list = field(default_factory=list)
    layout: PipelineLayout | None = None
    stage: StageContext | None = None  # this rank's place in the pipeline, for any executor
    iteration: int = 0
    consumed_samples: int = 0
    loss: LossOptions = LossOptions()  # how the last stage's loss starts backward (every executor's)
    step_runner: Any = None
    evaluator: Any = None  # (ctx, iteration) -> validation loss, or None where this rank has none
    plugins: PluginSet | None = None  # the enabled plugins, whose hooks compose values for the spine
    _schedules: dict = field(default_factory=dict)  # microbatch count -> (layout, static order)

    def make_transport(self):
        """This rank's P2P transport, as every executor of it gets it: a plugin's `make_transport`,
        else torch.distributed's, wrapped by each plugin's `wrap_transport` in order."""
        plugins = self.plugins or PluginSet([])
        base = plugins.first("make_transport", self) or TorchDistributedTransport()
        return plugins.compose("wrap_transport", base, self)

    @property
    def is_logging_rank(self) -> bool:
        """First rank (tp 0, dp 0) of the last pipeline stage prints the training log."""
        pp = self.cfg.parallel.pipeline_model_parallel_size
        return self.pp_rank == pp - 1 and self.tp_rank == 0 and self.dp_rank == 0 and not self.secondary


def pick_schedule_name(cfg: RunConfig) -> str:
    """The static order this trainer builds (for megatron-core's schedule: the order it runs)."""
    name = cfg.training.pipeline_schedule
    if name in ("auto", MegatronCoreSchedule.schedule_name):
        return "interleaved" if cfg.num_chunks > 1 else "1f1b"
    return name


def splits_backward(cfg: RunConfig, plugins: PluginSet) -> bool:
    """Whether each backward runs as I and W: a zero-bubble order, or a plugin's executor that asks."""
    return pick_schedule_name(cfg) in ZERO_BUBBLE_SCHEDULES or bool(plugins.first("split_backward", cfg))


def schedule_name(ctx: TrainContext) -> str:
    """What runs an iteration, for the start-up line: a plugin's step runner or executor may name it."""
    for runner in (ctx.step_runner, ctx.executor):
        name = getattr(runner, "schedule_name", None)
        if name:
            return name
    return pick_schedule_name(ctx.cfg)


def setup(cfg: RunConfig, plugins: PluginSet) -> TrainContext:
    from megatron.core import parallel_state

    if cfg.model.deterministic_mode:
        enable_deterministic_mode()
    backend = build_backend(cfg.training.device)
    backend.init_distributed(timeout_s=cfg.training.distributed_timeout_minutes * 60)
    p = cfg.parallel
    backend.init_model_parallel(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
        cfg.num_chunks if cfg.num_chunks > 1 else None, cfg.training.seed,
        initialize=plugins.first("model_parallel_initializer", cfg),
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    data = TrainingData.build(cfg, dp_rank=dp_rank, device=backend.device)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=data.vocab_size))
    rank = dist.get_rank()
    role = plugins.first("rank_role", cfg, rank) or RankRole()
    ctx = TrainContext(
        cfg=cfg,
        backend=backend,
        rank=rank,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=dp_rank,
        role=role.name,
        secondary=role.secondary,
        data=data,
        plugins=plugins,
    )
    chunks = build_model_chunks(cfg.model, p, cfg.num_chunks, cfg.training.seed, backend.model_construction)
    params = count_parameters(chunks)
    print(f"[rank {ctx.rank}] tp={ctx.tp_rank} pp={ctx.pp_rank} dp={ctx.dp_rank} "
          f"chunks={len(chunks)} parameters={params:,}", flush=True)
    ctx.chunks = backend.wrap_model(chunks, cfg)
    ctx.optimizer = backend.build_optimizer(ctx.chunks, cfg.optimizer)
    load, step = cfg.checkpoint.load, cfg.checkpoint.ckpt_step
    if step is not None and not load:
        raise ckpt.CheckpointError(f"--ckpt-step {step} needs --load DIR, the directory holding iter_{step:07d}")
    if load and step is None and not ckpt.has_checkpoint(load) and not cfg.checkpoint.exit_on_missing_checkpoint:
        # Megatron-LM's behaviour, which scripts passing the same directory to --save and --load rely on.
        print_rank_0(f"warning: no checkpoint to load in --load {load} (no {ckpt.TRACKER}); starting from "
                     "scratch (--exit-on-missing-checkpoint makes this an error)")
        load = None
    if load:
        failure = None
        try:
            ctx.iteration, ctx.consumed_samples = plugins.first("load_checkpoint", ctx) or ckpt.load_checkpoint(
                cfg.checkpoint.load, ctx.chunks, ctx.optimizer, cfg, ctx.tp_rank, ctx.pp_rank
            )
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
            failure = exc
        ckpt.agree_on_load(failure)  # a damaged file found by one rank stops every rank here
        print_rank_0(f"loaded checkpoint from {cfg.checkpoint.load} at iteration {ctx.iteration}"
                     + (f" (--ckpt-step {step})" if step is not None else ""))
    if cfg.checkpoint.save:
        ckpt.check_room_for_next_save(cfg.checkpoint.save, ctx.rank)

    ctx.layout = PipelineLayout(pp_size=p.pipeline_model_parallel_size, num_chunks=cfg.num_chunks,
                                num_microbatches=cfg.num_microbatches, split_backward=splits_backward(cfg, plugins))
    ctx.schedule = build_schedule(pick_schedule_name(cfg), ctx.layout, ctx.pp_rank)
    ctx.stage = StageContext(
        layout=ctx.layout,
        pp_rank=ctx.pp_rank,
        pp_global_ranks=dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
        activation_shape=activation_shape(cfg),
        dtype=cfg.model.params_dtype,
        device=backend.device,
    )
    mcore = cfg.training.pipeline_schedule == MegatronCoreSchedule.schedule_name
    if not mcore:  # megatron-core's schedule sends through torch.distributed itself
        ctx.transport = ctx.make_transport()
    ctx.loss = LossOptions(scale=ctx.optimizer.scale_loss if cfg.model.fp16 else None,
                           per_token=cfg.model.calculate_per_token_loss)
    if cfg.model.fp16:
        # megatron-core's schedule scales the last stage's loss through the model config, as
        # Megatron-LM sets it (this trainer's executors through `ctx.loss`).
        for chunk in ctx.chunks:
            unwrap_model(chunk).config.grad_scale_func = ctx.optimizer.scale_loss
    ctx.executor = plugins.first("make_executor", ctx) or default_executor(ctx)
    ctx.step_runner = plugins.first("make_step_runner", ctx) or train_step
    ctx.evaluator = plugins.first("make_evaluator", ctx) or evaluate
    plugins.call("setup", ctx)
    return ctx


def default_executor(ctx: TrainContext):
    """This trainer's executor over the static order, or megatron-core's own schedule."""
    if ctx.cfg.training.pipeline_schedule == MegatronCoreSchedule.schedule_name:
        return MegatronCoreSchedule(ctx.chunks, ctx.stage)
    return PipelineExecutor(ctx.chunks, ctx.stage, ctx.transport, loss=ctx.loss,
                            measure_memory=ctx.cfg.training.report_activation_memory)


def train_step(ctx: TrainContext, plugins: PluginSet) -> dict[str, Any]:
    """One iteration: the executor runs this rank's action list, which ends with the gradient
    reduction and the optimizer step. Under a microbatch plan this replica runs its share of the
    global batch, each loss divided by the even split's count, so the step is the even split's."""
    backend = ctx.backend
    iteration = ctx.iteration
    lr = set_learning_rate(ctx)
    backend.zero_grad(ctx.chunks)
    for chunk in ctx.chunks:
        chunk.train()
    steps = IterationSteps(reduce_grads=lambda result: reduce_grads(ctx, iteration, result.num_tokens),
                           optimizer_step=lambda result: optimizer_step(ctx, plugins, iteration))
    even = MicrobatchPlan.even(ctx.cfg.parallel.data_parallel_size, ctx.layout.num_microbatches)
    microbatches = plugins.compose("plan_iteration", even, ctx, iteration)
    count = microbatches.count(ctx.dp_rank)
    layout, schedule = planned_schedule(ctx, count)
    plan = IterationPlan(layout, first_microbatch=microbatches.first(ctx.dp_rank), loss_divisor=microbatches.nominal)
    result: IterationResult = ctx.executor.run(
        schedule, lambda mb: ctx.data.train_global_microbatch(iteration, mb), steps=steps, plan=plan)
    return {"lm loss": result.mean_loss, "grad norm": result.grad_norm, "learning rate": lr,
            "updated": result.updated, "num_tokens": result.num_tokens, "microbatches": count,
            "loss scale": ctx.optimizer.loss_scale if ctx.cfg.model.fp16 else None}


def planned_schedule(ctx: TrainContext, num_microbatches: int):
    """The pipeline layout and static order for `num_microbatches` on this rank (built once per count)."""
    if num_microbatches == ctx.layout.num_microbatches:
        return ctx.layout, ctx.schedule
    if num_microbatches not in ctx._schedules:
        layout = dataclasses.replace(ctx.layout, num_microbatches=num_microbatches)
        ctx._schedules[num_microbatches] = (layout, build_schedule(pick_schedule_name(ctx.cfg), layout, ctx.pp_rank))
    return ctx._schedules[num_microbatches]


def reduce_grads(ctx: TrainContext, iteration: int, num_tokens: int = 0) -> None:
    """The REDUCE_GRADS action: data-parallel gradient sync (and the per-token division)."""
    with span("grad_sync", iteration=iteration):
        ctx.backend.finalize_grads(ctx.chunks)
        if ctx.cfg.model.calculate_per_token_loss:
            _divide_by_global_batch_tokens(ctx, num_tokens)


def optimizer_step(ctx: TrainContext, plugins: PluginSet, iteration: int) -> tuple[bool, float]:
    """The OPTIMIZER_STEP action, with the plugins' hooks around it: (updated, grad norm)."""
    plugins.call("before_optimizer_step", ctx, iteration)
    with span("optimizer", iteration=iteration):
        updated, grad_norm = ctx.optimizer.step()
    plugins.call("after_optimizer_step", ctx, iteration)
    return updated, grad_norm


def _divide_by_global_batch_tokens(ctx: TrainContext, num_tokens: int) -> None:
    counted = ctx.pp_rank == ctx.cfg.parallel.pipeline_model_parallel_size - 1 and ctx.tp_rank == 0
    divide_by_global_batch_tokens(ctx.backend, ctx.chunks, num_tokens if counted else 0,
                                  ctx.cfg.parallel.data_parallel_size)


def divide_by_global_batch_tokens(backend: DeviceBackend, chunks, num_tokens: int, dp_size: int) -> None:
    """--calculate-per-token-loss: the synced gradients are the data-parallel mean of each replica's
    summed token losses; times dp over the global batch's token count they are the gradient of the
    mean loss over every token of the global batch. `num_tokens`: this rank's share of the count
    (its last stage's tokens on one TP rank per replica, else 0); every rank learns the total."""
    total = torch.tensor([float(num_tokens)], dtype=torch.float64, device=backend.device)
    dist.all_reduce(total)
    backend.scale_grads(chunks, dp_size / max(1.0, float(total.item())))


def evaluate(ctx: TrainContext, iteration: int) -> float | None:
    cfg = ctx.cfg
    for chunk in ctx.chunks:
        chunk.eval()
    losses = []
    # Each evaluation continues where the previous one stopped in the validation set.
    evaluation = iteration // cfg.training.eval_interval - 1
    with torch.no_grad():
        for eval_step in range(cfg.training.eval_iters):
            batch_index = evaluation * cfg.training.eval_iters + eval_step
            result = ctx.executor.run(
                ctx.schedule, lambda mb: ctx.data.valid_microbatch(batch_index, mb), forward_only=True
            )
            if result.mean_loss is not None:
                losses.append(result.mean_loss)
    return sum(losses) / len(losses) if losses else None


def train(cfg: RunConfig, plugins: PluginSet) -> TrainContext:
    ctx = setup(cfg, plugins)
    cfg = ctx.cfg  # with the vocabulary size the data's tokenizer gave
    t = cfg.training
    unused = megatron_lm.not_used(cfg.args)
    if cfg.optimizer.use_distributed_optimizer and ctx.backend.name == "cpu":
        unused.append("--use-distributed-optimizer (the CPU backend keeps the whole optimizer state on every "
                      "data-parallel rank)")
    if unused:
        print_rank_0("Megatron-LM flags accepted but not used on this device:\n  " + "\n  ".join(unused))
    logger = MetricsLogger(ctx)
    print_rank_0(
        f"training: {t.train_iters} iterations, global batch {t.global_batch_size}, "
        f"{cfg.num_microbatches} microbatches of {t.micro_batch_size} per dp rank, "
        f"tp={cfg.parallel.tensor_model_parallel_size} pp={cfg.parallel.pipeline_model_parallel_size} "
        f"dp={cfg.parallel.data_parallel_size} vpp chunks={cfg.num_chunks}"
        f"{_split_note(cfg)}, "
        f"schedule {schedule_name(ctx)}, "
        f"device {ctx.backend.name}, plugins {plugins.names or 'none'}"
    )
    training_started = time.monotonic()
    while ctx.iteration < t.train_iters:
        plugins.call("before_iteration", ctx, ctx.iteration)
        started = time.perf_counter()
        with span("iteration", iteration=ctx.iteration):
            metrics = ctx.step_runner(ctx, plugins)
        ctx.iteration += 1
        ctx.consumed_samples += t.global_batch_size
        metrics["iteration_time"] = time.perf_counter() - started
        logger.record(ctx.iteration, metrics)
        plugins.call("after_iteration", ctx, ctx.iteration - 1, metrics)
        if t.eval_interval and ctx.iteration % t.eval_interval == 0:
            logger.validation(ctx.iteration, ctx.evaluator(ctx, ctx.iteration))
        c = cfg.checkpoint
        should_exit = bool(t.exit_interval and ctx.iteration % t.exit_interval == 0)
        reason = f"--exit-interval {t.exit_interval}"
        if t.exit_duration_in_mins is not None and not should_exit:
            should_exit = _all_ranks_agree_time_is_up(ctx, training_started, t.exit_duration_in_mins)
            reason = f"--exit-duration-in-mins {t.exit_duration_in_mins:g}"
        if c.save and ((c.save_interval and ctx.iteration % c.save_interval == 0)
                       or ctx.iteration == t.train_iters or should_exit):
            save(ctx)
        if should_exit:
            print_rank_0(f"exiting at iteration {ctx.iteration} ({reason})")
            break
    logger.close()
    if t.report_activation_memory:
        report_peak(ctx.executor, ctx.rank, ctx.pp_rank)
    return ctx


def _split_note(cfg: RunConfig) -> str:
    """", layers 3,5 per stage" when the pipeline's layer split is not the even one."""
    if not cfg.parallel.pipeline_layer_split:
        return ""
    return f", layers {','.join(map(str, cfg.parallel.layers_per_stage(cfg.model.num_layers)))} per stage"


def _all_ranks_agree_time_is_up(ctx: TrainContext, started: float, minutes: float) -> bool:
    """Whether any rank has trained for `minutes`; every rank learns it in the same iteration, so
    they stop together."""
    flag = torch.tensor([1 if time.monotonic() - started >= minutes * 60 else 0], dtype=torch.int32,
                        device=ctx.backend.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def save(ctx: TrainContext) -> None:
    started = time.perf_counter()
    writer_dp_rank = -1 if ctx.secondary else ctx.dp_rank  # secondaries join the barriers only
    path = ckpt.save_checkpoint(ctx.cfg.checkpoint.save, ctx.iteration, ctx.consumed_samples, ctx.chunks,
                                ctx.optimizer, ctx.cfg, ctx.tp_rank, ctx.pp_rank, writer_dp_rank)
    print_rank_0(f"saved checkpoint at iteration {ctx.iteration} to {path} "
                 f"({(time.perf_counter() - started) * 1e3:.0f} ms)")


def parse(argv: Sequence[str] | None = None) -> tuple[RunConfig, PluginSet]:
    argv = list(sys.argv[1:] if argv is None else argv)
    refused = megatron_lm.refused_prefixes(argv)
    if refused:
        raise ConfigError("this trainer does not do what these flags ask for:\n  " + "\n  ".join(refused))
    candidates = available_plugins()
    parser = build_parser(candidates)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    plugins = resolve_plugins(candidates, args)
    cfg = plugins.compose("configure_layout", cfg)
    validate(cfg)
    _check_plugins_fit(cfg, plugins)
    plugins.call("configure", cfg)
    return cfg, plugins


def _check_plugins_fit(cfg: RunConfig, plugins: PluginSet) -> None:
    """Refuse plugins that would silently bypass what the flags ask of the trainer's own step."""
    needs_trainer_step = [flag for flag, on in (("--fp16", cfg.model.fp16),
                                                 ("--calculate-per-token-loss", cfg.model.calculate_per_token_loss))
                          if on]
    mcore = cfg.training.pipeline_schedule == MegatronCoreSchedule.schedule_name
    zero_bubble = cfg.training.pipeline_schedule in ZERO_BUBBLE_SCHEDULES
    for plugin in plugins.plugins:
        runs_own = [hook for hook in ("make_executor", "make_step_runner") if plugin.overrides(hook)]
        if zero_bubble and runs_own:
            raise ConfigError(
                f"--pipeline-schedule {cfg.training.pipeline_schedule} is a static order of this trainer's "
                f"executor, which the {plugin.name} plugin replaces with its own"
                + (" (MegaDPP splits backwards with --dpp-split-backward)" if plugin.name == "dpp" else "")
                + "; drop one of the two flags")
        if needs_trainer_step and plugin.overrides("make_step_runner"):
            raise ConfigError(f"{' and '.join(needs_trainer_step)} cannot run with the {plugin.name} plugin, which "
                              "runs its own training step; drop that plugin's flag (or use --bf16 for --fp16)")
        # megatron-core's schedule drives the whole iteration: a plugin's executor, transport or
        # step would be bypassed.
        replaced = [hook for hook in ("make_executor", "make_transport", "make_step_runner") if plugin.overrides(hook)]
        if mcore and replaced:
            raise ConfigError(
                f"--pipeline-schedule megatron-core cannot run with the {plugin.name} plugin, which replaces "
                f"the pipeline's {', '.join(h.removeprefix('make_') for h in replaced)}; pick another "
                "--pipeline-schedule or drop that plugin's flag"
            )


def main(argv: Sequence[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg, plugins = parse(argv)
    except ConfigError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    ctx = None
    try:
        ctx = train(cfg, plugins)
        plugins.call("shutdown", ctx)
        return 0
    except (ConfigError, DeviceError, ckpt.CheckpointError, DataError, TokenizerError) as exc:
        print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            # Peers that already failed must not leave us waiting in a final barrier.
            try:
                dist.destroy_process_group()
            except Exception:
                pass
