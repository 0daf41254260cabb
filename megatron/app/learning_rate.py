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
    """This iteration's learning rate, set on every optimizer parameter group.

    Our CPU optimizer marks the embedding and output group "decoupled". megatron-core's groups
    carry their own schedule ends, "max_lr" and "min_lr" (under --decoupled-lr its embedding and
    output group has max_lr = decoupled_lr), and an "lr_mult"; each such group follows the same
    warmup and decay between its own ends. Returns the rate of the groups on the default schedule."""
    o = ctx.cfg.optimizer
    lr = learning_rate(ctx.cfg, ctx.iteration)
    decoupled = None
    if o.decoupled_lr is not None:
        decoupled = learning_rate(ctx.cfg, ctx.iteration, o.decoupled_lr,
                                  o.decoupled_min_lr if o.decoupled_min_lr is not None else o.min_lr)
    for group in ctx.optimizer.param_groups:
        if "max_lr" in group:  # megatron-core's group
            group["lr"] = learning_rate(ctx.cfg, ctx.iteration, group["max_lr"], group["min_lr"]) \
                * group.get("lr_mult", 1.0)
        else:
            group["lr"] = decoupled if decoupled is not None and group.get("decoupled") else lr
    return lr
