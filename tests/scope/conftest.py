"""Fixtures for MegaScope tests: a small random model built in this process (one gloo rank)."""
from __future__ import annotations

import pytest
import torch

TINY = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=64, max_position_embeddings=64)


def tiny_config():
    from megatron.app.config import ModelConfig

    return ModelConfig(**TINY)


@pytest.fixture(scope="session")
def tiny_model():
    """A parallelism-invariant random model on one CPU rank, with the byte tokenizer."""
    from megatron.core import parallel_state

    from megatron.app.tokenizer import ByteLevelTokenizer
    from megatron.scope.loading import build_random

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    torch.manual_seed(0)
    return build_random(tiny_config(), ByteLevelTokenizer(), seed=1234)


@pytest.fixture()
def generator(tiny_model):
    from megatron.scope.engine import Coordinator, Generator

    return Generator(Coordinator(tiny_model.runner), tiny_model.tokenizer, tiny_model.tokenizer.vocab_size)
