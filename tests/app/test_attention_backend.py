"""--attention-backend: the SDPA core attention (megatron/app/attention.py) computes what megatron-core's
DotProductAttention computes (outputs and gradients, fp32, no dropout) for multi-head and grouped-query
attention, with and without an explicit mask; trainer runs with `flash` follow the default (local)
run's loss curve, with the plain causal mask and with --reset-attention-mask; what it cannot do is
refused with the reason; and the flag picks the module as documented."""
from __future__ import annotations

import pytest
import torch

from launch import torchrun
from logparse import losses

SEQ, BATCH, HEAD_DIM = 16, 3, 8


@pytest.fixture(scope="module")
def one_rank():
    """One gloo rank with megatron-core's process groups and the CPU stand-ins, as the trainer sets them."""
    from megatron.core import parallel_state

    import os

    import torch.distributed as dist

    from megatron.app.device import build_backend

    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT")}
    backend = build_backend("cpu")
    backend.init_distributed(timeout_s=120)  # sets MASTER_ADDR/PORT in this process: undone below
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    backend.init_model_parallel(1, 1, None, seed=3)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    for key, value in saved.items():  # later tests' subprocesses must not inherit this rank's port
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _config(heads: int, groups: int, **extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                             num_query_groups=groups, attention_dropout=0.0, use_cpu_initialization=True,
                             masked_softmax_fusion=False, bias_dropout_fusion=False, **extra)


def _both(config, layer_number: int = 1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.app.attention import SDPAttention

    kwargs = dict(config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
                  attention_type="self", softmax_scale=config.softmax_scale)
    return DotProductAttention(**kwargs), SDPAttention(**kwargs, plain_causal_mask=True)


def _inputs(heads: int, groups: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=generator)
    k = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=generator)
    v = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=generator)
    return q, k, v


def _document_mask() -> torch.Tensor:
    """Causal within documents that end at different tokens per sample (--reset-attention-mask's)."""
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).repeat(BATCH, 1, 1, 1)
    for sample, end in enumerate((5, 9, 12)):
        mask[sample, 0, end:, :end] = True
    return mask


def _run(module, q, k, v, mask):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


CAUSAL = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["causal", "none", "documents"])
def test_sdpa_equals_dot_product_attention(one_rank, heads, groups, mask):
    reference, sdpa = _both(_config(heads, groups))
    attention_mask = {"causal": CAUSAL, "none": None, "documents": _document_mask()}[mask]
    # Given no mask, DotProductAttention builds the causal one (on CUDA: so it is given it here).
    expected = _run(reference, *_inputs(heads, groups), CAUSAL if attention_mask is None else attention_mask)
    got = _run(sdpa, *_inputs(heads, groups), attention_mask)
    assert got[0].shape == (SEQ, BATCH, heads * HEAD_DIM)
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    if mask == "documents":  # the per-document mask really is used: it differs from the causal result
        causal = _run(sdpa, *_inputs(heads, groups), CAUSAL)[0]
        assert not torch.allclose(causal, got[0], atol=1e-3)


def test_scale_and_query_key_layer_scaling_follow_megatron_core(one_rank):
    """config.softmax_scale, and apply_query_key_layer_scaling (a net factor of 1 in megatron-core)."""
    for extra, layer in (({"softmax_scale": 0.05}, 1), ({"apply_query_key_layer_scaling": True}, 2)):
        reference, sdpa = _both(_config(4, 2, **extra), layer_number=layer)
        expected = _run(reference, *_inputs(4, 2, seed=1), CAUSAL)
        got = _run(sdpa, *_inputs(4, 2, seed=1), CAUSAL)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_non_causal_mask_is_not_mistaken_for_the_causal_one(one_rank):
    """plain_causal_mask: the shared [1, 1, s, s] mask is checked once; any other mask is then read."""
    reference, sdpa = _both(_config(4, 4))
    band = CAUSAL | torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool), -4)[None, None]  # a local window
    expected = _run(reference, *_inputs(4, 4), band)
    got = _run(sdpa, *_inputs(4, 4), band)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert sdpa.plain_causal_mask is False


def test_what_sdpa_cannot_do_is_refused(one_rank):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.app.attention import AttentionBackendError

    _, sdpa = _both(_config(4, 4))
    q, k, v = _inputs(4, 4)
    with pytest.raises(AttentionBackendError, match="packed sequences"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(AttentionBackendError, match="attention_bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(AttentionBackendError, match="as many queries as keys"):
        sdpa(q[:4], k, v, None)
    with pytest.raises(AttentionBackendError, match="sliding-window"):
        _both(_config(4, 4, window_size=(4, 0)))


def test_the_flag_picks_the_module():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.app.arguments import build_parser, config_from_args
    from megatron.app.attention import SDPAttention
    from megatron.app.model import layer_spec

    def model(*flags):
        return config_from_args(build_parser([]).parse_args(["--mock-data", *flags]), world_size=1).model

    def core_attention(cfg):
        spec = layer_spec(cfg).submodules.self_attention.submodules.core_attention
        return getattr(spec, "module", spec), getattr(spec, "params", {})

    assert core_attention(model("--device", "cpu")) == (DotProductAttention, {})  # auto on CPU: today's
    for backend in ("local", "unfused"):
        assert core_attention(model("--device", "cpu", "--attention-backend", backend))[0] is DotProductAttention
    for backend in ("flash", "fused"):
        assert core_attention(model("--device", "cpu", "--attention-backend", backend)) == (
            SDPAttention, {"plain_causal_mask": True})
    assert core_attention(model("--device", "cpu", "--attention-backend", "flash", "--reset-attention-mask")) == (
        SDPAttention, {"plain_causal_mask": False})
    cuda = model("--device", "cuda")  # only parsed: nothing runs on a GPU here
    assert cuda.cuda and cuda.sdpa_attention and core_attention(cuda)[0] is SDPAttention
    assert core_attention(model("--device", "cuda", "--attention-backend", "local"))[0] is DotProductAttention
    assert model("--device", "cpu", "--no-bias-gelu-fusion").sdpa_attention is False  # accepted, not used


RUN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
       "--vocab-size", "128", "--train-iters", "4", "--lr", "1e-3", "--log-interval", "1", "--device", "cpu"]


def _curve(flags: list[str], nproc: int = 1) -> dict[int, float]:
    proc = torchrun("pretrain_gpt.py", [*RUN, *flags], nproc=nproc, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    curve = {i: float(v) for i, v in losses(proc.stdout).items()}
    assert sorted(curve) == [1, 2, 3, 4]
    return curve


@pytest.mark.parametrize("variant", [
    [],
    ["--reset-attention-mask", "--reset-position-ids"],
    ["--group-query-attention", "--num-query-groups", "2", "--attention-dropout", "0.1",
     "--tensor-model-parallel-size", "2"],
], ids=["causal", "reset-attention-mask", "gqa-dropout-tp2"])
def test_flash_backend_follows_the_default_run(variant):
    nproc = 2 if "--tensor-model-parallel-size" in variant else 1
    default = _curve(variant, nproc)
    flash = _curve([*variant, "--attention-backend", "flash"], nproc)
    # Same arithmetic up to rounding; dropout draws from the same stream in the same shape, so
    # it masks the same attention weights.
    assert flash == pytest.approx(default, rel=1e-4), (default, flash)


def test_a_bad_backend_is_refused_before_any_work():
    proc = torchrun("pretrain_gpt.py", [*RUN, "--attention-backend", "triton"], nproc=1, timeout=120)
    assert proc.returncode != 0
    assert "--attention-backend: invalid choice: 'triton'" in proc.stderr
    assert "iteration" not in proc.stdout
