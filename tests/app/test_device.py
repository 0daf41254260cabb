"""Device backends: the CPU stand-ins still match the megatron-core calls they replace, and
each path can be forced."""
from __future__ import annotations

import inspect

import pytest
import torch

from megatron.app import cpu_stand_ins, device
from launch import torchrun

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "256",
         "--train-iters", "3"]


@pytest.mark.parametrize(
    "owner,needle,stand_in",
    [
        ("megatron.core.utils:GlobalMemoryBuffer.get_tensor", "torch.cuda.current_device()", "cpu_global_memory_buffer"),
        ("megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add", "torch.cuda", "cpu_rng_tracker"),
        ("megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork", "_set_cuda_rng_state", "cpu_rng_tracker"),
        ("megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
         "weight.data.cuda()", "tied_embedding_copy_stays_on_cpu"),
        ("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
         'torch.zeros([], dtype=torch.int, device="cuda")', "_TorchOnCPU.zeros"),
        ("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
         'torch.zeros([], dtype=torch.int, device="cuda")', "_TorchOnCPU.zeros"),
        ("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
         'torch.zeros([], dtype=torch.int, device="cuda")', "_TorchOnCPU.zeros"),
        ("megatron.core.pipeline_parallel.schedules:forward_step", 'torch.autocast("cuda"', "_TorchOnCPU.autocast"),
        ("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
         "device=torch.cuda.current_device()", "_CUDAOnCPU.current_device"),
        ("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate",
         "torch.cuda.synchronize()", "_CUDAOnCPU.synchronize"),
        ("megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb",
         "self.inv_freq.to(device=torch.cuda.current_device())", "CPU_TORCH_MODULES (_CUDAOnCPU.current_device)"),
        ("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__",
         "device=torch.cuda.current_device()", "CPU_TORCH_MODULES (_CUDAOnCPU.current_device)"),
        ("megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes",
         "device=torch.cuda.current_device()", "_CUDAOnCPU.current_device"),
        ("megatron.core.tensor_parallel.random:_get_all_rng_states", "_get_cuda_rng_state(", "cpu_recompute_rng_states"),
        ("megatron.core.tensor_parallel.random:_set_all_rng_states", "_set_cuda_rng_state(", "cpu_recompute_rng_states"),
        ("megatron.core.tensor_parallel.random:CheckpointFunction.forward", "_get_all_rng_states()",
         "cpu_recompute_rng_states"),
        # Why the trainer always passes an explicit causal mask:
        ("megatron.core.transformer.utils:get_default_causal_mask", 'device="cuda"', "TrainingData._prepare"),
    ],
)
def test_megatron_core_still_has_the_cuda_call_each_stand_in_replaces(owner, needle, stand_in):
    import importlib

    module_name, attr_path = owner.split(":")
    target = importlib.import_module(module_name)
    for part in attr_path.split("."):
        target = getattr(target, part)
    source = inspect.getsource(target)
    assert needle in source, (
        f"megatron-core changed {attr_path}: it no longer contains {needle!r}. Re-check the CPU stand-in "
        f"{stand_in} in megatron/app/cpu_stand_ins.py (it may be obsolete or need updating)."
    )


def _cuda_uses(module_name: str) -> tuple[set[str], list[str]]:
    """The `torch.cuda.<name>` attributes a module's source uses, and every call that passes the
    string "cuda" (as `device=` or as the first argument), as `func@line`."""
    import ast
    import importlib

    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    attributes, calls = set(), []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "cuda" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "torch"):
            attributes.add(node.attr)
        if isinstance(node, ast.Call):
            values = [k.value for k in node.keywords if k.arg == "device"] + node.args[:1]
            if any(isinstance(v, ast.Constant) and v.value == "cuda" for v in values):
                calls.append(f"{ast.unparse(node.func)}@{node.lineno}")
    return attributes, calls


@pytest.mark.parametrize("module_name,attributes,calls,unreachable", [
    ("megatron.core.pipeline_parallel.schedules", set(), {"torch.zeros", "torch.autocast"}, set()),
    ("megatron.core.pipeline_parallel.p2p_communication", {"current_device", "synchronize"}, set(), set()),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", {"current_device"}, set(), set()),
    # Streams only with several distributed-optimizer instances, device="cuda" only for NCCL user
    # buffers: on CPU they end in _CUDAOnCPU's error naming the call.
    ("megatron.core.distributed.param_and_grad_buffer", {"current_device"}, set(),
     {"stream", "default_stream", "torch.zeros"}),
])
def test_megatron_core_schedules_make_no_cuda_call_without_a_cpu_stand_in(module_name, attributes, calls,
                                                                          unreachable):
    """Every CUDA-only call in the modules that see `_TorchOnCPU` is one it replaces (or one the
    CPU backend cannot reach); a new one in an upgrade fails here rather than in a CPU run."""
    used, cuda_calls = _cuda_uses(module_name)
    assert used <= attributes | unreachable, f"{module_name} now uses torch.cuda.{sorted(used - attributes)}"
    unknown = [c for c in cuda_calls if c.split("@")[0] not in calls | unreachable]
    assert not unknown, f"{module_name} now calls {unknown} with \"cuda\": add a stand-in to _TorchOnCPU"
    assert module_name in cpu_stand_ins.CPU_TORCH_MODULES
    stand_in = cpu_stand_ins._TorchOnCPU()
    for name in attributes:
        assert callable(getattr(stand_in.cuda, name))
    for name in calls:
        assert getattr(cpu_stand_ins._TorchOnCPU, name.removeprefix("torch.")) is not getattr(torch, name.removeprefix("torch."))


def test_schedule_stand_ins_keep_everything_else_on_the_real_torch():
    stand_in = cpu_stand_ins._TorchOnCPU()
    assert stand_in.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert stand_in.empty((2,), device=stand_in.cuda.current_device()).device.type == "cpu"
    assert stand_in.zeros(2, device="cpu").device.type == "cpu"
    assert stand_in.distributed is torch.distributed and stand_in.Tensor is torch.Tensor
    with pytest.raises(AttributeError, match="torch.cuda.Stream, which has no CPU stand-in"):
        stand_in.cuda.Stream()
    with stand_in.autocast("cuda", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")


def test_cpu_rng_tracker_forks_named_streams_and_restores_the_outer_state():
    from megatron.core.tensor_parallel import random as mc_random

    tracker = cpu_stand_ins.cpu_rng_tracker(seed=5, tp_rank=1)
    assert mc_random.get_cuda_rng_tracker() is tracker
    torch.manual_seed(0)
    outer_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer_before)
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the stream advances between forks
    again = cpu_stand_ins.cpu_rng_tracker(seed=5, tp_rank=1)
    with again.fork():
        assert torch.equal(torch.rand(3), first)  # same seed and tp rank -> same stream
    other_tp = cpu_stand_ins.cpu_rng_tracker(seed=5, tp_rank=0)
    with other_tp.fork():
        assert not torch.equal(torch.rand(3), first)  # TP ranks draw different dropout masks


def test_cpu_memory_buffer_reuses_and_grows():
    buffer = cpu_stand_ins.cpu_global_memory_buffer()
    a = buffer.get_tensor((2, 3), torch.float32, "mpu")
    b = buffer.get_tensor((3, 2), torch.float32, "mpu")
    assert a.device.type == "cpu" and a.data_ptr() == b.data_ptr()
    c = buffer.get_tensor((4, 4), torch.float32, "mpu")
    assert c.shape == (4, 4)


def test_device_switch():
    assert device.resolve_device("cpu") == "cpu"
    assert isinstance(device.build_backend("cpu"), device.CPUBackend)
    with pytest.raises(device.DeviceError, match="not one of auto, cpu, cuda"):
        device.resolve_device("tpu")
    if not torch.cuda.is_available():
        assert device.resolve_device("auto") == "cpu"
        with pytest.raises(device.DeviceError, match="pass --device cpu"):
            device.resolve_device("cuda")


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_forced_cpu_path_trains_with_gloo(precision):
    proc = torchrun("pretrain_gpt.py", [*SMALL, *precision, "--device", "cpu", "--pipeline-model-parallel-size", "2"],
                    nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device cpu" in proc.stdout and " iteration        3/" in proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, megatron-core DDP/optimizer)")
def test_forced_cuda_path_trains_with_nccl():
    proc = torchrun("pretrain_gpt.py", [*SMALL, "--device", "cuda"], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device cuda" in proc.stdout and " iteration        3/" in proc.stdout


def test_more_local_ranks_than_gpus_stops_before_nccl(monkeypatch):
    """The check runs before any CUDA call, so it is exercised here with a pretend GPU count."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(device.DeviceError, match=r"2 ranks on this node but 1 GPU; .* or pass --device cpu"):
        device.CUDABackend()


def test_cuda_zero_grad_counts_each_microbatch_once():
    """megatron-core's optimizer leaves param.grad pointing at the DDP main_grad buffer. Unless
    zero_grad clears it, autograd adds the next iteration's first microbatch into main_grad in
    place and the DDP hook adds it once more: a double-counted microbatch from the second
    iteration of every process on (found on an H100; CPU runs never take this path)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2, bias=False)
    weight = layer.weight
    weight.main_grad = torch.zeros_like(weight)

    def ddp_post_accumulate_hook(*_):  # what megatron-core's DDP does once autograd has a gradient
        if weight.grad is not None:
            weight.main_grad.add_(weight.grad.data)
        weight.grad = None

    accumulator = weight.expand_as(weight).grad_fn.next_functions[0][0]
    accumulator.register_hook(ddp_post_accumulate_hook)
    layer.zero_grad_buffer = lambda: weight.main_grad.zero_()
    backend = object.__new__(device.CUDABackend)  # zero_grad needs no GPU
    microbatches = [torch.randn(4, 3), torch.randn(4, 3)]
    expected = sum(x.sum(0) for x in microbatches).expand(2, 3)  # d(sum W x)/dW, summed over microbatches
    for iteration in range(3):
        backend.zero_grad([layer])
        for x in microbatches:
            layer(x).sum().backward()
        torch.testing.assert_close(weight.main_grad, expected, msg=f"iteration {iteration + 1}")
        weight.grad = weight.main_grad  # the optimizer's step (megatron-core prepare_grads)
