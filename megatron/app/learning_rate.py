"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay (with a
decoupled rate for the embedding and output layer under --decoupled-lr)."""
from __future__ import annotations

import math


def learning_rate(cfg, iteration: int, peak: float | None = None, floor: float | None = None) -> float:
    """Linear warmup, then constant / linear / cosine decay to min_lr (or to `floor` from `peak`,
    for the embedding and output layer under --decoupled-lr)."""
    o = cfg.optimizer
    peak = o.lr if peak is None else peak
    floor = o.min_lr if floor is None else floor
    if o.lr_warmup_iters and iteration < o.lr_warmup_iters:
        return peak * (iteration + 1) / o.lr_warmup_iters
    if o.lr_decay_style == "constant":
        return peak
    decay_iters = (o.lr_decay_iters or cfg.training.train_iters) - o.lr_warmup_iters
    progress = min(1.0, max(0.0, (iteration - o.lr_warmup_iters) / max(1, decay_iters)))
    if o.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (peak - floor) * factor


def set_learning_rate(ctx) -> float:
    """This iteration's learning rate, set on every optimizer parameter group."""
    o = ctx.cfg.optimizer
    lr = learning_rate(ctx.cfg, ctx.iteration)
    decoupled = None
    if o.decoupled_lr is not None:
        decoupled = learning_rate(ctx.cfg, ctx.iteration, o.decoupled_lr,
                                  o.decoupled_min_lr if o.decoupled_min_lr is not None else o.min_lr)
    for group in ctx.optimizer.param_groups:
        # Our CPU optimizer marks the group "decoupled"; megatron-core's, "is_decoupled_lr".
        group["lr"] = decoupled if decoupled is not None and (group.get("decoupled") or group.get("is_decoupled_lr")) \
            else lr
    return lr
