"""Split backward (megatron/app/weight_grad.py) for zero-bubble schedules, on megatron-core's real
GPTModel on one gloo rank: the backward of each microbatch split into I (under `deferring(work)`) and
W (`work.run()`), with every microbatch's I before any W, gives parameter gradients and stage-input
gradients bit-identical to the unsplit backward, with and without activation recomputation (full,
selective), untied and tied embeddings; no part of the backward runs twice (FLOPs); the parameters'
grad-accumulator hooks, and megatron-core's DistributedDataParallel built on them (with and without
overlapped grad reduce, with gradient-accumulation fusion through a stand-in for the CUDA extension),
see the deferred gradients during W; the sequence-parallel and TP-dgrad all-reduce paths match
megatron-core's on one rank, and split equals unsplit on two TP ranks; frozen weights, the tied output layer and megatron-core's own
embedding-wgrad deferral stay undeferred; running a work twice raises."""
from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from launch import ROOT, torchrun

SEQ, MBS, HIDDEN, VOCAB, MICROBATCHES = 16, 2, 64, 100, 3
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
# (untie_embeddings_and_output_weights, pre_process): the stage-input cases build the chunk without
# the embedding and feed the decoder through set_input_tensor, as the executor does on later stages.
MODELS = {
    "untied-stage-input": (True, False),
    "untied-whole": (True, True),
    "tied-whole": (False, True),  # PP=1 with tied embeddings: the output layer stays undeferred
    "tied-last-stage": (False, False),  # the output layer owns its copy of the embedding: deferred
}


@pytest.fixture(scope="module")
def one_rank():
    """One gloo rank with megatron-core's process groups and the CPU stand-ins, as the trainer sets them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.app.device import build_backend

    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT")}
    backend = build_backend("cpu")
    backend.init_distributed(timeout_s=120)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    backend.init_model_parallel(1, 1, None, seed=3)
    yield backend
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    for key, value in saved.items():  # later tests' subprocesses must not inherit this rank's port
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _build(backend, model: str, recompute: str = "none", layers: int = 2):
    from megatron.core.models.gpt import GPTModel

    from megatron.app.config import ModelConfig, ParallelConfig
    from megatron.app.model import gpt_model_kwargs, init_parallel_invariant, layer_spec, transformer_config

    untie, pre_process = MODELS[model]
    cfg = ModelConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                      max_position_embeddings=SEQ, vocab_size=VOCAB, untie_embeddings_and_output_weights=untie,
                      **RECOMPUTE[recompute])
    config = transformer_config(cfg, ParallelConfig(), 1)
    with backend.model_construction():
        chunk = GPTModel(config=config, transformer_layer_spec=layer_spec(cfg, config), pre_process=pre_process,
                         post_process=True, **gpt_model_kwargs(cfg))
    init_parallel_invariant(chunk, 7, cfg)
    return chunk


def _microbatch(index: int) -> dict:
    generator = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
    loss_mask = torch.ones(MBS, SEQ)
    loss_mask[:, : index % 3] = 0.0
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).expand(MBS, SEQ).contiguous(),
            "attention_mask": torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None],
            "stage_input": torch.randn(SEQ, MBS, HIDDEN, generator=generator)}


def _gpt(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _forward(chunk, index: int):
    """One microbatch's forward: (loss, stage input or None)."""
    batch = _microbatch(index)
    received = None
    if not _gpt(chunk).pre_process:
        received = batch["stage_input"].clone().requires_grad_(True)
        _gpt(chunk).set_input_tensor(received)
    per_token = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return (per_token.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum(), received


def _iteration(chunk, split: bool, *, after_i=None, sync=None):
    """Every microbatch's forward, then every backward (split: every I, then every W, in microbatch
    order). `after_i(works)` runs between the I's and the W's; `sync(i, last)` gives a context per
    backward part (DDP's no_sync). Returns the stage-input gradients."""
    from megatron.app.weight_grad import WeightGradWork, deferring

    sync = sync or (lambda index, last: contextlib.nullcontext())
    works = [WeightGradWork(index) for index in range(MICROBATCHES)]
    scope = (lambda index: deferring(works[index])) if split else (lambda index: contextlib.nullcontext())
    forwards = []
    for index in range(MICROBATCHES):
        with scope(index):
            forwards.append(_forward(chunk, index))
    for index, (loss, _) in enumerate(forwards):
        with sync(index, index == MICROBATCHES - 1), scope(index):
            torch.autograd.backward(loss)
    if split:
        if after_i is not None:
            after_i(works)
        for index, work in enumerate(works):
            with sync(index, index == MICROBATCHES - 1):
                work.run()
    return [received.grad for _, received in forwards if received is not None]


def _grads(chunk) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in chunk.named_parameters()}


def _zero(chunk) -> None:
    for param in chunk.parameters():
        param.grad = None


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [name for name in a if (a[name] is None) != (b[name] is None)
              or (a[name] is not None and not torch.equal(a[name], b[name]))]
    assert not differ, f"not bit-identical: {differ}"


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("model", list(MODELS))
def test_split_backward_is_bit_identical_to_the_unsplit_one(one_rank, model, recompute):
    from megatron.app.weight_grad import install

    chunk = _build(one_rank, model, recompute)
    deferred = install([chunk])
    if model == "tied-whole":
        assert deferred.pop("0.output_layer") is False  # its weight is the word embedding's
    assert deferred and all(deferred.values()), deferred

    reference_inputs = _iteration(chunk, split=False)
    reference = {name: grad.clone() for name, grad in _grads(chunk).items()}
    _zero(chunk)
    seen = {}

    def after_i(works):
        seen["pending"] = [len(work) for work in works]
        seen["nbytes"] = [work.nbytes for work in works]
        seen["grads"] = {name: grad is not None for name, grad in _grads(chunk).items()}

    inputs = _iteration(chunk, split=True, after_i=after_i)
    _assert_equal(_grads(chunk), reference)
    assert len(inputs) == len(reference_inputs) == (0 if MODELS[model][1] else MICROBATCHES)
    assert all(torch.equal(a, b) for a, b in zip(inputs, reference_inputs))
    # What W carried: one closure per deferred linear layer per microbatch, their weights' gradients
    # absent after the I's; every other gradient (norms, embedding, row-parallel biases) came in I.
    assert seen["pending"] == [len(deferred)] * MICROBATCHES and min(seen["nbytes"]) > 0
    for name in deferred:
        assert seen["grads"][name.split(".", 1)[1] + ".weight"] is False, name
    assert any(seen["grads"].values())


def test_flops_of_i_and_w_add_up_to_the_unsplit_backward(one_rank):
    """Measured (2 layers, hidden 64, seq 16, micro-batch 2, vocab 100, stage-input chunk):
    B = 14,155,776, I = 7,340,032 (0.52 B), W = 6,815,744 (0.48 B); I + W == B."""
    from megatron.app.weight_grad import WeightGradWork, deferring, install

    chunk = _build(one_rank, "untied-stage-input")
    install([chunk])

    def counted(step) -> int:
        with FlopCounterMode(display=False) as counter:
            step()
        return counter.get_total_flops()

    loss, _ = _forward(chunk, 0)
    unsplit = counted(lambda: torch.autograd.backward(loss))
    work = WeightGradWork()
    with deferring(work):
        loss, _ = _forward(chunk, 0)
    with deferring(work):
        flops_i = counted(lambda: torch.autograd.backward(loss))
    flops_w = counted(work.run)
    assert flops_i + flops_w == unsplit
    assert flops_w > 0.3 * unsplit and flops_i > 0.3 * unsplit, (flops_i, flops_w, unsplit)


def test_grad_accumulator_hooks_see_deferred_gradients_in_w(one_rank):
    """A post-hook on every parameter's grad accumulator that moves .grad into a main_grad buffer (what
    megatron-core's DDP does): the buffers are bit-equal, and each deferred parameter's hook fires only
    during W, every other one only during I."""
    from megatron.app.weight_grad import install

    chunk = _build(one_rank, "untied-whole")
    install([chunk])
    phase, fired, accumulators = ["I"], {}, []
    for name, param in chunk.named_parameters():
        param.main_grad = torch.zeros_like(param)

        def hook(*_, name=name, param=param):
            param.main_grad.add_(param.grad)
            param.grad = None
            fired.setdefault(name, []).append(phase[0])

        accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
        accumulator.register_hook(hook)
        accumulators.append(accumulator)  # an accumulator nobody holds may be rebuilt without the hook

    def buffers():
        return {name: param.main_grad.clone() for name, param in chunk.named_parameters()}

    _iteration(chunk, split=False)
    reference, fired_unsplit = buffers(), dict(fired)
    for param in chunk.parameters():
        param.main_grad.zero_()
    fired.clear()
    _iteration(chunk, split=True, after_i=lambda works: phase.__setitem__(0, "W"))
    _assert_equal(buffers(), reference)
    assert all(param.grad is None for param in chunk.parameters())
    assert {name: len(when) for name, when in fired.items()} == {name: len(when) for name, when in fired_unsplit.items()}
    in_w = {name for name, when in fired.items() if set(when) == {"W"}}
    in_i = {name for name, when in fired.items() if set(when) == {"I"}}
    assert in_w | in_i == set(fired)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in in_w and "output_layer.weight" in in_w
    assert "embedding.word_embeddings.weight" in in_i and "decoder.layers.0.input_layernorm.weight" in in_i


@pytest.fixture
def fused_wgrad_stand_in(monkeypatch):
    """gradient_accumulation_fusion needs APEX's CUDA extension `fused_weight_gradient_mlp_cuda`
    (main_grad += grad_output^T input in one GEMM). A stand-in doing that accumulation with torch ops,
    seen by megatron-core's linear and by weight_grad alike; and torch.cuda.current_device() answering
    the CPU, where megatron-core's backward allocates its dummy weight gradient."""
    from megatron.core.tensor_parallel import layers

    def accumulate(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t().matmul(total_input))

    fake = types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate, wgrad_gemm_accum_fp16=accumulate)
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", fake)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.mark.parametrize("fusion", [False, True], ids=["plain", "grad-accumulation-fusion"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync-reduce", "overlap-grad-reduce"])
@pytest.mark.parametrize("model", ["untied-stage-input", "tied-whole"])
def test_megatron_core_ddp(one_rank, fused_wgrad_stand_in, model, overlap, fusion):
    """megatron-core's DistributedDataParallel (CPU buffers: the CPU backend's stand-ins): two
    iterations of unsplit and split backward give bit-equal main_grad buffers. With overlapped grad
    reduce the non-last microbatches' I's and W's run under no_sync, and the bucket's all-reduce is
    launched by the hook of the last W."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron.app.weight_grad import install

    chunk = _build(one_rank, model)
    for module in chunk.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.gradient_accumulation_fusion = fusion
    ddp = DistributedDataParallel(config=chunk.config, module=chunk, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap))
    install([ddp])

    def sync(index, last):
        return contextlib.nullcontext() if last or not overlap else ddp.no_sync()

    launched = []

    def after_i(works):
        if overlap:  # the deferred gradients are not there yet: nothing may be launched
            launched.append(any(group.grad_reduce_handle is not None for group in ddp.bucket_groups))

    results = {}
    for iteration in range(2):
        for split in (False, True):
            ddp.zero_grad_buffer()
            _iteration(ddp, split, after_i=after_i, sync=sync)
            if overlap and iteration == 1:
                launched.append(all(group.grad_reduce_handle is not None for group in ddp.bucket_groups))
            ddp.finish_grad_sync()
            assert all(param.grad is None for param in chunk.parameters())
            results[(iteration, split)] = [param.main_grad.clone() for param in chunk.parameters()]
            if fusion and split:
                assert chunk.decoder.layers[0].mlp.linear_fc1.weight.grad_added_to_main_grad is True
    for iteration in range(2):
        assert all(torch.equal(a, b) for a, b in zip(results[(iteration, False)], results[(iteration, True)]))
    assert any(grad.abs().sum() > 0 for grad in results[(1, True)])
    if overlap:
        assert launched == [False, True, False, True]


def test_frozen_weight_is_not_deferred(one_rank):
    from megatron.app.weight_grad import install

    chunk = _build(one_rank, "untied-stage-input")
    deferred = install([chunk])
    frozen = chunk.decoder.layers[0].mlp.linear_fc1.weight
    frozen.requires_grad_(False)
    frozen_bias = chunk.decoder.layers[1].self_attention.linear_qkv.bias  # its layer stays deferred
    frozen_bias.requires_grad_(False)
    reference_inputs = _iteration(chunk, split=False)
    reference = {name: grad.clone() for name, grad in _grads(chunk).items() if grad is not None}
    _zero(chunk)
    pending = []
    inputs = _iteration(chunk, split=True, after_i=lambda works: pending.extend(len(work) for work in works))
    assert frozen.grad is None and frozen_bias.grad is None
    assert pending == [len(deferred) - 1] * MICROBATCHES
    _assert_equal({name: grad for name, grad in _grads(chunk).items() if grad is not None}, reference)
    assert all(torch.equal(a, b) for a, b in zip(inputs, reference_inputs))


def test_work_runs_once(one_rank):
    from megatron.app.weight_grad import WeightGradWork, deferring, install

    chunk = _build(one_rank, "untied-stage-input")
    install([chunk])
    work = WeightGradWork("mb0")
    with deferring(work):
        loss, _ = _forward(chunk, 0)
        torch.autograd.backward(loss)
    assert len(work) > 0 and work.nbytes > 0
    work.run()
    assert len(work) == 0 and work.nbytes == 0
    with pytest.raises(RuntimeError, match="run\\(\\) called twice"):
        work.run()
    calls = []
    other = WeightGradWork()
    other.push(lambda: calls.append(1))
    other.push(lambda: calls.append(2))
    other.run()
    assert calls == [1, 2]
    with pytest.raises(RuntimeError, match="after run"):
        other.push(lambda: None)


def test_the_work_is_bound_at_forward_time(one_rank):
    """A backward run outside any `deferring` block still feeds the work its forward was bound to."""
    from megatron.app.weight_grad import WeightGradWork, deferring, install

    chunk = _build(one_rank, "untied-stage-input")
    deferred = install([chunk])
    bound, other = WeightGradWork(), WeightGradWork()
    with deferring(bound):
        loss, _ = _forward(chunk, 0)
    with deferring(other):
        torch.autograd.backward(loss)
    assert len(bound) == len(deferred) and len(other) == 0
    assert chunk.output_layer.weight.grad is None
    bound.run()
    assert chunk.output_layer.weight.grad is not None


def test_without_deferring_megatron_core_runs_unchanged(one_rank):
    """Installed layers outside a `deferring` block compute the weight gradients in the backward;
    megatron-core's own embedding-wgrad deferral (grad_output_buffer) is left to megatron-core."""
    from megatron.app.weight_grad import WeightGradWork, active_work, deferring, install, uninstall

    chunk = _build(one_rank, "untied-stage-input")
    first = install([chunk])
    assert install([chunk]) == first  # idempotent
    assert active_work() is None
    loss, _ = _forward(chunk, 0)
    torch.autograd.backward(loss)
    assert all(param.grad is not None for param in chunk.parameters())

    layer = chunk.output_layer
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    buffer, work = [], WeightGradWork()
    x = torch.randn(SEQ, MBS, HIDDEN, requires_grad=True)
    with deferring(work):
        assert active_work() is work
        out = layer._forward_impl(input=x, weight=layer.weight, bias=None, gradient_accumulation_fusion=True,
                                  allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=buffer,
                                  wgrad_deferral_limit=0, tp_group=None)
        out.sum().backward()
    assert active_work() is None and len(work) == 0 and len(buffer) == 1
    uninstall([chunk])
    assert "_forward_impl" not in vars(layer)


@pytest.mark.parametrize("path", ["sequence-parallel", "allreduce-dgrad"])
def test_tensor_parallel_paths_match_megatron_core(one_rank, fused_wgrad_stand_in, path):
    """The all-gather / reduce-scatter (sequence parallel) and the dgrad all-reduce, over the TP group
    of this one rank: output, input and weight gradients bit-equal to megatron-core's (the plumbing;
    test_two_tensor_parallel_ranks runs real ranks)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron.app.weight_grad import WeightGradWork, deferring, install

    config = _build(one_rank, "untied-stage-input").config
    layer = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, config=config, init_method=torch.nn.init.normal_, bias=True,
                                 gather_output=False)
    if path == "sequence-parallel":
        layer.sequence_parallel = True
    else:
        layer.allreduce_dgrad = True
    install([layer])
    x = torch.randn(SEQ, MBS, HIDDEN)
    grad = torch.randn(SEQ, MBS, 3 * HIDDEN)
    results = []
    for split in (False, True):
        layer.weight.grad = layer.bias.grad = None
        work = WeightGradWork()
        stage_input = x.clone().requires_grad_(True)
        with deferring(work) if split else contextlib.nullcontext():
            out, _ = layer(stage_input)
            out.backward(grad)
        assert len(work) == int(split) and (layer.weight.grad is None) == split
        work.run()
        results.append((out.detach(), stage_input.grad, layer.weight.grad, layer.bias.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_two_tensor_parallel_ranks():
    """TP=2 over gloo (dgrad all-reduce; with full recomputation; with sequence parallelism, whose
    megatron-core mappings the worker lets allocate on the CPU): split equals unsplit on each rank."""
    done = torchrun(ROOT / "tests" / "app" / "workers" / "weight_grad_worker.py", ["--tp", "2"], nproc=2, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for case in ("tp", "tp-recompute", "sp"):
        for rank in (0, 1):
            assert f"case {case} rank {rank}: bit-identical" in done.stdout, done.stdout[-3000:]
