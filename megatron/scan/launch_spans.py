"""What the zero-code launcher records around the model a program trains: a `forward` and a
`backward` span per microbatch (the trainer's own span kinds and fields, so every analyzer reads
them alike), the wait for data at the DataLoader, and DDP's gradient buckets, issued from a comm
hook, whose last issue within a backward ends that backward's compute.

"The model" is the first module called with grad enabled whose parameters an optimizer holds: its
ancestors would have been called first and hold the same parameters, so it is the outermost one (a
DDP/FSDP wrapper, a Trainer's model, a plain module). A global forward pre-hook looks for it until it
is found, then hooks on that module alone replace it: a global hook slows every module call."""
from __future__ import annotations

import os
import sys
import time
import weakref
from typing import Any, Callable

import torch

from megatron.scan.trace_format import FLAG_DEVICE_TIME

# Optimizer steps after which a program whose model was never found stops paying for the global hook.
_STEPS_TO_FIND_MODEL = 3


def _patch(owner: Any, name: str, replacement: Any) -> Callable[[], None]:
    """Set `owner.name`; the returned undo restores it unless someone replaced ours since."""
    original = getattr(owner, name)
    replacement.__wrapped__ = original
    setattr(owner, name, replacement)

    def undo() -> None:
        if getattr(owner, name) is replacement:
            setattr(owner, name, original)

    return undo


class ModelSpans:
    """Forward/backward spans of the model, per microbatch (counted from 0 within an optimizer
    step), and `data` spans around DataLoader iterators; recorded inside traced windows only.
    `step_done()` is told of each optimizer step; `bucket_issued()` of each DDP bucket."""

    def __init__(self, tracer: Any, rank: int = 0, *, layers: bool = False, fault: Any = None) -> None:
        """`layers`: also record each call of the model's repeated blocks (`layer_forward` /
        `layer_backward`, as --trace-granularity full does in the trainer); `fault`: an
        inject.DeviceFault slowing this rank's compute (per block, else per module that holds
        parameters)."""
        self.tracer = tracer
        self.rank = rank
        self.layers = layers
        self.fault = fault
        self.blocks: list[torch.nn.Module] = []
        # Host clock until a model with CUDA parameters is found, then CUDA events (the trainer's timers).
        self.mark: Callable[[], Any] = time.perf_counter_ns
        self.flags = 0
        self.device_timed = False
        self.model: torch.nn.Module | None = None
        self.deferred = False  # megatron-core's schedule records forward/backward itself
        self.forwards = 0
        self.backwards = 0
        self._params: set[int] = set()
        # Modules called that hold none of the optimizers' parameters, by id (a module need not be hashable).
        self._rejected: dict[int, weakref.ref] = {}
        self._finder = None
        self._depth = 0
        self._forward: tuple | None = None  # (start, saved tracer context, microbatch) of the open span
        self._in_backward = False
        self._last_issue: Any = None
        self._in_data = False
        self._steps_without_model = 0
        self._undo: list[Callable[[], None]] = []

    # --- installing -----------------------------------------------------------------------
    def install(self) -> "ModelSpans":
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim import Optimizer
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        spans = self
        original_init = Optimizer.__init__

        def __init__(optimizer, *args, **kwargs):
            original_init(optimizer, *args, **kwargs)
            spans.note_optimizer(optimizer)

        self._undo.append(_patch(Optimizer, "__init__", __init__))
        self._finder = register_module_forward_pre_hook(self._find_model)
        self._undo.append(self._drop_finder)
        # Tensor.backward looks torch.autograd.backward up at each call.
        self._undo.append(_patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward)))
        self._undo.append(_patch(_BaseDataLoaderIter, "__next__", self._wrap_next(_BaseDataLoaderIter.__next__)))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _drop_finder(self) -> None:
        if self._finder is not None:
            self._finder.remove()
            self._finder = None
        self._rejected = {}
        self._params = set()

    # --- finding the model ----------------------------------------------------------------------
    def note_optimizer(self, optimizer: Any) -> None:
        """The parameters `optimizer` holds are the model's (optimizers made before tracing started are
        seen at their first step)."""
        if self.model is not None or self._finder is None:
            return
        before = len(self._params)
        for group in getattr(optimizer, "param_groups", ()):
            self._params.update(id(p) for p in group.get("params", ()))
        if len(self._params) != before:
            self._rejected = {}  # a module rejected before may hold these

    def _find_model(self, module: torch.nn.Module, args: tuple) -> None:
        if not self._params or self._in_backward or not torch.is_grad_enabled():
            return None
        rejected = self._rejected.get(id(module))
        if rejected is not None and rejected() is module:
            return None
        try:
            params = self._params
            if not any(id(p) in params for p in module.parameters()):
                self._rejected[id(module)] = weakref.ref(module)
                return None
            self._adopt(module)
        except Exception as exc:  # noqa: BLE001 - a tracing failure must not fail the program's forward
            self._drop_finder()
            print(f"[megascan] forward/backward not traced: {exc!r}", file=sys.stderr, flush=True)
            return None
        # This call's pre-hooks were listed before ours existed; its post-hooks are read after forward.
        return self._forward_pre(module, args)

    def _adopt(self, module: torch.nn.Module) -> None:
        self.model = module
        self._drop_finder()
        pre = module.register_forward_pre_hook(self._forward_pre, prepend=True)
        post = module.register_forward_hook(self._forward_post, always_call=True)
        self._undo += [pre.remove, post.remove]
        first = next(module.parameters(), None)
        if first is not None and first.device.type == "cuda":
            self.use_device_clock(first.device)
        self._watch_blocks(module, first.device if first is not None else None)

    def _watch_blocks(self, module: torch.nn.Module, device: Any) -> None:
        """Per-block spans and the injected fault, on the model's repeated blocks."""
        from megatron.scan.layers import LayerScopes, repeated_blocks

        self.blocks = repeated_blocks(module) if (self.layers or self.fault is not None) else []
        if self.layers and self.blocks:
            scopes = LayerScopes(self.tracer, self.blocks, numbered=not hasattr(self.blocks[0], "layer_number"))
            self.tracer.layer_scopes = scopes
            if self.tracer.active:  # the window began before the model was found
                scopes.attach()
        if self.fault is not None:
            from megatron.scan.inject import Burner, ranks_outnumber_cores

            self.fault.burner = Burner(device, oversubscribed=ranks_outnumber_cores())
            # Without blocks, every module that holds parameters itself (the Linears of an MLP):
            # the time is then spent inside autograd too, before DDP issues the buckets it feeds,
            # as a slower device's would be (not in the wait for the all-reduce after the last).
            targets = self.blocks or [m for m in module.modules()
                                      if any(True for _ in m.parameters(recurse=False))
                                      and not any(True for _ in m.children())]
            self.fault.attach(targets)
            kinds = sorted({type(m).__name__ for m in targets})
            where = (f"per block ({len(targets)} {kinds[0]})" if self.blocks else
                     f"per module with parameters ({len(targets)}: {', '.join(kinds)}; no repeated blocks found)")
            for slowdown in self.fault.slowdowns:
                print(f"[inject] rank {self.rank}: compute x{slowdown.factor:g} from step {slowdown.start_iteration}, "
                      f"{where} ({self.fault.burner.mode})", file=sys.stderr, flush=True)

    def use_device_clock(self, device: torch.device) -> None:
        """CUDA events for the compute spans: the host only sees kernels launched. Collectives keep the
        tracer's host clock; the window's resolver turns events into ns and passes host ns through."""
        from megatron.scan.timers import build_timer

        timer = build_timer("cuda", device)
        tracer = self.tracer
        if tracer.active:  # the window started on the host timer: give the events their reference now
            timer.window_start()
        tracer.timer = timer
        # Block spans (LayerScopes) read tracer.mark when they fire; the collective and P2P observers
        # took the host clock's at installation and keep it.
        tracer.mark = timer.mark
        if getattr(tracer, "gpu", None) is not None:  # opened without a device; reopened on it next iteration
            tracer.gpu.close()
            tracer.gpu = None
        self.mark, self.flags, self.device_timed = timer.mark, FLAG_DEVICE_TIME, True

    def defer(self) -> None:
        """megatron-core's schedule spans are active: its forward/backward are recorded there."""
        if not self.deferred:
            self.deferred = True
            self._drop_finder()

    def step_done(self) -> int:
        """At the end of an optimizer step: how many forwards of the model it traced."""
        forwards, self.forwards, self.backwards = self.forwards, 0, 0
        if self.model is None and self._finder is not None:
            self._steps_without_model += 1
            if self._steps_without_model >= _STEPS_TO_FIND_MODEL:
                self._drop_finder()
                if self.rank == 0:
                    print(f"[megascan] no module held by an optimizer was called with grad enabled in "
                          f"{_STEPS_TO_FIND_MODEL} optimizer steps: forward/backward are not traced",
                          file=sys.stderr, flush=True)
        return forwards

    # --- the spans --------------------------------------------------------------------------------
    def _forward_pre(self, module: torch.nn.Module, args: tuple) -> None:
        self._depth += 1
        tracer = self.tracer
        if (self._depth > 1 or not tracer.active or self.deferred or self._in_backward
                or not torch.is_grad_enabled()):  # evaluation, or a recomputation inside backward
            return None
        microbatch = self.forwards
        self._forward = (self.mark(), tracer.context, microbatch)
        tracer.context = (microbatch, 0)  # collectives inside get the microbatch, as in the trainer
        return None

    def _forward_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._depth -= 1
        opened = self._forward
        if opened is None or self._depth:
            return None
        self._forward = None
        end = self.mark()
        start, context, microbatch = opened
        tracer = self.tracer
        tracer.context = context
        self.forwards += 1
        if tracer.active:
            tracer.events.append(("forward", start, end, tracer.iteration, microbatch, 0, -1, -1, -1, -1, -1,
                                  self.flags, None))
        return None

    def bucket_issued(self) -> None:
        """DDP issued a gradient bucket: the last one of a backward ends its compute. What follows is
        the reducer waiting for the all-reduce, i.e. for the slowest peer, which is not this rank's work."""
        if self._in_backward:
            self._last_issue = self.mark()

    def _wrap_backward(self, original: Callable) -> Callable:
        spans = self

        def backward(*args, **kwargs):
            tracer = spans.tracer
            # Only a backward after a traced forward of the model: not a second loss, not a nested one.
            if spans._in_backward or spans.backwards >= spans.forwards or spans.deferred or not tracer.active:
                return original(*args, **kwargs)
            microbatch, context = spans.backwards, tracer.context
            tracer.context = (microbatch, 0)
            spans._last_issue = None
            spans._in_backward = True
            start = spans.mark()
            try:
                return original(*args, **kwargs)
            finally:
                end = spans.mark()
                spans._in_backward = False
                issued, spans._last_issue = spans._last_issue, None
                tracer.context = context
                spans.backwards += 1
                if tracer.active:
                    events, flags, iteration = tracer.events, spans.flags, tracer.iteration
                    events.append(("backward", start, end if issued is None else issued, iteration, microbatch, 0,
                                   -1, -1, -1, -1, -1, flags, None))
                    if issued is not None:  # the trainer's kind for the data-parallel gradient sync
                        events.append(("grad_sync", issued, end, iteration, -1, -1, -1, -1, -1, -1, -1, flags, None))

        backward.__doc__ = original.__doc__
        return backward

    def _wrap_next(self, original: Callable) -> Callable:
        spans = self

        def __next__(iterator):
            tracer = spans.tracer
            if spans._in_data or spans.deferred or not tracer.active:
                return original(iterator)
            spans._in_data = True
            start = time.perf_counter_ns()  # host time, as the trainer's data spans: it is host work
            try:
                return original(iterator)
            finally:
                spans._in_data = False
                if tracer.active:
                    tracer.events.append(("data", start, time.perf_counter_ns(), tracer.iteration, spans.forwards,
                                          -1, -1, -1, -1, -1, -1, 0, None))

        return __next__


# --- DDP ----------------------------------------------------------------------------------------
class DDPHookState:
    """The comm-hook state MegaScan registers on every DDP module; a hook the program registers
    later is kept here and called instead of the default all-reduce."""

    def __init__(self, session: Any, process_group: Any) -> None:
        self.session = session
        self.process_group = process_group
        self.user_hook = None
        self.user_state = None


def _traced_allreduce_hook(state: DDPHookState, bucket):  # DDP rejects other annotations of bucket and result
    """DDP's default gradient all-reduce (average over the group), issued from Python so it gets a
    sequence number and an event from issue to completion like any other collective."""
    spans = state.session.spans
    if spans is not None:
        spans.bucket_issued()
    if state.user_hook is not None:
        return state.user_hook(state.user_state, bucket)
    import torch.distributed as dist

    group = state.process_group or dist.distributed_c10d._get_default_group()
    tensor = bucket.buffer()
    tensor.div_(group.size())
    from megatron.scan.collectives import untraced

    return state.session.async_collective("all_reduce", tensor, group,
                                          lambda: untraced(dist.distributed_c10d.all_reduce)(
                                              tensor, group=group, async_op=True))


def hook_ddp(session: Any) -> None:
    """DDP's reducer all-reduces gradient buckets in C++, out of sight of the Python wrappers; a comm
    hook brings them back into Python. A hook the program registers itself still runs."""
    if os.environ.get("MEGASCAN_DDP_HOOK", "1") == "0":
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP.__init__, "__megascan_launch__", False):
        return
    original_init, original_register = DDP.__init__, DDP.register_comm_hook

    def __init__(module, /, *args, **kwargs):  # Lightning passes module= by name
        original_init(module, *args, **kwargs)
        state = DDPHookState(session, getattr(module, "process_group", None))
        original_register(module, state, _traced_allreduce_hook)
        module._megascan_hook_state = state

    def register_comm_hook(module, state, hook):
        ours = getattr(module, "_megascan_hook_state", None)
        if ours is None or ours.user_hook is not None:
            return original_register(module, state, hook)
        ours.user_hook, ours.user_state = hook, state

    __init__.__megascan_launch__ = True  # type: ignore[attr-defined]
    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook
