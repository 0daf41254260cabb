"""The RNG state a forward instance sends with each stage input reproduces its dropout masks on
the backward instance: CPU generator and every RNG-tracker stream (attention dropout)."""
from __future__ import annotations

import pytest
import torch

from megatron.app.cpu_stand_ins import cpu_rng_tracker
from megatron.app.rng import rng_restore, rng_snapshot


def draw() -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden-dropout mask (CPU generator) and an attention-dropout mask (tracker stream)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    hidden = torch.nn.functional.dropout(torch.ones(64), 0.5)
    with get_cuda_rng_tracker().fork():
        attention = torch.nn.functional.dropout(torch.ones(64), 0.5)
    return hidden, attention


def test_restored_state_redraws_the_same_masks_on_a_differently_seeded_process():
    from megatron.core.tensor_parallel import random as mc_random

    saved = mc_random._CUDA_RNG_STATE_TRACKER, mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    try:
        torch.manual_seed(1)
        cpu_rng_tracker(1, 0)
        draw()  # the forward instance is somewhere in its streams
        packed = rng_snapshot()
        expected = draw()
        # "The backward instance": other seeds, other positions in every stream.
        torch.manual_seed(99)
        cpu_rng_tracker(99, 1)
        unrestored = draw()
        assert not torch.equal(unrestored[0], expected[0]) and not torch.equal(unrestored[1], expected[1])
        rng_restore(packed)
        got = draw()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        with pytest.raises(RuntimeError, match="does not match"):
            rng_restore(packed[:-1])
    finally:
        mc_random._CUDA_RNG_STATE_TRACKER, mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved
