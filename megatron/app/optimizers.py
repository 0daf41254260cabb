"""Optimizers behind one small interface (param_groups, step -> (updated, grad norm), state_dict):
torch's AdamW with model-parallel clipping (CPU), its fp16 form with master weights and loss
scaling (CPU --fp16), and megatron-core's optimizer (CUDA)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.app.model import unwrap_model


def parameter_groups(chunks, cfg) -> list[dict]:
    """AdamW groups: weight decay except on biases and norms; with --decoupled-lr the embedding
    and output layer in groups of their own (marked "decoupled")."""
    groups: dict[tuple[bool, bool], list] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            decay = applies_weight_decay(name, param.ndim)
            decoupled = cfg.decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False)
            groups.setdefault((decay, decoupled), []).append(param)
    return [{"params": params, "weight_decay": cfg.weight_decay if decay else 0.0, "decoupled": decoupled}
            for (decay, decoupled), params in sorted(groups.items(), key=lambda kv: group_order(kv[0]))]


def group_order(key: tuple[bool, bool]) -> tuple[bool, bool]:
    """Sort key of a (decay, decoupled) parameter group: decayed groups first, then not decoupled."""
    decay, decoupled = key
    return not decay, decoupled


def applies_weight_decay(name: str, ndim: int) -> bool:
    """Whether AdamW decays a parameter: not biases and norms (one-dimensional)."""
    return not (ndim == 1 or name.endswith(".bias"))


class TorchOptimizer:
    """AdamW plus global gradient-norm clipping over the model-parallel group."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks, clip_grad: float) -> None:
        self.optimizer = optimizer
        self.chunks = list(chunks)
        self.clip_grad = clip_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self) -> tuple[bool, float]:
        grad_norm = model_parallel_grad_norm(self.chunks)
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            scale = self.clip_grad / (grad_norm + 1e-6)
            for chunk in self.chunks:
                for param in chunk.parameters():
                    if param.grad is not None:
                        param.grad.mul_(scale)
        self.optimizer.step()
        return True, grad_norm

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class LossScaler:
    """The loss scale of --fp16. Fixed with --loss-scale; otherwise dynamic: it halves once
    --hysteresis overflowing steps have been seen since it last changed (never below
    --min-loss-scale) and doubles after --loss-scale-window steps in a row without overflow."""

    def __init__(self, cfg) -> None:
        self.dynamic = cfg.loss_scale is None
        self.scale = float(cfg.loss_scale if cfg.loss_scale is not None else cfg.initial_loss_scale)
        self.min_scale, self.window, self.hysteresis = float(cfg.min_loss_scale), cfg.loss_scale_window, cfg.hysteresis
        self.good_steps = 0
        self.overflows_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.good_steps = 0
                self.overflows_left = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows_left": self.overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.overflows_left = state["scale"], state["good_steps"], state["overflows_left"]


class Fp16Optimizer:
    """--fp16 on the CPU backend: the model computes in fp16; AdamW steps fp32 master copies of its
    parameters. The loss is multiplied by the loss scale before backward (`scale_loss`, which the
    executors call); `step` divides the gradients by it into the masters, skips the step when any
    rank saw an inf or NaN (and lowers the scale), else clips over the model-parallel group, steps,
    and copies the masters back into the fp16 parameters."""

    def __init__(self, chunks, model_groups: list[dict], cfg) -> None:
        self.chunks = list(chunks)
        self.clip_grad = cfg.clip_grad
        self.scaler = LossScaler(cfg)
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        groups = []
        for group in model_groups:
            masters = []
            for param in group["params"]:
                master = torch.nn.Parameter(param.detach().float().clone())
                self.pairs.append((param, master))
                masters.append(master)
            groups.append({**group, "params": masters})
        self.master_of = {id(p): m for p, m in self.pairs}
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           eps=cfg.adam_eps)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def step(self) -> tuple[bool, float]:
        inverse = 1.0 / self.scaler.scale
        found_inf = torch.zeros(1)
        for param, master in self.pairs:
            grad = param.grad.float() * inverse if param.grad is not None else torch.zeros_like(master)
            master.grad = grad
            if not torch.isfinite(grad).all():
                found_inf.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # every rank skips the same steps
        overflow = bool(found_inf.item())
        self.scaler.update(overflow)
        if overflow:
            return False, float("nan")
        grad_norm = model_parallel_grad_norm(self.chunks, lambda p: self.master_of[id(p)].grad
                                             if id(p) in self.master_of else None)
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            factor = self.clip_grad / (grad_norm + 1e-6)
            for _, master in self.pairs:
                master.grad.mul_(factor)
        self.optimizer.step()
        with torch.no_grad():
            for param, master in self.pairs:
                param.copy_(master)
        return True, grad_norm

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach().clone() for _, m in self.pairs],
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for (param, master), saved in zip(self.pairs, state["masters"]):
                master.copy_(saved)
                param.copy_(saved)
        self.scaler.load_state_dict(state["scaler"])


class MegatronOptimizer:
    """megatron-core's optimizer (mixed precision, clipping, grad-norm) behind the same interface."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.get_loss_scale())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self) -> tuple[bool, float]:
        update_successful, grad_norm, _ = self.optimizer.step()
        return bool(update_successful), float(grad_norm or 0.0)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def model_parallel_grad_norm(chunks: Sequence[torch.nn.Module],
                             grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None) -> float:
    """L2 norm of the full model's gradient, each parameter counted once: parameters that
    tensor parallelism replicates count on TP rank 0 only, the tied output weight on the
    first stage only. `grad_of(param)` supplies the gradient to use (default `param.grad`)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    total = torch.zeros(1, dtype=torch.float64)
    for chunk in chunks:
        module = unwrap_model(chunk)
        for param in chunk.parameters():
            grad = param.grad if grad_of is None else grad_of(param)
            if grad is None:
                continue
            replicated = not getattr(param, "tensor_model_parallel", False)
            if replicated and tp_rank != 0:
                continue
            is_tied_copy = (
                getattr(param, "shared_embedding", False)
                and getattr(module, "post_process", False)
                and not getattr(module, "pre_process", False)
            )
            if is_tied_copy:
                continue
            total += grad.detach().double().pow(2).sum()
    group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total.sqrt())
