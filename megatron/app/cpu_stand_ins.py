"""CPU stand-ins for the megatron-core internals that allocate on or talk to CUDA, so that
megatron-core's model, schedules, DDP and recomputation run on gloo ranks. Each one names the
megatron-core call it replaces; tests/app/test_device.py checks that megatron-core still contains
that call, so an upgrade that changes it fails loudly. The CPU backend installs them; a script
written directly against megatron-core calls `run_megatron_core_on_cpu(seed)`."""
from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.utils import GlobalMemoryBuffer


def cpu_global_memory_buffer() -> GlobalMemoryBuffer:
    """Replaces `megatron.core.utils.GlobalMemoryBuffer.get_tensor`, which allocates with
    `device=torch.cuda.current_device()`; the local-spec attention takes its baddbmm input
    buffer from it (`parallel_state.get_global_memory_buffer()`)."""
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUGlobalMemoryBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            required = math.prod(tensor_shape)
            buffer = self.buffer.get((name, dtype))
            if buffer is None or buffer.numel() < required:
                buffer = torch.empty(required, dtype=dtype, device="cpu")
                self.buffer[(name, dtype)] = buffer
            return buffer[:required].view(*tensor_shape)

    return CPUGlobalMemoryBuffer()


def cpu_rng_tracker(seed: int, tp_rank: int) -> CudaRNGStatesTracker:
    """Replaces `megatron.core.tensor_parallel.random.CudaRNGStatesTracker` (its `add` and
    `fork` call `torch.cuda.get_rng_state`/`manual_seed`), installed where
    `model_parallel_cuda_manual_seed` would install it. The same named streams are kept
    (data-parallel, model-parallel, expert-parallel), forking the CPU generator instead."""
    from megatron.core.tensor_parallel import random as mc_random

    class CPURNGStatesTracker(mc_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_:
                raise ValueError(f"rng seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    tracker = CPURNGStatesTracker()
    # Same seed offsets as model_parallel_cuda_manual_seed, so both devices draw the same streams.
    tracker.add(mc_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mc_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mc_random._CUDA_RNG_STATE_TRACKER = tracker
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def cpu_recompute_rng_states() -> None:
    """Replaces `_get_cuda_rng_state` / `_set_cuda_rng_state` of
    `megatron.core.tensor_parallel.random` (which read and write the CUDA generator) where
    `_get_all_rng_states` / `_set_all_rng_states` call them: activation recomputation
    (`CheckpointFunction`, `--recompute-granularity`) saves every RNG state before the first
    forward and restores it for the recomputed one. On CPU there is no CUDA generator; the CPU
    generator and the tracker's named streams, which those functions save as well, are all there is."""
    from megatron.core.tensor_parallel import random as mc_random

    def no_cuda_state(*args, **kwargs):
        return None

    def restore(state, *args, **kwargs):
        if state is not None:
            raise RuntimeError("a CUDA RNG state reached the CPU backend's recomputation")

    mc_random._get_cuda_rng_state = no_cuda_state
    mc_random._set_cuda_rng_state = restore


@contextlib.contextmanager
def tied_embedding_copy_stays_on_cpu() -> Iterator[None]:
    """Replaces the `weight.data = weight.data.cuda()` in
    `LanguageModule.setup_embeddings_and_output_layer`, run while building a pipeline stage
    that holds a tied word embedding; the embedding-group all-reduce right after it then runs
    over gloo on the CPU tensor. Scoped to model construction only."""
    original = torch.Tensor.cuda

    def stay(self, *args, **kwargs):
        return self

    torch.Tensor.cuda = stay
    try:
        yield
    finally:
        torch.Tensor.cuda = original


class _CUDAOnCPU:
    """`torch.cuda` as megatron-core's pipeline schedule modules see it on the CPU backend.
    Replaces, in `megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator`:
    `device=torch.cuda.current_device()` (receive buffers in `_communicate`, shape tensors in
    `_communicate_shapes`) and `torch.cuda.synchronize()` (after batched P2P when
    `config.batch_p2p_sync`). Anything else it asks of `torch.cuda` fails with the name."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    def __getattr__(self, name):
        raise AttributeError(
            f"megatron-core's pipeline schedule called torch.cuda.{name}, which has no CPU stand-in; "
            "add one to _CUDAOnCPU in megatron/app/cpu_stand_ins.py"
        )


class _TorchOnCPU:
    """`torch` as megatron-core's pipeline schedule modules see it on the CPU backend: the real
    module except for the CUDA-only calls they make. Replaces, in
    `megatron.core.pipeline_parallel.schedules`: `torch.zeros([], dtype=torch.int, device="cuda")`
    (the token count of `forward_backward_no_pipelining`, `..._with_interleaving`,
    `..._without_interleaving`) and `torch.autocast("cuda", ...)` (`forward_step` under
    `config.enable_autocast`); and `torch.cuda` (see `_CUDAOnCPU`)."""

    cuda = _CUDAOnCPU()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_cpu_for_cuda(device), **kwargs)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, device=_cpu_for_cuda(device), **kwargs)

    @staticmethod
    def autocast(device_type, *args, **kwargs):
        return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _cpu_for_cuda(device):
    if device is None:
        return None
    return torch.device("cpu") if torch.device(device).type == "cuda" else device


# Modules that see `_TorchOnCPU` as their `torch` on the CPU backend.
CPU_TORCH_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    # RotaryEmbedding.get_emb moves its inverse frequencies to torch.cuda.current_device() at the
    # first forward (--position-embedding-type rope).
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    # megatron-core's DistributedDataParallel: _ParamAndGradBuffer allocates its gradient (and
    # distributed-optimizer parameter) buffers on torch.cuda.current_device().
    "megatron.core.distributed.param_and_grad_buffer",
)


def use_megatron_core_schedules_on_cpu() -> None:
    """Let `megatron.core.pipeline_parallel.get_forward_backward_func()` (no pipelining, 1F1B,
    interleaved), RoPE and megatron-core's DistributedDataParallel run on the CPU backend: the
    modules in CPU_TORCH_MODULES see `_TorchOnCPU` as their `torch`. Only those modules' globals
    change; idempotent."""
    import importlib

    for name in CPU_TORCH_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCPU):
            module.torch = _TorchOnCPU()


def run_megatron_core_on_cpu(seed: int) -> None:
    """The one call a megatron-core training script makes to run on CPU (gloo) instead of CUDA:
    in place of `tensor_parallel.model_parallel_cuda_manual_seed(seed)`, after
    `parallel_state.initialize_model_parallel(...)`. It installs every stand-in above for the rest
    of the process: the CPU memory buffer, the CPU RNG tracker seeded as
    `model_parallel_cuda_manual_seed` seeds it, the tied-embedding copy kept on the CPU, and
    megatron-core's pipeline schedules on CPU. The script builds its model with
    `use_cpu_initialization=True` and passes an explicit attention mask, as it may on GPUs too."""
    from megatron.core import parallel_state
    from megatron.core.models.common.language_module.language_module import LanguageModule

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("run_megatron_core_on_cpu(seed) goes after parallel_state.initialize_model_parallel(...)")
    parallel_state._GLOBAL_MEMORY_BUFFER = cpu_global_memory_buffer()
    cpu_rng_tracker(seed, parallel_state.get_tensor_model_parallel_rank())
    use_megatron_core_schedules_on_cpu()
    cpu_recompute_rng_states()
    original = LanguageModule.setup_embeddings_and_output_layer
    if not getattr(original, "__cpu_stand_in__", False):
        def setup_embeddings_and_output_layer(self, *args, **kwargs):
            with tied_embedding_copy_stays_on_cpu():
                return original(self, *args, **kwargs)

        setup_embeddings_and_output_layer.__cpu_stand_in__ = True
        LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer
