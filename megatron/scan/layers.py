"""Per-layer scopes for `--trace-granularity full`: forward hooks time each transformer layer's
forward; tensor gradient hooks time its backward (grad of its output -> grad of its input).
Hooks exist only inside traced windows, so untraced iterations pay nothing."""
from __future__ import annotations

from typing import Sequence

import torch


def transformer_layers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """megatron-core TransformerLayer instances (anything with a `layer_number`), in model order."""
    layers = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "layer_number", None), int) and hasattr(module, "self_attention"):
                layers.append(module)
    return layers


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item
    return None


class LayerScopes:
    def __init__(self, tracer, layers: Sequence[torch.nn.Module]) -> None:
        self.tracer = tracer
        self.layers = list(layers)
        self._handles: list = []

    def attach(self) -> None:
        for layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post_forward, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_forward(self, layer, args, kwargs):
        layer.__dict__["_megascan_start"] = self.tracer.mark()
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        layer.__dict__["_megascan_input"] = hidden if isinstance(hidden, torch.Tensor) else None

    def _post_forward(self, layer, args, kwargs, output):
        tracer = self.tracer
        end = tracer.mark()
        number = layer.layer_number
        context = tracer.context
        tracer.record_layer("layer_forward", layer.__dict__.pop("_megascan_start"), end, number, context)
        stage_input = layer.__dict__.pop("_megascan_input", None)
        stage_output = _first_tensor(output)
        if not torch.is_grad_enabled() or stage_output is None or not stage_output.requires_grad:
            return None
        if stage_input is None or not stage_input.requires_grad:
            return None
        # Layer L's output is layer L+1's input: the hooks of both fire for the same gradient, and
        # sharing one timestamp per tensor keeps L+1's backward end equal to L's backward start.
        output_mark = _shared_mark(stage_output)
        input_mark = _shared_mark(stage_input)
        started: list = []

        def output_grad_ready(grad):
            started.append(output_mark.setdefault("t", tracer.mark()))

        def input_grad_ready(grad):
            if started:
                tracer.record_layer("layer_backward", started.pop(), input_mark.setdefault("t", tracer.mark()),
                                    number, context)

        stage_output.register_hook(output_grad_ready)
        stage_input.register_hook(input_grad_ready)
        return None


def _shared_mark(tensor: torch.Tensor) -> dict:
    holder = getattr(tensor, "_megascan_grad_mark", None)
    if holder is None:
        holder = {}
        tensor._megascan_grad_mark = holder
    return holder
