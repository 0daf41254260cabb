"""Split backward for zero-bubble pipeline schedules: the backward B of one (model chunk,
microbatch) becomes I (the gradient of the stage input, sent upstream at once) and W (the weight
gradients, run later to fill a pipeline bubble).

Usage by an executor, per (chunk, microbatch)::

    install(chunks)                       # once, after building (and wrapping) the chunks
    work = WeightGradWork()
    with deferring(work):
        output = chunk(...)               # forward
    ...
    with deferring(work):
        torch.autograd.backward(output, grad)   # I: the dgrad of every linear layer, and every
                                                # gradient that is not a linear layer's weight/bias
    ...
    work.run()                            # W: the weight (and bias) gradients of the linears

What is split: megatron-core's ColumnParallelLinear and RowParallelLinear. `install` shadows their
`_forward_impl` on each instance. While a `deferring` block is active, their forward builds a
`LinearWithDeferredWeightGrad` node that computes exactly what megatron-core's
LinearWithGradAccumulationAndAsyncCommunication computes, but takes the weight and bias detached:
the node has no autograd edge to them. Its backward computes the input gradient (with megatron-core's
tensor-parallel all-reduce or sequence-parallel reduce-scatter) and pushes into the work bound at
forward time a closure that later computes the weight and bias gradients with megatron-core's own ops
and delivers them through autograd (`torch.autograd.backward` on a view of each parameter), so the
parameter's AccumulateGrad node and every hook on it (megatron-core DDP's post-hooks that move
`.grad` into `main_grad` and mark buckets ready) run as in the unsplit backward, only later. Per
parameter the microbatches' contributions are accumulated in the order their W's run; run W's in
the order of the I's and the gradients are bit-identical to the unsplit backward's.

Left undeferred (megatron-core's own function; the weight gradient is computed in I):
  * a frozen weight (megatron-core's linear_with_frozen_weight, as unpatched);
  * a call with `grad_output_buffer` (--defer-embedding-wgrad-compute: megatron-core defers it itself);
  * no active `deferring` block, grad mode off, or an input that does not require grad;
  * a layer whose weight (or bias) is not its own: one whose weight is handed in at call time, or is
    registered on another module of the chunks as well. This is the tied word embedding: a chunk
    holding both the first and the last stage (PP=1, share_embeddings_and_output_weights) looks the
    embedding up and uses the same tensor as its output-layer weight. Deferring the output layer would
    add that parameter's two gradient contributions in a different order (not bit-equal). Detected at
    install time (GPTModel builds that output layer without a weight of its own).

Which work a node feeds is captured when its forward runs. Recomputation (--recompute-granularity
full/selective: megatron-core's CheckpointFunction re-runs the forward inside the backward) re-runs
the forward inside I, where the executor's `deferring` block is active again. The active work is a
process-wide stack, not a contextvar or thread-local: on CUDA the autograd engine runs backward
functions, and so the recomputed forward, on its own device threads, where a contextvar set by the
executor's thread would not be seen. One executor thread per process enters `deferring` blocks.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
import weakref
from typing import Callable, Iterable, Iterator, Sequence

import torch
from megatron.core.parallel_state import get_global_memory_buffer
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    custom_bwd,
    custom_fwd,
    dist_all_gather_func,
    dist_reduce_scatter_func,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from megatron.core.utils import get_tensor_model_parallel_group_if_none, prepare_input_tensors_for_wgrad_compute

__all__ = ["WeightGradWork", "deferring", "active_work", "install", "uninstall",
           "LinearWithDeferredWeightGrad"]


class WeightGradWork:
    """The deferred weight-gradient work of one (chunk, microbatch): closures pushed during I, run by
    `run()` in push order, once. Each closure is dropped as soon as it has run, which frees the
    tensors it held."""

    def __init__(self, label: object = None) -> None:
        self.label = label
        self._items: list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]] = []
        self._ran = False

    def push(self, closure: Callable[[], None], tensors: Sequence[torch.Tensor] = ()) -> None:
        """Add a closure; `tensors`: what it holds, for `nbytes`."""
        if self._ran:
            raise RuntimeError(f"WeightGradWork {self.label!r}: work pushed after run(); the backward (I) of "
                               "this (chunk, microbatch) ran after its weight-gradient step (W)")
        self._items.append((closure, tuple(tensors)))

    def run(self) -> None:
        """W: every closure, in push order. A second call raises."""
        if self._ran:
            raise RuntimeError(f"WeightGradWork {self.label!r}: run() called twice; its weight gradients "
                               "were already computed and delivered")
        self._ran = True
        items, self._items = self._items, []
        items.reverse()
        while items:  # each closure dropped once it has run, so what it held can be freed at once
            closure = items.pop()[0]
            closure()
            del closure

    @property
    def ran(self) -> bool:
        return self._ran

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the pending closures hold (a tensor held twice counts once)."""
        seen, total = set(), 0
        for _, tensors in self._items:
            for tensor in tensors:
                key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.device)
                if key not in seen:
                    seen.add(key)
                    total += tensor.numel() * tensor.element_size()
        return total

    def __repr__(self) -> str:
        state = "ran" if self._ran else f"{len(self)} pending, {self.nbytes} bytes"
        return f"WeightGradWork({self.label!r}, {state})"


_lock = threading.Lock()
_active: list[WeightGradWork] = []


@contextlib.contextmanager
def deferring(work: WeightGradWork) -> Iterator[WeightGradWork]:
    """While active (process-wide, see the module docstring), linear layers of installed chunks that
    run their forward build nodes whose weight gradients go to `work`. Nestable."""
    if not isinstance(work, WeightGradWork):
        raise TypeError(f"deferring() takes a WeightGradWork, not {type(work).__name__}")
    with _lock:
        _active.append(work)
    try:
        yield work
    finally:
        with _lock:
            for index in range(len(_active) - 1, -1, -1):
                if _active[index] is work:
                    del _active[index]
                    break


def active_work() -> WeightGradWork | None:
    """The work of the innermost active `deferring` block, if any."""
    with _lock:
        return _active[-1] if _active else None


def _fused_wgrad_module():
    """The APEX extension megatron-core accumulates into main_grad with (imported when first used)."""
    return importlib.import_module("fused_weight_gradient_mlp_cuda")


def _autocast_state() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")


class _DeferredWeightGrad:
    """W of one linear node: megatron-core's weight-gradient half of its backward, then delivery
    through autograd. Releases its tensors once it has run."""

    def __init__(self, ctx, input: torch.Tensor, grad_output: torch.Tensor) -> None:
        self.input, self.grad_output = input, grad_output
        self.weight, self.bias = ctx.params
        self.main_grad = ctx.main_grad
        self.fusion, self.sequence_parallel, self.tp_group = (ctx.gradient_accumulation_fusion,
                                                              ctx.sequence_parallel, ctx.tp_group)
        self.autocast = _autocast_state()  # custom_bwd's (= the forward's) autocast state

    def __call__(self) -> None:
        try:
            enabled, dtype = self.autocast
            scope = (torch.autocast("cuda", enabled=enabled, dtype=dtype)
                     if enabled or torch.is_autocast_enabled("cuda") else contextlib.nullcontext())
            with scope, torch.no_grad():
                grad_weight, grad_bias = self._compute()
            self._deliver(grad_weight, grad_bias)
        finally:
            self.input = self.grad_output = self.weight = self.bias = self.main_grad = self.tp_group = None

    def _compute(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        input, weight = self.input, self.weight
        if self.sequence_parallel:  # gather the input again, as megatron-core's backward does
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * self.tp_group.size()
            total_input = get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
            dist_all_gather_func(total_input, input, group=self.tp_group)
        else:
            total_input = input
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(self.grad_output, total_input)
        if not self.fusion:
            grad_weight = grad_output.t().matmul(total_input)
        else:
            weight.main_grad = self.main_grad
            if hasattr(weight, "__fsdp_param__"):
                weight.main_grad = weight.get_main_grad()
                torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
            elif weight.main_grad.dtype == torch.float32:
                _fused_wgrad_module().wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
            elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
                _fused_wgrad_module().wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
            else:
                raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
            grad_weight = None
            if hasattr(weight, "grad_added_to_main_grad"):
                # A dummy gradient, so the grad-accumulator hooks run (they skip adding it).
                zero = getattr(weight, "zero_out_wgrad", False)
                make = torch.zeros if zero else torch.empty
                grad_weight = make(weight.main_grad.shape, dtype=input.dtype, device=weight.main_grad.device,
                                   requires_grad=False)
                weight.grad_added_to_main_grad = True
        grad_bias = grad_output.sum(dim=0) if self.bias is not None else None
        return grad_weight, grad_bias

    def _deliver(self, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None) -> None:
        targets, grads = [], []
        with torch.enable_grad():
            for param, grad in ((self.weight, grad_weight), (self.bias, grad_bias)):
                if grad is not None and param.requires_grad:  # autograd drops a frozen bias's gradient too
                    targets.append(param.view_as(param))  # a node whose next function is param's AccumulateGrad
                    grads.append(grad)
            if targets:
                torch.autograd.backward(targets, grads)


class LinearWithDeferredWeightGrad(torch.autograd.Function):
    """megatron-core's LinearWithGradAccumulationAndAsyncCommunication with the weight gradient moved
    out of the backward into a closure pushed into `work`. `weight` and `bias` come in detached
    (no edge to the parameters); `params` holds the parameters themselves for the delivery."""

    @staticmethod
    @custom_fwd
    def forward(ctx, input, weight, bias, params, main_grad, gradient_accumulation_fusion, allreduce_dgrad,
                sequence_parallel, tp_group, work):
        ctx.save_for_backward(input, weight)
        ctx.params, ctx.main_grad, ctx.work = params, main_grad, work
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
        if sequence_parallel:
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * tp_group.size()
            total_input = get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
            dist_all_gather_func(total_input, input, group=tp_group)
        else:
            total_input = input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        tp_group = ctx.tp_group
        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
        if ctx.sequence_parallel:
            assert not ctx.allreduce_dgrad
            sub_grad_input = torch.empty(list(input.size()), dtype=input.dtype, device=input.device,
                                         requires_grad=False)
            handle = dist_reduce_scatter_func(sub_grad_input, grad_input, group=tp_group, async_op=True)
            grad_input = sub_grad_input
        ctx.work.push(_DeferredWeightGrad(ctx, input, grad_output), (input, grad_output))
        if handle is not None:
            handle.wait()
        return grad_input, None, None, None, None, None, None, None, None, None


_LINEAR_SIGNATURE = inspect.signature(linear_with_grad_accumulation_and_async_allreduce)


def _linear_arguments(input, weight, args, kwargs) -> dict:
    bound = _LINEAR_SIGNATURE.bind(input, weight, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _make_forward_impl(layer: torch.nn.Module, deferrable: bool) -> Callable:
    layer_ref = weakref.ref(layer)

    def forward_impl(input, weight, *args, **kwargs):
        if not weight.requires_grad:
            return linear_with_frozen_weight(input, weight, *args, **kwargs)
        work = active_work()
        arguments = _linear_arguments(input, weight, args, kwargs)
        if (work is None or not deferrable or arguments["grad_output_buffer"] is not None
                or not torch.is_grad_enabled() or not input.requires_grad
                or weight is not getattr(layer_ref(), "weight", None)):
            return linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)
        bias = arguments["bias"]
        fusion = arguments["gradient_accumulation_fusion"]
        main_grad = weight.main_grad if fusion and hasattr(weight, "main_grad") else None
        return LinearWithDeferredWeightGrad.apply(
            input, weight.detach(), None if bias is None else bias.detach(), (weight, bias), main_grad, fusion,
            arguments["allreduce_dgrad"], arguments["sequence_parallel"],
            get_tensor_model_parallel_group_if_none(arguments["tp_group"]), work)

    forward_impl.weight_grad_split = True
    forward_impl.deferrable = deferrable
    return forward_impl


def _linear_layers(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module]]:
    for index, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                yield f"{index}.{name}" if name else str(index), module


def _owner_counts(chunks: Sequence[torch.nn.Module]) -> dict[int, int]:
    """How many modules of the chunks register each parameter (by identity)."""
    counts: dict[int, int] = {}
    seen: set[int] = set()
    for chunk in chunks:
        for module in chunk.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for param in module.parameters(recurse=False):
                counts[id(param)] = counts.get(id(param), 0) + 1
    return counts


def _is_ours(layer: torch.nn.Module) -> bool:
    return getattr(vars(layer).get("_forward_impl"), "weight_grad_split", False)


def install(chunks: Sequence[torch.nn.Module]) -> dict[str, bool]:
    """Shadow `_forward_impl` of every megatron-core Column/RowParallelLinear in `chunks` (GPTModels,
    possibly wrapped in Float16Module / DDP) with the splitting wrapper. Idempotent. Returns, per
    layer ("<chunk index>.<module name>"), whether its weight gradient is deferred to W (False: a
    layer without a weight of its own or sharing it, e.g. the tied output layer; see the module
    docstring)."""
    chunks = list(chunks)
    owners = _owner_counts(chunks)
    result = {}
    for name, layer in _linear_layers(chunks):
        if "_forward_impl" in vars(layer) and not _is_ours(layer):
            raise RuntimeError(f"{name}: its _forward_impl is already replaced by something else; "
                               "weight_grad.install would shadow it")
        weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
        deferrable = (isinstance(weight, torch.nn.Parameter) and owners.get(id(weight)) == 1
                      and (bias is None or owners.get(id(bias)) == 1))
        layer._forward_impl = _make_forward_impl(layer, deferrable)
        result[name] = deferrable
    return result


def uninstall(chunks: Sequence[torch.nn.Module]) -> None:
    """Undo `install`: the layers use their class's `_forward_impl` again."""
    for _, layer in _linear_layers(chunks):
        if _is_ours(layer):
            del layer._forward_impl
