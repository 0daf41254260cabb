"""megatron-core's own pipeline schedules as a trainer executor (`--pipeline-schedule megatron-core`).

`get_forward_backward_func()` picks no pipelining, 1F1B or interleaved 1F1B from megatron-core's
parallel state, exactly as a Megatron-LM training loop would; this class feeds it this trainer's
microbatches and loss, and reports the same `IterationResult` as `PipelineExecutor`, so the rest
of the iteration (gradient sync, optimizer, logging, evaluation) is unchanged. On the CPU
backend the schedule runs over gloo through the stand-ins in `megatron.app.cpu_stand_ins`.

Forward and backward spans per (chunk, microbatch) are recorded for the observer (MegaScan's
tracer) by wrapping the schedule module's `forward_step` / `backward_step` for the duration of
one call; point-to-point transfers are megatron-core's own.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

from megatron.app.executor import (IterationPlan, IterationResult, IterationSteps, Microbatch, StageContext,
                                   microbatch_loss)
from megatron.app.model import unwrap_model
from megatron.app.observer import NullObserver, get_observer


class MegatronCoreSchedule:
    """Runs one iteration with megatron-core's `get_forward_backward_func()`."""

    schedule_name = "megatron-core"

    def __init__(self, chunks: Sequence[torch.nn.Module], stage: StageContext) -> None:
        self.chunks = list(chunks)
        self.stage = stage

    def run(self, tasks, get_microbatch: Callable[[int], Microbatch],
            forward_only: bool = False, steps: IterationSteps | None = None,
            plan: IterationPlan | None = None) -> IterationResult:
        """`tasks` (this trainer's static order) is ignored: megatron-core decides the order. With
        `steps`, the gradient reduction and the optimizer step follow megatron-core's schedule.
        `plan` as PipelineExecutor.run's: its layout's microbatch count, first microbatch and loss
        divisor."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        plan = plan or IterationPlan(self.stage.layout)
        layout = plan.layout
        seq, micro_batch, _ = self.stage.activation_shape
        result = IterationResult()
        per_token = unwrap_model(self.chunks[0]).config.calculate_per_token_loss

        def forward_step(data_iterator: Iterator[Microbatch], model):
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

            def loss_func(per_token_loss: torch.Tensor):
                loss, tokens = microbatch_loss(per_token_loss, batch)
                result.losses.append(float(loss.detach()))
                result.num_tokens += tokens
                if per_token:
                    # the sum and its token count; the trainer divides by the global batch's tokens
                    total = (per_token_loss.float() * batch["loss_mask"]).sum()
                    return total, torch.tensor(tokens, dtype=torch.int), {"lm loss": loss.detach().clone()}
                # megatron-core divides the returned loss by the microbatch count (in place); under
                # a microbatch plan the division must be by the even split's count instead
                if plan.divisor != layout.num_microbatches:
                    return loss * (layout.num_microbatches / plan.divisor), {"lm loss": loss.detach().clone()}
                return loss, {"lm loss": loss.detach().clone()}

            return output, loss_func

        def microbatches() -> Iterator[Microbatch]:
            for mb in range(layout.num_microbatches):
                yield get_microbatch(plan.first_microbatch + mb)

        data = [microbatches() for _ in self.chunks]
        model = self.chunks
        if len(self.chunks) == 1:
            data, model = data[0], self.chunks[0]
        with _spans(), torch.set_grad_enabled(not forward_only):
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=model,
                num_microbatches=layout.num_microbatches,
                seq_length=seq,
                micro_batch_size=micro_batch,
                forward_only=forward_only,
            )
        if steps is not None and not forward_only:
            steps.reduce_grads(result)
            result.updated, result.grad_norm = steps.optimizer_step(result)
        return result


@contextlib.contextmanager
def _spans() -> Iterator[None]:
    observer = get_observer()
    if isinstance(observer, NullObserver):
        yield
        return
    undo = install_step_spans(observer)
    try:
        yield
    finally:
        undo()


def install_step_spans(observer, on_forward: Callable[[tuple, dict], None] | None = None) -> Callable[[], None]:
    """Forward/backward spans, on `observer.span(kind, chunk=, microbatch=)`, around megatron-core's
    `forward_step` / `backward_step`, which its schedules look up as module globals (so a
    schedule function the program got from `get_forward_backward_func()` earlier is covered too).
    A backward is matched to its forward by the identity of the output tensor the schedule hands
    back to it. `on_forward(args, kwargs)` sees each forward_step call first. Returns the undo."""
    from megatron.core.pipeline_parallel import schedules

    original_forward, original_backward = schedules.forward_step, schedules.backward_step
    owner: dict[int, tuple[int, int]] = {}

    def forward_step(*args, **kwargs):
        if on_forward is not None:
            on_forward(args, kwargs)
        chunk = kwargs.get("vp_stage") or 0
        microbatch = kwargs.get("current_microbatch")
        microbatch = -1 if microbatch is None else microbatch
        with observer.span("forward", chunk=chunk, microbatch=microbatch):
            output = original_forward(*args, **kwargs)
        owner[id(_first_tensor(output[0]))] = (chunk, microbatch)
        return output

    def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        chunk, microbatch = owner.pop(id(_first_tensor(output_tensor)), (-1, -1))
        with observer.span("backward", chunk=chunk, microbatch=microbatch):
            return original_backward(input_tensor, output_tensor, output_tensor_grad, model_type, config)

    schedules.forward_step, schedules.backward_step = forward_step, backward_step

    def undo() -> None:
        if schedules.forward_step is forward_step:
            schedules.forward_step, schedules.backward_step = original_forward, original_backward

    return undo


def _first_tensor(value):
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value
