"""Per-layer hooks on megatron-core's transformer layers, shared by every client that needs a
layer's forward and backward boundaries: the tracer's per-layer scopes (`--trace-granularity full`)
and the fault injector's slower device. Hooks exist only while some client watches the layer."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def transformer_layers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """megatron-core TransformerLayer instances (anything with a `layer_number`), in model order."""
    layers = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "layer_number", None), int) and hasattr(module, "self_attention"):
                layers.append(module)
    return layers


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The stack of repeated blocks a model is built from (its transformer layers), for any
    PyTorch model: megatron-core's TransformerLayers where there are any; else, of the module
    lists and sequentials in it whose children are two or more modules of one class, each with
    parameters and submodules of its own (a block, not a bare Linear), the one holding the most
    parameters (a GPT-2 `h`, a Llama `layers`). Empty when there is none."""
    layers = transformer_layers([model])
    if layers:
        return layers
    best: tuple[int, list[torch.nn.Module]] | None = None
    for module in model.modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(child) for child in children}) != 1:
            continue
        if not all(any(True for _ in child.children()) for child in children):
            continue
        size = sum(p.numel() for child in children for p in child.parameters())
        if size and (best is None or size > best[0]):
            best = (size, children)
    return best[1] if best is not None else []


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


class LayerWatcher:
    """A client of the layer hooks; every method is optional.

    Watchers nest like context managers: at a beginning, clocks (`adds_work = False`) are called
    first, then watchers that add work; at an end, work is added first, then clocks read. So the
    work a fault injector adds lies inside every timed scope of the layer, whichever client
    attached first.

    Backward is seen through gradient hooks: it begins when the gradient of the layer's output is
    ready and ends when the gradient of its input is (inside autograd, right after the layer's
    own backward). Layer L's output is layer L+1's input, so one gradient ends L+1's backward and
    begins L's; ends are dispatched before beginnings."""

    adds_work = False

    def forward_begin(self, layer: torch.nn.Module) -> Any:
        """Returns a token handed to `forward_end` of the same call."""
        return None

    def forward_end(self, layer: torch.nn.Module, begun: Any) -> Any:
        """Returns the state this forward call's backward hooks receive."""
        return None

    def backward_begin(self, layer: torch.nn.Module, state: Any, chained: Any) -> Any:
        """`chained`: what this watcher's `backward_end` returned for the layer whose backward
        ended at this same gradient (the next layer's), else None. Returns a token for `backward_end`."""
        return None

    def backward_end(self, layer: torch.nn.Module, state: Any, begun: Any) -> Any:
        return None


def watch_layers(layers: Sequence[torch.nn.Module], watcher: LayerWatcher) -> None:
    """Start calling `watcher` at every forward and backward of `layers`."""
    for layer in layers:
        hooks = layer.__dict__.get("_megascan_layer_hooks")
        if hooks is None:
            hooks = layer.__dict__["_megascan_layer_hooks"] = _LayerHooks(layer)
        hooks.add(watcher)


def unwatch_layers(layers: Sequence[torch.nn.Module], watcher: LayerWatcher) -> None:
    """Stop calling `watcher` for calls that begin from now on; the last watcher gone removes the
    module hooks. A backward whose forward was watched still reports to it."""
    for layer in layers:
        hooks = layer.__dict__.get("_megascan_layer_hooks")
        if hooks is not None and hooks.remove(watcher):
            del layer.__dict__["_megascan_layer_hooks"]


class _LayerHooks:
    """The module hooks of one layer, dispatching to its watchers."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.watchers: tuple[LayerWatcher, ...] = ()  # in beginning order: clocks, then work
        self._pending: list[tuple] = []  # (watchers, tokens, stage_input) of forwards under way
        self._handles = [layer.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                         layer.register_forward_hook(self._post_forward, with_kwargs=True)]

    def add(self, watcher: LayerWatcher) -> None:
        if watcher not in self.watchers:
            clocks = [w for w in (*self.watchers, watcher) if not w.adds_work]
            work = [w for w in (*self.watchers, watcher) if w.adds_work]
            self.watchers = (*clocks, *work)

    def remove(self, watcher: LayerWatcher) -> bool:
        """Returns whether the hooks are gone (no watcher left)."""
        self.watchers = tuple(w for w in self.watchers if w is not watcher)
        if self.watchers:
            return False
        for handle in self._handles:
            handle.remove()
        return True

    def _pre_forward(self, layer, args, kwargs):
        watchers = self.watchers
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        stage_input = hidden if isinstance(hidden, torch.Tensor) else None
        self._pending.append((watchers, [w.forward_begin(layer) for w in watchers], stage_input))
        return None

    def _post_forward(self, layer, args, kwargs, output):
        if not self._pending:  # a watcher attached in the middle of this call
            return None
        watchers, tokens, stage_input = self._pending.pop()
        states = [None] * len(watchers)
        for i in reversed(range(len(watchers))):
            states[i] = watchers[i].forward_end(layer, tokens[i])
        stage_output = _first_tensor(output)
        if not torch.is_grad_enabled() or stage_output is None or not stage_output.requires_grad:
            return None
        if stage_input is None or not stage_input.requires_grad:
            return None
        call = _BackwardCall(layer, watchers, states)
        _GradientPoint.of(stage_output).begins.append(call)
        _GradientPoint.of(stage_input).ends.append(call)
        return None


class _BackwardCall:
    __slots__ = ("layer", "watchers", "states", "tokens")

    def __init__(self, layer, watchers, states) -> None:
        self.layer = layer
        self.watchers = watchers
        self.states = states
        self.tokens: list | None = None  # set when its backward begins


class _GradientPoint:
    """One gradient hook per activation tensor: the backward calls it ends and those it begins."""

    __slots__ = ("ends", "begins")

    def __init__(self) -> None:
        self.ends: list[_BackwardCall] = []
        self.begins: list[_BackwardCall] = []

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "_GradientPoint":
        point = getattr(tensor, "_megascan_gradient_point", None)
        if point is None:
            point = cls()
            tensor._megascan_gradient_point = point
            tensor.register_hook(point._gradient_ready)
        return point

    def _gradient_ready(self, grad):
        ends, self.ends = self.ends, []
        begins, self.begins = self.begins, []
        chained: dict[int, Any] = {}
        for call in ends:
            if call.tokens is None:  # its output's gradient never came: no backward to close
                continue
            for i in reversed(range(len(call.watchers))):
                watcher = call.watchers[i]
                chained[id(watcher)] = watcher.backward_end(call.layer, call.states[i], call.tokens[i])
        for call in begins:
            call.tokens = [watcher.backward_begin(call.layer, state, chained.get(id(watcher)))
                           for watcher, state in zip(call.watchers, call.states)]
        return None


class LayerScopes(LayerWatcher):
    """`layer_forward` / `layer_backward` events of every transformer layer, with the (microbatch,
    chunk) context of the forward call; attached only inside traced windows."""

    def __init__(self, tracer, layers: Sequence[torch.nn.Module], *, numbered: bool = False) -> None:
        """`numbered`: number the layers 1.. in the given order (for blocks without
        megatron-core's `layer_number`)."""
        self.tracer = tracer
        self.layers = list(layers)
        self._numbers = {id(layer): i + 1 for i, layer in enumerate(self.layers)} if numbered else None

    def number(self, layer: torch.nn.Module) -> int:
        return self._numbers[id(layer)] if self._numbers is not None else layer.layer_number

    def attach(self) -> None:
        watch_layers(self.layers, self)

    def detach(self) -> None:
        unwatch_layers(self.layers, self)

    def forward_begin(self, layer):
        return self.tracer.mark()

    def forward_end(self, layer, begun):
        tracer = self.tracer
        context = tracer.context
        tracer.record_layer("layer_forward", begun, tracer.mark(), self.number(layer), context)
        return context

    def backward_begin(self, layer, context, chained):
        # One timestamp per gradient keeps L+1's backward end equal to L's backward start.
        return chained if chained is not None else self.tracer.mark()

    def backward_end(self, layer, context, begun):
        end = self.tracer.mark()
        self.tracer.record_layer("layer_backward", begun, end, self.number(layer), context)
        return end
