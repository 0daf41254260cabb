"""Megatron-style training log lines, validation lines and optional TensorBoard scalars."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def _dp_mean(value: float, ctx) -> float:
    """Average a last-stage scalar over the data-parallel replicas."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.backend.device)
    dist.all_reduce(tensor, group=group)
    return float(tensor.item()) / dist.get_world_size(group)


class MetricsLogger:
    """Accumulates per-iteration metrics and prints every --log-interval iterations."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.interval = max(1, ctx.cfg.training.log_interval)
        self.is_last_stage = ctx.pp_rank == ctx.cfg.parallel.pipeline_model_parallel_size - 1
        self.elapsed = 0.0
        self.count = 0
        self.history: list[tuple[int, float]] = []  # (iteration, lm loss) on the logging rank
        self.writer = None
        if ctx.cfg.logging.tensorboard_dir and ctx.is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=ctx.cfg.logging.tensorboard_dir)

    def record(self, iteration: int, metrics: dict) -> None:
        self.elapsed += metrics["iteration_time"]
        self.count += 1
        if iteration % self.interval != 0 and iteration != self.ctx.cfg.training.train_iters:
            return
        loss = None
        if self.is_last_stage:
            # The dp all-reduce runs on every last-stage rank, so all of them take part.
            loss = _dp_mean(metrics["lm loss"], self.ctx)
        if self.ctx.is_logging_rank:
            t = self.ctx.cfg.training
            per_iter_ms = self.elapsed / self.count * 1e3
            line = (
                f" iteration {iteration:8d}/{t.train_iters:8d} |"
                f" consumed samples: {self.ctx.consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {per_iter_ms:.1f} |"
                f" learning rate: {metrics['learning rate']:.6E} |"
                f" global batch size: {t.global_batch_size:5d} |"
                f" lm loss: {loss:.6E} |"
                f" grad norm: {metrics['grad norm']:.3f} |"
                f" number of skipped iterations: {0 if metrics['updated'] else 1:3d} |"
            )
            print(line, flush=True)
            self.history.append((iteration, loss))
            if self.writer is not None:
                self.writer.add_scalar("lm loss", loss, iteration)
                self.writer.add_scalar("learning-rate", metrics["learning rate"], iteration)
                self.writer.add_scalar("grad-norm", metrics["grad norm"], iteration)
                self.writer.add_scalar("iteration-time", per_iter_ms / 1e3, iteration)
        self.elapsed = 0.0
        self.count = 0

    def validation(self, iteration: int, loss: float | None) -> None:
        if self.is_last_stage and loss is not None:
            loss = _dp_mean(loss, self.ctx)
        if self.ctx.is_logging_rank and loss is not None:
            ppl = math.exp(min(20.0, loss))
            bar = "-" * 100
            print(f"{bar}\n validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
                  f" lm loss PPL: {ppl:.6E} |\n{bar}", flush=True)
            if self.writer is not None:
                self.writer.add_scalar("validation lm loss", loss, iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
