"""Forward hooks on megatron-core modules that record a model's internals during one forward:
QKV projection, attention probabilities, MLP fc1/fc2 outputs and every layer's output.
Nothing is registered while capture is off, so the plain forward runs untouched."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

# Capture kind -> (module path inside a TransformerLayer, split over TP along dim or None).
# attention: [batch, heads, query, key] split over heads; the others are [seq, batch, width].
CAPTURE_SITES: dict[str, tuple[str, int | None]] = {
    "qkv": ("self_attention.linear_qkv", -1),
    "attention": ("self_attention.core_attention.scale_mask_softmax", 1),
    "fc1": ("mlp.linear_fc1", -1),
    "fc2": ("mlp.linear_fc2", None),
    "layer": ("", None),
}
CAPTURE_KINDS: tuple[str, ...] = tuple(CAPTURE_SITES)


def _submodule(layer: torch.nn.Module, path: str) -> torch.nn.Module:
    module = layer
    for part in filter(None, path.split(".")):
        module = getattr(module, part)
    return module


@dataclass(slots=True)
class CaptureSet:
    """What one rank recorded: kind -> global layer index -> tensor (this rank's TP shard)."""

    tensors: dict[str, dict[int, torch.Tensor]]


class CaptureHooks:
    """Registers hooks for the chosen kinds on this rank's chunks inside a `with` block."""

    def __init__(self, chunks: Sequence[torch.nn.Module], kinds: Sequence[str]) -> None:
        unknown = set(kinds) - set(CAPTURE_SITES)
        if unknown:
            raise ValueError(f"unknown capture kinds {sorted(unknown)}; choose from {CAPTURE_KINDS}")
        self.chunks = [getattr(c, "module", c) for c in chunks]
        self.kinds = list(kinds)
        self.result = CaptureSet({kind: {} for kind in self.kinds})

    @contextlib.contextmanager
    def active(self) -> Iterator[CaptureSet]:
        handles = []
        try:
            for chunk in self.chunks:
                for layer in chunk.decoder.layers:
                    number = layer.layer_number - 1
                    for kind in self.kinds:
                        module = _submodule(layer, CAPTURE_SITES[kind][0])
                        handles.append(module.register_forward_hook(self._hook(kind, number)))
            yield self.result
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, kind: str, number: int):
        store = self.result.tensors[kind]

        def hook(module, args, output):
            if isinstance(output, tuple):
                value, bias = output[0], output[1] if len(output) > 1 else None
                # Row-parallel layers hand their bias back separately for a fused bias-add;
                # the MLP output a reader expects includes it.
                if kind == "fc2" and isinstance(bias, torch.Tensor):
                    value = value + bias
            else:
                value = output
            store[number] = value.detach().float().clone()
        return hook


def gather_tensor_parallel(captured: CaptureSet, group, tp_size: int) -> CaptureSet:
    """All-gather the TP-split kinds so every TP rank holds the unsharded tensors."""
    if tp_size == 1:
        return captured
    out: dict[str, dict[int, torch.Tensor]] = {}
    for kind in sorted(captured.tensors):
        dim = CAPTURE_SITES[kind][1]
        out[kind] = {}
        for number in sorted(captured.tensors[kind]):
            value = captured.tensors[kind][number]
            if dim is None:
                out[kind][number] = value
                continue
            parts = [torch.empty_like(value) for _ in range(tp_size)]
            dist.all_gather(parts, value.contiguous(), group=group)
            out[kind][number] = torch.cat(parts, dim=dim)
    return CaptureSet(out)
