"""The trainer's view of the data: microbatches by (iteration, microbatch) for this
data-parallel rank, with the causal mask added and moved to the training device."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megatron.app.data import MicrobatchSource, build_microbatch_sources, tokenizer_from_config


@dataclass(kw_only=True)
class TrainingData:
    train: MicrobatchSource
    valid: MicrobatchSource | None
    vocab_size: int
    dp_rank: int
    device: torch.device
    seq_length: int
    _cache: dict = field(default_factory=dict)

    @classmethod
    def build(cls, cfg, dp_rank: int, device: torch.device) -> "TrainingData":
        data_cfg = dataclasses.replace(cfg.data, data_parallel_size=cfg.parallel.data_parallel_size)
        tokenizer = tokenizer_from_config(data_cfg)
        train, valid, _ = build_microbatch_sources(data_cfg, tokenizer)
        return cls(train=train, valid=valid, vocab_size=tokenizer.vocab_size, dp_rank=dp_rank, device=device,
                   seq_length=cfg.model.seq_length)

    def _prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "attention_mask" not in batch:
            # megatron-core's fallback mask is built on CUDA; pass the causal mask explicitly.
            seq = self.seq_length
            batch["attention_mask"] = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _get(self, key: tuple, fetch):
        # First and last pipeline stages both ask for each microbatch; fetch it once.
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = self._prepare(fetch())
        return self._cache[key]

    def train_microbatch(self, iteration: int, microbatch: int) -> dict[str, torch.Tensor]:
        """This replica's `microbatch`-th microbatch under an even split of the global batch."""
        return self.train_global_microbatch(iteration, self.dp_rank * self.train.num_microbatches + microbatch)

    def train_global_microbatch(self, iteration: int, global_microbatch: int) -> dict[str, torch.Tensor]:
        """A microbatch by its index in the whole global batch (a microbatch plan may give a replica
        any contiguous run of them)."""
        return self._get(("train", iteration, global_microbatch),
                         lambda: self.train.get_global(iteration, global_microbatch))

    def valid_microbatch(self, batch_index: int, microbatch: int) -> dict[str, torch.Tensor]:
        if self.valid is None:
            raise ValueError("no validation split: --split gives it weight 0")
        return self._get(("valid", batch_index, microbatch),
                         lambda: self.valid.get(batch_index, self.dp_rank, microbatch))
