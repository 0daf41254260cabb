"""One forward of the whole model across this job's ranks, with optional captures and
perturbations, gathered on global rank 0 (the rank that serves the UI).

Every rank calls `ModelRunner.forward` with the same arguments (rank 0 broadcasts them). Stages
pass activations with torch.distributed send/recv; TP shards are all-gathered; each stage's
captures travel to rank 0 with gather_object. With one rank no collective is called at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.scope.capture import CaptureHooks, gather_tensor_parallel
from megatron.scope.perturb import Perturbation, PerturbationHooks


@dataclass(kw_only=True, slots=True)
class ModelInfo:
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_positions: int
    tp: int = 1
    pp: int = 1
    name: str = "model"
    num_query_groups: int | None = None  # grouped-query attention (None: one key/value head per head)

    def as_message(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                "ffn_hidden_size": self.ffn_hidden_size, "vocab_size": self.vocab_size,
                "max_positions": self.max_positions, "tp": self.tp, "pp": self.pp, "name": self.name}


@dataclass(slots=True)
class ForwardResult:
    """On rank 0: final logits [batch, seq, vocab], captures kind -> [layers, ...] and the
    logit-lens top-k per layer. Other ranks get an empty result."""

    logits: torch.Tensor | None = None
    captures: dict[str, torch.Tensor] = field(default_factory=dict)
    lens_ids: torch.Tensor | None = None  # [layers, batch, positions, k]
    lens_probs: torch.Tensor | None = None


def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    # megatron-core's fallback mask is built on CUDA, so every forward passes its own.
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)


class ModelRunner:
    """This rank's chunks plus where it sits in the TP x PP grid."""

    def __init__(self, chunks: Sequence[torch.nn.Module], info: ModelInfo, device: torch.device | None = None) -> None:
        self.chunks = list(chunks)
        self.info = info
        self.device = device or torch.device("cpu")
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.tp_rank, self.pp_rank, self.tp_group = 0, 0, None
        self.pp_ranks: list[int] = [0]
        if self.distributed:
            from megatron.core import parallel_state as ps

            self.tp_rank = ps.get_tensor_model_parallel_rank()
            self.pp_rank = ps.get_pipeline_model_parallel_rank()
            self.tp_group = ps.get_tensor_model_parallel_group()
            self.pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        if len(self.chunks) != 1:
            raise ValueError("MegaScope runs one model chunk per rank (no virtual pipeline stages)")
        self.module = getattr(self.chunks[0], "module", self.chunks[0])

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.info.pp - 1

    def forward(self, tokens: torch.Tensor, capture: Sequence[str] = (), perturbations: Sequence[Perturbation] = (),
                positions: torch.Tensor | None = None, lens_top_k: int = 0, grad: bool = False) -> ForwardResult:
        """tokens [batch, seq]. `positions` [batch, n] picks the sequence positions whose captures
        and lens results are kept (all positions when None)."""
        tokens = tokens.to(self.device)
        batch, seq = tokens.shape
        position_ids = torch.arange(seq, device=self.device).unsqueeze(0).expand(batch, seq)
        mask = causal_mask(seq, self.device)
        kinds = list(capture)
        if lens_top_k and "layer" not in kinds:
            kinds.append("layer")
        hooks = CaptureHooks(self.chunks, kinds) if kinds else None
        if hooks is None and not perturbations and not grad:
            # The plain path: nothing registered, nothing wrapped (capture-off overhead ~ 0).
            with torch.no_grad():
                output = self._run_stage(tokens, position_ids, mask, batch, seq)
            logits = self._gather_vocab(output) if self.is_last_stage else None
            return self._collect(logits, {}, None)
        perturb = PerturbationHooks(self.chunks, perturbations, self.info.num_heads, self.tp_rank, self.info.tp,
                                    num_query_groups=self.info.num_query_groups)
        with torch.set_grad_enabled(grad), perturb.active():
            if hooks is None:
                output = self._run_stage(tokens, position_ids, mask, batch, seq)
                captured = None
            else:
                with hooks.active() as captured:
                    output = self._run_stage(tokens, position_ids, mask, batch, seq)
        logits = self._gather_vocab(output) if self.is_last_stage else None
        if captured is not None and self.info.tp > 1:
            captured = gather_tensor_parallel(captured, self.tp_group, self.info.tp)
        picked = {} if captured is None else self._pick_positions(captured.tensors, positions, seq)
        lens = self._logit_lens(picked.get("layer"), lens_top_k) if lens_top_k else None
        if lens_top_k and "layer" not in capture:
            picked.pop("layer", None)
        return self._collect(logits, picked, lens)

    # --- pipeline ---------------------------------------------------------------------
    def _run_stage(self, tokens, position_ids, mask, batch: int, seq: int) -> torch.Tensor:
        received = None
        if not self.is_first_stage:
            received = torch.empty(seq, batch, self.info.hidden_size, device=self.device,
                                   dtype=next(self.module.parameters()).dtype)
            dist.recv(received, src=self.pp_ranks[self.pp_rank - 1])
        self.module.set_input_tensor(received)
        output = self.chunks[0](tokens, position_ids, mask)
        if not self.is_last_stage:
            dist.send(output.detach().contiguous(), dst=self.pp_ranks[self.pp_rank + 1])
        return output

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # Logits leave the output layer split over TP along the vocabulary: [batch, seq, vocab/tp].
        if self.info.tp == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.info.tp)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def _pick_positions(tensors: dict[str, dict[int, torch.Tensor]], positions: torch.Tensor | None,
                        seq: int) -> dict[str, torch.Tensor]:
        picked = {}
        for kind, per_layer in tensors.items():
            if not per_layer:
                continue
            stacked = torch.stack([per_layer[n] for n in sorted(per_layer)])
            if kind == "attention":
                # [layers, batch, heads, query, key] -> keep the chosen query rows
                out = stacked if positions is None else torch.stack(
                    [stacked[:, b, :, positions[b], :] for b in range(stacked.shape[1])], dim=1)
            else:
                # [layers, seq, batch, width] -> [layers, batch, positions, width]
                out = stacked.transpose(1, 2)
                if positions is not None:
                    out = torch.stack([out[:, b, positions[b], :] for b in range(out.shape[1])], dim=1)
            picked[kind] = out
        return picked

    # --- logit lens -----------------------------------------------------------------
    def _logit_lens(self, layer_outputs: torch.Tensor | None, k: int):
        """Each layer's residual stream through the final norm and the unembedding, on the last
        stage (which holds both); earlier stages send it their layers' outputs."""
        if layer_outputs is None:
            return None
        if self.info.pp > 1:
            last = self.pp_ranks[-1]
            if not self.is_last_stage:
                dist.send(layer_outputs.contiguous(), dst=last)
                return None
            pieces = []
            for stage in range(self.info.pp - 1):
                buffer = torch.empty_like(layer_outputs)
                dist.recv(buffer, src=self.pp_ranks[stage])
                pieces.append(buffer)
            layer_outputs = torch.cat(pieces + [layer_outputs], dim=0)
        module = self.module
        with torch.no_grad():
            normed = module.decoder.final_layernorm(layer_outputs)
            weight = (module.shared_embedding_or_output_weight() if module.share_embeddings_and_output_weights
                      else module.output_layer.weight)
            logits = self._gather_vocab(F.linear(normed, weight))[..., : self.info.vocab_size]
            probs = torch.softmax(logits.float(), dim=-1)
            top = probs.topk(k, dim=-1)
        return top.indices, top.values

    def _collect(self, logits, picked: dict[str, torch.Tensor], lens) -> ForwardResult:
        if not self.distributed:
            # Captures go to the host (PCA, frames); the logits stay where they are for sampling.
            result = ForwardResult(logits=logits, captures={k: v.cpu() for k, v in picked.items()})
            if lens is not None:
                result.lens_ids, result.lens_probs = lens[0].cpu(), lens[1].cpu()
            return result
        # Rank 0 gets every stage's layers: TP rank 0 of each stage contributes (its DP
        # replica 0 only, so a training job with DP > 1 sends each layer once).
        from megatron.core import parallel_state as ps

        mine: dict[str, Any] = {}
        if self.tp_rank == 0 and ps.get_data_parallel_rank() == 0:
            mine = {"captures": {k: v.cpu() for k, v in picked.items()}, "stage": self.pp_rank}
            if logits is not None:
                mine["logits"] = logits.detach().float().cpu()
            if lens is not None:
                mine["lens"] = (lens[0].cpu(), lens[1].cpu())
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() != 0:
            return ForwardResult()
        result = ForwardResult()
        stages = sorted((g for g in gathered if g), key=lambda g: g["stage"])
        kinds = set().union(*(g["captures"].keys() for g in stages)) if stages else set()
        for kind in kinds:
            result.captures[kind] = torch.cat([g["captures"][kind] for g in stages if kind in g["captures"]], dim=0)
        for g in stages:
            if "logits" in g:
                result.logits = g["logits"]
            if "lens" in g:
                result.lens_ids, result.lens_probs = g["lens"]
        return result
