"""Device backends: the one place where CPU (gloo) and CUDA (NCCL) training differ.

`cuda` uses NCCL, megatron-core's DistributedDataParallel and optimizer, CUDA events.
`cpu` uses gloo, a plain gradient all-reduce over the data-parallel group, `torch.optim`,
host clocks, and the few stand-ins megatron-core's model needs to run without CUDA.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron.app.model import unwrap_model


class DeviceError(RuntimeError):
    """The requested device cannot be used on this machine."""


def resolve_device(requested: str) -> str:
    """Map `--device {auto,cpu,cuda}` to the backend actually used."""
    if requested not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"--device {requested!r} is not one of auto, cpu, cuda")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            "--device cuda was given but torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); pass --device cpu or --device auto"
        )
    return requested


# --------------------------------------------------------------------------------------
# CPU stand-ins for megatron-core internals that allocate on CUDA.
# Each one names the megatron-core call it replaces; tests/app/test_device.py checks that
# megatron-core still contains that call, so an upgrade that changes it fails loudly.
# --------------------------------------------------------------------------------------


def _cpu_global_memory_buffer():
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


def _cpu_rng_tracker(seed: int, tp_rank: int):
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


def _cpu_recompute_rng_states() -> None:
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
def _tied_embedding_copy_stays_on_cpu() -> Iterator[None]:
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
            "add one to _CUDAOnCPU in megatron/app/device.py"
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
    parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_global_memory_buffer()
    _cpu_rng_tracker(seed, parallel_state.get_tensor_model_parallel_rank())
    use_megatron_core_schedules_on_cpu()
    _cpu_recompute_rng_states()
    original = LanguageModule.setup_embeddings_and_output_layer
    if not getattr(original, "__cpu_stand_in__", False):
        def setup_embeddings_and_output_layer(self, *args, **kwargs):
            with _tied_embedding_copy_stays_on_cpu():
                return original(self, *args, **kwargs)

        setup_embeddings_and_output_layer.__cpu_stand_in__ = True
        LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


# --------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Clock:
    """A timing scope: host monotonic time on CPU, CUDA events on GPU (resolved lazily)."""

    start: object
    end: object = None
    cuda: bool = False

    def elapsed_ms(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return float(self.start.elapsed_time(self.end))
        return (self.end - self.start) * 1e3


class DeviceBackend:
    """Interface both devices implement. The trainer calls only these methods."""

    name: str = "base"
    dist_backend: str = "gloo"

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    # --- process groups ------------------------------------------------------------
    def init_distributed(self, timeout_s: float) -> None:
        if dist.is_initialized():
            return
        rank = int(os.environ.get("RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if "MASTER_ADDR" not in os.environ:
            # A plain `python pretrain_gpt.py` (no torchrun) runs as a single rank.
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(
            backend=self.dist_backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **self._init_kwargs(),
        )

    def _init_kwargs(self) -> dict:
        return {}

    def init_model_parallel(self, tp: int, pp: int, vpp: int | None, seed: int,
                            initialize: Callable[[int, int, int | None], None] | None = None) -> None:
        """megatron-core's process groups (or a plugin's `initialize(tp, pp, vpp)`), then seeds."""
        from megatron.core import parallel_state

        if initialize is not None:
            initialize(tp, pp, vpp)
        else:
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
            )
        self._seed(seed)

    def _seed(self, seed: int) -> None:
        raise NotImplementedError

    def model_construction(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    # --- model, gradients, optimizer --------------------------------------------------
    def wrap_model(self, chunks: list[torch.nn.Module], cfg) -> list[torch.nn.Module]:
        raise NotImplementedError

    def zero_grad(self, chunks: Sequence[torch.nn.Module]) -> None:
        raise NotImplementedError

    def finalize_grads(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Data-parallel gradient all-reduce plus the tied-embedding all-reduce."""
        raise NotImplementedError

    def build_optimizer(self, chunks: Sequence[torch.nn.Module], cfg):
        raise NotImplementedError

    def scale_grads(self, chunks: Sequence[torch.nn.Module], factor: float) -> None:
        """Multiply every gradient (after the data-parallel sync) by `factor`."""
        for chunk in chunks:
            for param in chunk.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)

    # --- clocks ---------------------------------------------------------------------
    def clock_start(self) -> Clock:
        return Clock(start=time.perf_counter())

    def clock_stop(self, clock: Clock) -> Clock:
        clock.end = time.perf_counter()
        return clock

    def synchronize(self) -> None:
        pass

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class CPUBackend(DeviceBackend):
    name = "cpu"
    dist_backend = "gloo"

    def init_model_parallel(self, tp: int, pp: int, vpp: int | None, seed: int, initialize=None) -> None:
        from megatron.core import parallel_state

        super().init_model_parallel(tp, pp, vpp, seed, initialize)
        parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_global_memory_buffer()
        use_megatron_core_schedules_on_cpu()
        _cpu_recompute_rng_states()

    def _seed(self, seed: int) -> None:
        from megatron.core import parallel_state

        torch.manual_seed(seed)
        _cpu_rng_tracker(seed, parallel_state.get_tensor_model_parallel_rank())

    def model_construction(self) -> contextlib.AbstractContextManager:
        return _tied_embedding_copy_stays_on_cpu()

    def wrap_model(self, chunks, cfg):
        return list(chunks)

    def zero_grad(self, chunks):
        for chunk in chunks:
            for param in chunk.parameters():
                param.grad = None

    def finalize_grads(self, chunks):
        from megatron.core import parallel_state

        dp_group = parallel_state.get_data_parallel_group()
        dp_size = dist.get_world_size(dp_group)
        grads = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
        if dp_size > 1 and grads:
            # One flat buffer per dtype: one all-reduce instead of one per parameter.
            for dtype in sorted({g.dtype for g in grads}, key=str):
                same = [g for g in grads if g.dtype == dtype]
                flat = torch._utils._flatten_dense_tensors(same)
                flat.div_(dp_size)
                dist.all_reduce(flat, group=dp_group)
                for grad, synced in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
                    grad.copy_(synced)
        _all_reduce_tied_embedding_grads(chunks)

    def build_optimizer(self, chunks, cfg):
        groups = parameter_groups(chunks, cfg)
        if cfg.fp16:
            return Fp16Optimizer(chunks, groups, cfg)
        return TorchOptimizer(
            torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps),
            chunks,
            clip_grad=cfg.clip_grad,
        )


class CUDABackend(DeviceBackend):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self) -> None:
        super().__init__()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count()
        if local_ranks > gpus:
            # NCCL refuses two ranks of one communicator on the same GPU, and fails late at that.
            raise DeviceError(
                f"--device cuda: {local_ranks} ranks on this node but {gpus} GPU{'s' if gpus != 1 else ''}; "
                f"NCCL needs one GPU per rank. Launch at most {gpus} processes per node "
                "(torchrun --nproc-per-node), or pass --device cpu to run every rank on gloo"
            )
        torch.cuda.set_device(local_rank)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def _init_kwargs(self) -> dict:
        return {"device_id": self.device}

    def _seed(self, seed: int) -> None:
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def wrap_model(self, chunks, cfg):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=bool(cfg is not None and cfg.optimizer.use_distributed_optimizer),
        )
        wrapped = []
        for index, chunk in enumerate(chunks):
            chunk.cuda(self.device)
            wrapped.append(
                DistributedDataParallel(
                    config=chunk.config,
                    ddp_config=ddp_config,
                    module=chunk,
                    # Only the first chunk may skip bucketing; the others overlap nothing here.
                    disable_bucketing=index > 0,
                )
            )
        return wrapped

    def zero_grad(self, chunks):
        for chunk in chunks:
            chunk.zero_grad_buffer()
            # megatron-core's optimizer points each param.grad at its main_grad. Left there,
            # autograd would add the next first microbatch into main_grad in place and the DDP
            # hook would add it once more: from the second iteration of a process on, the first
            # microbatch would count twice (seen on an H100 as a resumed run whose first grad
            # norm differed from the uninterrupted run's).
            for param in chunk.parameters():
                param.grad = None

    def finalize_grads(self, chunks):
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(list(chunks))

    def scale_grads(self, chunks, factor):
        for chunk in chunks:
            chunk.scale_gradients(factor)  # the DDP buffers hold the gradients (main_grad)

    def build_optimizer(self, chunks, cfg):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=cfg.bf16,
            fp16=cfg.fp16,
            params_dtype=torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32,
            loss_scale=cfg.loss_scale,
            initial_loss_scale=cfg.initial_loss_scale,
            min_loss_scale=cfg.min_loss_scale,
            loss_scale_window=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            decoupled_lr=cfg.decoupled_lr,
            decoupled_min_lr=cfg.decoupled_min_lr,
        )
        return MegatronOptimizer(get_megatron_optimizer(opt_config, list(chunks)))

    def clock_start(self) -> Clock:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return Clock(start=event, cuda=True)

    def clock_stop(self, clock: Clock) -> Clock:
        clock.end = torch.cuda.Event(enable_timing=True)
        clock.end.record()
        return clock

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def _all_reduce_tied_embedding_grads(chunks: Sequence[torch.nn.Module]) -> None:
    """Keep the word embedding of the first stage and the output layer of the last stage equal:
    their gradients are summed over the embedding group (first and last pipeline stage)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    weight = None
    for chunk in chunks:
        module = unwrap_model(chunk)
        if getattr(module, "share_embeddings_and_output_weights", False) and (
            module.pre_process or module.post_process
        ):
            if parallel_state.is_pipeline_first_stage(ignore_virtual=True) and module.pre_process:
                weight = module.shared_embedding_or_output_weight()
            elif parallel_state.is_pipeline_last_stage(ignore_virtual=True) and module.post_process:
                weight = module.shared_embedding_or_output_weight()
    if weight is None:
        return
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad, group=parallel_state.get_embedding_group())
    weight.grad = grad


# --------------------------------------------------------------------------------------
# Optimizers: one small interface over torch.optim (CPU) and megatron-core's optimizer (CUDA)
# --------------------------------------------------------------------------------------


def parameter_groups(chunks, cfg) -> list[dict]:
    """AdamW groups: weight decay except on biases and norms; with --decoupled-lr the embedding
    and output layer in groups of their own (marked "decoupled")."""
    groups: dict[tuple[bool, bool], list] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            decay = not (param.ndim == 1 or name.endswith(".bias"))
            decoupled = cfg.decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False)
            groups.setdefault((decay, decoupled), []).append(param)
    return [{"params": params, "weight_decay": cfg.weight_decay if decay else 0.0, "decoupled": decoupled}
            for (decay, decoupled), params in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


class TorchOptimizer:
    """AdamW plus global gradient-norm clipping over the model-parallel group."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks, clip_grad: float) -> None:
        self.optimizer = optimizer
        self.chunks = list(chunks)
        self.clip_grad = clip_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self) -> tuple[bool, float]:
        grad_norm = model_parallel_grad_norm(self.chunks)
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            scale = self.clip_grad / (grad_norm + 1e-6)
            for chunk in self.chunks:
                for param in chunk.parameters():
                    if param.grad is not None:
                        param.grad.mul_(scale)
        self.optimizer.step()
        return True, grad_norm

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class LossScaler:
    """The loss scale of --fp16. Fixed with --loss-scale; otherwise dynamic: it halves once
    --hysteresis overflowing steps have been seen since it last changed (never below
    --min-loss-scale) and doubles after --loss-scale-window steps in a row without overflow."""

    def __init__(self, cfg) -> None:
        self.dynamic = cfg.loss_scale is None
        self.scale = float(cfg.loss_scale if cfg.loss_scale is not None else cfg.initial_loss_scale)
        self.min_scale, self.window, self.hysteresis = float(cfg.min_loss_scale), cfg.loss_scale_window, cfg.hysteresis
        self.good_steps = 0
        self.overflows_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self.good_steps += 1
            if self.good_steps == self.window:
                self.good_steps = 0
                self.overflows_left = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows_left": self.overflows_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.overflows_left = state["scale"], state["good_steps"], state["overflows_left"]


class Fp16Optimizer:
    """--fp16 on the CPU backend: the model computes in fp16; AdamW steps fp32 master copies of its
    parameters. The loss is multiplied by the loss scale before backward (`scale_loss`, which the
    executors call); `step` divides the gradients by it into the masters, skips the step when any
    rank saw an inf or NaN (and lowers the scale), else clips over the model-parallel group, steps,
    and copies the masters back into the fp16 parameters."""

    def __init__(self, chunks, model_groups: list[dict], cfg) -> None:
        self.chunks = list(chunks)
        self.clip_grad = cfg.clip_grad
        self.scaler = LossScaler(cfg)
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        groups = []
        for group in model_groups:
            masters = []
            for param in group["params"]:
                master = torch.nn.Parameter(param.detach().float().clone())
                self.pairs.append((param, master))
                masters.append(master)
            groups.append({**group, "params": masters})
        self.master_of = {id(p): m for p, m in self.pairs}
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           eps=cfg.adam_eps)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def step(self) -> tuple[bool, float]:
        inverse = 1.0 / self.scaler.scale
        found_inf = torch.zeros(1)
        for param, master in self.pairs:
            grad = param.grad.float() * inverse if param.grad is not None else torch.zeros_like(master)
            master.grad = grad
            if not torch.isfinite(grad).all():
                found_inf.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)  # every rank skips the same steps
        overflow = bool(found_inf.item())
        self.scaler.update(overflow)
        if overflow:
            return False, float("nan")
        grad_norm = model_parallel_grad_norm(self.chunks, lambda p: self.master_of[id(p)].grad
                                             if id(p) in self.master_of else None)
        if self.clip_grad > 0 and grad_norm > self.clip_grad:
            factor = self.clip_grad / (grad_norm + 1e-6)
            for _, master in self.pairs:
                master.grad.mul_(factor)
        self.optimizer.step()
        with torch.no_grad():
            for param, master in self.pairs:
                param.copy_(master)
        return True, grad_norm

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach().clone() for _, m in self.pairs],
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for (param, master), saved in zip(self.pairs, state["masters"]):
                master.copy_(saved)
                param.copy_(saved)
        self.scaler.load_state_dict(state["scaler"])


class MegatronOptimizer:
    """megatron-core's optimizer (mixed precision, clipping, grad-norm) behind the same interface."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.get_loss_scale())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self) -> tuple[bool, float]:
        update_successful, grad_norm, _ = self.optimizer.step()
        return bool(update_successful), float(grad_norm or 0.0)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def model_parallel_grad_norm(chunks: Sequence[torch.nn.Module],
                             grad_of: Callable[[torch.nn.Parameter], torch.Tensor | None] | None = None) -> float:
    """L2 norm of the full model's gradient, each parameter counted once: parameters that
    tensor parallelism replicates count on TP rank 0 only, the tied output weight on the
    first stage only. `grad_of(param)` supplies the gradient to use (default `param.grad`)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    total = torch.zeros(1, dtype=torch.float64)
    for chunk in chunks:
        module = unwrap_model(chunk)
        for param in chunk.parameters():
            grad = param.grad if grad_of is None else grad_of(param)
            if grad is None:
                continue
            replicated = not getattr(param, "tensor_model_parallel", False)
            if replicated and tp_rank != 0:
                continue
            is_tied_copy = (
                getattr(param, "shared_embedding", False)
                and getattr(module, "post_process", False)
                and not getattr(module, "pre_process", False)
            )
            if is_tied_copy:
                continue
            total += grad.detach().double().pow(2).sum()
    group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total.sqrt())


def enable_deterministic_mode() -> None:
    """--deterministic-mode: only kernels whose result does not depend on thread timing. Set before
    the first CUDA kernel: cuBLAS reads its workspace setting, NCCL its algorithm, when they start."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)


def build_backend(device: str) -> DeviceBackend:
    """The explicit switch between devices (`--device` resolved by resolve_device)."""
    backends: dict[str, Callable[[], DeviceBackend]] = {"cpu": CPUBackend, "cuda": CUDABackend}
    return backends[resolve_device(device)]()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
