"""Megatron-style training log lines, validation lines and optional TensorBoard scalars."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def _dp_mean(value: float, ctx, weight: float = 1.0) -> float:
    """Average a last-stage scalar over the data-parallel replicas, each weighted by `weight` (its
    microbatch count: under a microbatch plan the replicas' shares of the global batch differ)."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return value
    tensor = torch.tensor([value * weight, weight], dtype=torch.float64, device=ctx.backend.device)
    dist.all_reduce(tensor, group=group)
    return float(tensor[0].item()) / float(tensor[1].item())


class MetricsLogger:
    """Accumulates per-iteration metrics and prints every --log-interval iterations."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.interval = max(1, ctx.cfg.training.log_interval)
        self.is_last_stage = ctx.pp_rank == ctx.cfg.parallel.pipeline_model_parallel_size - 1
        self.elapsed = 0.0
        self.count = 0
        self.history: list[tuple[int, float]] = []  # (iteration, lm loss) on the logging rank
        self.flops_per_iteration = model_flops_per_iteration(ctx.cfg) if ctx.cfg.logging.log_throughput else None
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
            loss = _dp_mean(metrics["lm loss"], self.ctx, metrics.get("microbatches") or 1)
        if self.ctx.is_logging_rank:
            t = self.ctx.cfg.training
            per_iter_ms = self.elapsed / self.count * 1e3
            throughput = ""
            if self.flops_per_iteration is not None:
                ranks = self.ctx.cfg.parallel.world_size
                tflops = self.flops_per_iteration / (per_iter_ms / 1e3) / ranks / 1e12
                throughput = f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
            scale = f" loss scale: {metrics['loss scale']:.1f} |" if metrics.get("loss scale") is not None else ""
            line = (
                f" iteration {iteration:8d}/{t.train_iters:8d} |"
                f" consumed samples: {self.ctx.consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {per_iter_ms:.1f} |{throughput}"
                f" learning rate: {metrics['learning rate']:.6E} |"
                f" global batch size: {t.global_batch_size:5d} |"
                f" lm loss: {loss:.6E} |{scale}"
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


def model_flops_per_iteration(cfg) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3x the forward's matrix
    multiplies; recomputation is not counted): per token and layer the QKV, attention score and
    context, output projection and MLP (gated with SwiGLU) products, then the logits."""
    m, t = cfg.model, cfg.training
    h, s, heads = m.hidden_size, m.seq_length, m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    query, kv = heads * head_dim, (m.num_query_groups or heads) * head_dim
    ffn = m.ffn_hidden_size or 4 * h
    per_layer = (2 * h * (query + 2 * kv)            # QKV projection
                 + 2 * 2 * s * query                 # scores and context, over the whole sequence
                 + 2 * query * h                     # output projection
                 + 2 * h * ffn * (2 if m.swiglu else 1) + 2 * ffn * h)  # MLP
    per_token = m.num_layers * per_layer + 2 * h * m.padded_vocab_size
    return 3.0 * per_token * s * t.global_batch_size

