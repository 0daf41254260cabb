"""Controlled perturbations of a running model: storage (noise on weights, reversible),
calculation (noise on attention/MLP outputs) and system (noise or an offset on the hidden state
passed between layers). Seeded and parallelism-invariant; differentiable, so training goes on."""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

KINDS = ("storage", "calculation", "system")
TYPES = ("gaussian", "uniform", "bitflip", "offset")
_MANTISSA_BITS = 23  # bit flips stay in the float32 mantissa: a fault, not an inf


class PerturbationError(ValueError):
    """A perturbation spec from the client is not valid; the message names the field."""


@dataclass(kw_only=True, slots=True)
class Perturbation:
    """One perturbation. `layers`/`heads` empty = all; `tokens` is a [start, end) position range."""

    enabled: bool = True
    kind: str = "calculation"
    type: str = "gaussian"
    intensity: float = 0.0
    seed: int = 0
    layers: list[int] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    tokens: tuple[int, int] | None = None

    @classmethod
    def from_message(cls, data: Any, num_layers: int, num_heads: int) -> "Perturbation":
        if not isinstance(data, dict):
            raise PerturbationError("a perturbation must be an object")
        unknown = set(data) - {"enabled", "kind", "type", "intensity", "seed", "layers", "heads", "tokens", "id"}
        if unknown:
            raise PerturbationError(f"unknown perturbation fields: {sorted(unknown)}")
        kind = data.get("kind", "calculation")
        kind_type = data.get("type", "gaussian")
        if kind not in KINDS:
            raise PerturbationError(f"perturbation kind {kind!r} is not one of {KINDS}")
        if kind_type not in TYPES:
            raise PerturbationError(f"perturbation type {kind_type!r} is not one of {TYPES}")
        intensity = data.get("intensity", 0.0)
        if not isinstance(intensity, (int, float)) or isinstance(intensity, bool) or not -1e4 <= intensity <= 1e4:
            raise PerturbationError("perturbation intensity must be a number in [-1e4, 1e4]")
        if kind_type == "bitflip" and not 0 <= intensity <= 1:
            raise PerturbationError("bitflip intensity is a per-element probability in [0, 1]")
        seed = data.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31:
            raise PerturbationError("perturbation seed must be an integer in [0, 2^31)")
        layers = _index_list(data.get("layers", []), num_layers, "layers")
        heads = _index_list(data.get("heads", []), num_heads, "heads")
        tokens = data.get("tokens")
        if tokens is not None:
            if (not isinstance(tokens, list) or len(tokens) != 2
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
                    or tokens[0] >= tokens[1]):
                raise PerturbationError("perturbation tokens must be [start, end) with 0 <= start < end")
            tokens = (tokens[0], tokens[1])
        enabled = data.get("enabled", True)
        if not isinstance(enabled, bool):
            raise PerturbationError("perturbation enabled must be true or false")
        return cls(enabled=enabled, kind=kind, type=kind_type, intensity=float(intensity), seed=seed,
                   layers=layers, heads=heads, tokens=tokens)

    def targets_layer(self, layer: int) -> bool:
        return not self.layers or layer in self.layers


def _index_list(value: Any, limit: int, name: str) -> list[int]:
    if not isinstance(value, list) or len(value) > 4096:
        raise PerturbationError(f"perturbation {name} must be a list of indices")
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < limit:
            raise PerturbationError(f"perturbation {name} entry {item!r} is not in [0, {limit})")
    return sorted(set(value))


def _generator(seed: int, *names: object) -> torch.Generator:
    key = zlib.crc32("/".join(str(n) for n in names).encode())
    return torch.Generator().manual_seed((seed * 1_000_003 + key) % (2**63))


def perturb_values(x: torch.Tensor, p: Perturbation, generator: torch.Generator,
                   full_shape: Sequence[int] | None = None, piece: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x perturbed by p. Random draws are made over `full_shape` and cut to this rank's `piece`
    (dim, index, parts) so a tensor-parallel shard sees the same noise as the unsharded tensor."""
    shape = list(full_shape or x.shape)

    def draw(kind: str) -> torch.Tensor:
        if kind == "normal":
            values = torch.randn(shape, generator=generator)
        elif kind == "uniform":
            values = torch.rand(shape, generator=generator)
        else:
            values = torch.randint(0, _MANTISSA_BITS, shape, generator=generator)
        if piece is not None:
            dim, index, parts = piece
            values = values.chunk(parts, dim=dim)[index]
        return values.to(x.device)

    if p.type == "gaussian":
        return x + (draw("normal") * p.intensity).to(x.dtype)
    if p.type == "uniform":
        factor = 1.0 + (draw("uniform") * 2.0 - 1.0) * p.intensity
        return x * factor.to(x.dtype)
    if p.type == "offset":
        return x + p.intensity
    # bitflip: the flip is not differentiable, so the gradient passes straight through.
    hit = draw("uniform") < p.intensity
    bit = draw("bits")
    as_int = x.detach().float().contiguous().view(torch.int32)
    flipped = torch.where(hit, as_int ^ (torch.ones_like(as_int) << bit.to(torch.int32)), as_int)
    return x + (flipped.view(torch.float32).to(x.dtype) - x.detach())


def _token_slice(p: Perturbation, seq: int) -> slice:
    if p.tokens is None:
        return slice(0, seq)
    return slice(min(p.tokens[0], seq), min(p.tokens[1], seq))


class PerturbationHooks:
    """Installs perturbations on this rank's chunks for the duration of a `with` block."""

    def __init__(self, chunks: Sequence[torch.nn.Module], perturbations: Sequence[Perturbation],
                 num_heads: int, tp_rank: int = 0, tp_size: int = 1, num_query_groups: int | None = None) -> None:
        self.chunks = [getattr(c, "module", c) for c in chunks]
        self.perturbations = [p for p in perturbations if p.enabled and p.intensity != 0]
        self.num_heads = num_heads
        self.num_groups = num_query_groups or num_heads
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def layers(self) -> Iterator[tuple[int, torch.nn.Module]]:
        for chunk in self.chunks:
            for layer in chunk.decoder.layers:
                yield layer.layer_number - 1, layer

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for index, p in enumerate(self.perturbations):
                if p.kind == "storage":
                    stack.enter_context(self._storage(p, index))
                else:
                    for handle in self._install(p, index):
                        stack.callback(handle.remove)
            yield

    # --- storage: noise on weights, put back afterwards -----------------------------
    @contextlib.contextmanager
    def _storage(self, p: Perturbation, index: int) -> Iterator[None]:
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for number, layer in self.layers():
                if not p.targets_layer(number):
                    continue
                for name, param in layer.named_parameters():
                    if not name.endswith("weight") or "norm" in name:
                        continue
                    saved.append((param, param.detach().clone()))
                    full, piece = self._full_shape(param)
                    generator = _generator(p.seed, "storage", index, number, name)
                    noisy = perturb_values(param.detach().float().cpu(), p, generator, full, piece)
                    if p.heads and name.endswith("linear_qkv.weight"):
                        noisy = self._only_heads(param.detach().float().cpu(), noisy, p.heads)
                    param.copy_(noisy.to(param.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for param, original in saved:
                    param.copy_(original)

    def _full_shape(self, param: torch.Tensor) -> tuple[list[int], tuple[int, int, int] | None]:
        if getattr(param, "tensor_model_parallel", False) and self.tp_size > 1:
            full = list(param.shape)
            full[param.partition_dim] *= self.tp_size
            return full, (param.partition_dim, self.tp_rank, self.tp_size)
        return list(param.shape), None

    def _only_heads(self, clean: torch.Tensor, noisy: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """Keep the noise only in the QKV rows of the chosen heads. Rows are grouped per key/value
        group: that group's query heads, its key head, its value head (with one group per head,
        simply [q; k; v] per head). A head's rows are its query rows and its group's key and value."""
        local_groups = self.num_groups // self.tp_size
        per_group = clean.shape[0] // local_groups
        queries_per_group = self.num_heads // self.num_groups
        head_dim = per_group // (queries_per_group + 2)
        keep = torch.zeros(clean.shape[0], dtype=torch.bool)
        for head in heads:
            group, within = divmod(head, queries_per_group)
            owner, slot = divmod(group, local_groups)
            if owner == self.tp_rank:
                base = slot * per_group
                keep[base + within * head_dim: base + (within + 1) * head_dim] = True
                keep[base + queries_per_group * head_dim: base + per_group] = True
        return torch.where(keep.view(-1, *([1] * (clean.dim() - 1))), noisy, clean)

    # --- calculation and system: forward hooks --------------------------------------
    def _install(self, p: Perturbation, index: int) -> list[torch.utils.hooks.RemovableHandle]:
        handles = []
        for number, layer in self.layers():
            if not p.targets_layer(number):
                continue
            if p.kind == "system":
                handles.append(layer.register_forward_hook(self._layer_output_hook(p, index, number)))
            else:
                attention = layer.self_attention.core_attention
                hook = self._sequence_hook(p, index, number, "attention", True)
                handles.append(attention.register_forward_hook(hook))
                if not p.heads:
                    handles.append(layer.mlp.linear_fc2.register_forward_hook(
                        self._sequence_hook(p, index, number, "mlp", False)))
        return handles

    def _layer_output_hook(self, p: Perturbation, index: int, number: int):
        def hook(module, args, output):
            hidden, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
            changed = self._perturb_sequence(hidden, p, _generator(p.seed, "system", index, number), None)
            return (changed, *rest) if rest is not None else changed
        return hook

    def _sequence_hook(self, p: Perturbation, index: int, number: int, site: str, sharded: bool):
        def hook(module, args, output):
            is_tuple = isinstance(output, tuple)
            value = output[0] if is_tuple else output
            generator = _generator(p.seed, "calculation", site, index, number)
            changed = self._perturb_sequence(value, p, generator, sharded)
            return (changed, *output[1:]) if is_tuple else changed
        return hook

    def _perturb_sequence(self, value: torch.Tensor, p: Perturbation, generator: torch.Generator,
                          sharded: bool | None) -> torch.Tensor:
        # [seq, batch, width]; the noise is drawn for the whole unsharded width.
        seq = value.shape[0]
        rows = _token_slice(p, seq)
        full, piece = list(value.shape), None
        if sharded and self.tp_size > 1:
            full[-1] *= self.tp_size
            piece = (2, self.tp_rank, self.tp_size)
        noisy = perturb_values(value, p, generator, full, piece)
        keep = torch.zeros(seq, dtype=torch.bool, device=value.device)
        keep[rows] = True
        mask = keep.view(seq, 1, 1)
        if sharded and p.heads:
            local = self.num_heads // self.tp_size
            per_head = value.shape[-1] // local
            cols = torch.zeros(value.shape[-1], dtype=torch.bool, device=value.device)
            for head in p.heads:
                owner, slot = divmod(head, local)
                if owner == self.tp_rank:
                    cols[slot * per_head:(slot + 1) * per_head] = True
            mask = mask & cols.view(1, 1, -1)
        return torch.where(mask, noisy, value)
