"""What one iteration of the pipeline executor is given and returns: the plan (layout,
microbatches, loss divisor), the loss options, the step actions' callbacks and the result."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron.app.schedule import PipelineLayout

__all__ = ["Microbatch", "IterationPlan", "LossOptions", "IterationResult", "IterationSteps", "microbatch_loss"]

Microbatch = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class IterationPlan:
    """What one iteration runs on this rank, handed to `run()`: the pipeline layout (whose
    microbatch count is this replica's share), the global index of its first microbatch (what
    `get_microbatch` is asked for is that plus the local index), and the count each microbatch's
    loss is divided by (None: the layout's count; a microbatch plan passes the even split's, so
    the step is the even split's whatever this replica's share)."""

    layout: PipelineLayout
    first_microbatch: int = 0
    loss_divisor: int | None = None

    @property
    def divisor(self) -> int:
        return self.loss_divisor or self.layout.num_microbatches


@dataclass(frozen=True, slots=True)
class LossOptions:
    """How the last stage turns a microbatch's loss into what backward starts from: `scale` (with
    --fp16, the optimizer's loss scale) multiplies it; `per_token` (--calculate-per-token-loss)
    sums token losses, which the trainer later divides by the global batch's token count."""

    scale: Callable[[torch.Tensor], torch.Tensor] | None = None
    per_token: bool = False


@dataclass(slots=True)
class IterationResult:
    losses: list[float] = field(default_factory=list)  # one per microbatch, last stage only
    num_tokens: int = 0
    updated: bool = False  # set by the optimizer step action, when the iteration has one
    grad_norm: float = 0.0

    @property
    def mean_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


def microbatch_loss(output: torch.Tensor, batch: Microbatch) -> tuple[torch.Tensor, int]:
    """The last stage's per-token losses [micro batch, seq] -> their mean over the microbatch's
    real tokens (loss_mask), and that token count."""
    mask = batch["loss_mask"]
    tokens = mask.sum()
    return (output.float() * mask).sum() / tokens.clamp(min=1), int(tokens)


@dataclass(frozen=True, slots=True)
class IterationSteps:
    """What the step actions of an iteration do (the trainer supplies them): the data-parallel
    gradient reduction, and the optimizer step returning (updated, grad norm). Both see the
    iteration's result so far (losses, token count)."""

    reduce_grads: Callable[[IterationResult], None]
    optimizer_step: Callable[[IterationResult], tuple[bool, float]]
