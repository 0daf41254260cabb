"""Device backends: the one place where CPU (gloo) and CUDA (NCCL) training differ.

`cuda` uses NCCL, megatron-core's DistributedDataParallel and optimizer, CUDA events.
`cpu` uses gloo, a plain gradient all-reduce over the data-parallel group, `torch.optim`,
host clocks, and the stand-ins of `megatron.app.cpu_stand_ins`.
"""
from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.app.cpu_stand_ins import (
    cpu_global_memory_buffer as _cpu_global_memory_buffer,
    cpu_recompute_rng_states as _cpu_recompute_rng_states,
    cpu_rng_tracker as _cpu_rng_tracker,
    tied_embedding_copy_stays_on_cpu as _tied_embedding_copy_stays_on_cpu,
    use_megatron_core_schedules_on_cpu,
)
from megatron.app.model import unwrap_model
from megatron.app.optimizers import Fp16Optimizer, MegatronOptimizer, TorchOptimizer, parameter_groups


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


def attempt_store(rank: int, world_size: int, timeout: timedelta):
    """A store of this attempt's own for the process groups under torchrun, or None (env:// then).

    torchrun's agent keeps one store for the whole job and hands its workers its address; every
    process group publishes its ranks' addresses there under the same keys in every attempt. After a
    `--max-restarts` restart those keys still hold the dead attempt's addresses, and a restarted rank
    that reads one before its peer rewrote it connects to a dead worker's port (`Gloo
    connectFullMesh failed ... Connection refused`) or waits on it. Nothing the workers are given
    tells the attempts apart reliably (TORCHELASTIC_RESTART_COUNT differs between nodes: a node
    restarted because another failed does not count it), so rank 0 starts a store of its own and
    publishes its address with a fresh nonce in the agent's; the other ranks take the published
    address once a store answering with that nonce is there (an address left by a dead attempt
    refuses the connection or answers another nonce, and they read again)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        own.set(_NONCE_KEY, nonce)
        agent.set(_ATTEMPT_STORE_KEY, f"{own.port}:{nonce}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        published = agent.get(_ATTEMPT_STORE_KEY).decode()  # waits until an attempt published one
        own_port, nonce = published.split(":")
        try:
            store = dist.TCPStore(host, int(own_port), world_size, is_master=False, timeout=timedelta(seconds=5))
            if store.get(_NONCE_KEY).decode() == nonce:
                store.set_timeout(timeout)
                return store
        except (RuntimeError, dist.DistStoreError):  # a dead attempt's store: read the key again
            pass
        if time.monotonic() > deadline:
            raise DeviceError(f"rank {rank}: rank 0 of this torchrun attempt published no reachable store in "
                              f"{timeout.total_seconds():g} s (last address {host}:{own_port})")
        time.sleep(0.2)


_ATTEMPT_STORE_KEY = "megatron-app/attempt-store"
_NONCE_KEY = "megatron-app/attempt-nonce"


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
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=self.dist_backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            store=attempt_store(rank, world_size, timeout),
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
