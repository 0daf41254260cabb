"""The learning-rate schedule on both optimizers' parameter groups, --decoupled-lr included.

megatron-core's optimizer (the CUDA path) describes a decoupled group by its own schedule ends
(max_lr, min_lr) rather than by a flag; a GPU run found --decoupled-lr had no effect there when only
a flag was looked for. The groups here are built by megatron-core's own grouping function."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.app.arguments import build_parser, config_from_args
from megatron.app.learning_rate import learning_rate, set_learning_rate


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Linear(4, 4)
        self.body = torch.nn.Linear(4, 4)
        self.embedding.weight.is_embedding_or_output_parameter = True


def megatron_core_groups(decoupled_lr, decoupled_min_lr, monkeypatch):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import _get_param_groups as get_param_groups

    # Its grouping agrees the groups across ranks with two collectives: one rank here.
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj, *a, **k: out.__setitem__(0, obj))
    config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, decoupled_lr=decoupled_lr,
                             decoupled_min_lr=decoupled_min_lr)
    model = TwoLayer()
    return model, get_param_groups([model], config, None)


def context(groups, iteration, *flags):
    args = build_parser([]).parse_args(["--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
                                        "--train-iters", "10", *flags])
    cfg = config_from_args(args, world_size=1)
    return SimpleNamespace(cfg=cfg, iteration=iteration, optimizer=SimpleNamespace(param_groups=groups))


def lr_of(groups, param):
    return next(g["lr"] for g in groups if any(p is param for p in g["params"]))


@pytest.mark.parametrize("iteration", [0, 5, 9])
def test_megatron_core_groups_follow_the_decoupled_schedule(iteration, monkeypatch):
    model, groups = megatron_core_groups(3e-3, 3e-4, monkeypatch)
    ctx = context(groups, iteration, "--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4")
    lr = set_learning_rate(ctx)
    assert lr == learning_rate(ctx.cfg, iteration)
    assert lr_of(groups, model.body.weight) == lr
    assert lr_of(groups, model.body.bias) == lr  # the no-weight-decay group keeps the default schedule
    assert lr_of(groups, model.embedding.weight) == pytest.approx(learning_rate(ctx.cfg, iteration, 3e-3, 3e-4))
    assert lr_of(groups, model.embedding.weight) > 2 * lr


def test_without_decoupled_lr_every_megatron_core_group_has_one_rate(monkeypatch):
    model, groups = megatron_core_groups(None, None, monkeypatch)
    ctx = context(groups, 3)
    lr = set_learning_rate(ctx)
    assert {g["lr"] for g in groups} == {lr}


def test_our_cpu_groups_marked_decoupled_get_the_decoupled_rate():
    groups = [{"params": [], "decoupled": False}, {"params": [], "decoupled": True}]
    ctx = context(groups, 4, "--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4")
    lr = set_learning_rate(ctx)
    assert groups[0]["lr"] == lr
    assert groups[1]["lr"] == pytest.approx(learning_rate(ctx.cfg, 4, 3e-3, 3e-4))
