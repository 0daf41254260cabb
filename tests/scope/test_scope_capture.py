"""Captures equal the tensors read directly from the model; perturbations change what they
should by the amount they should; PCA and the logit lens agree with NumPy/the final logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.scope.analysis import pca
from megatron.scope.codec import decode_frame, encode_frame, reduce_bins
from megatron.scope.engine import GenerateRequest
from megatron.scope.perturb import Perturbation, PerturbationError
from megatron.scope.runner import causal_mask

ALL = ["qkv", "attention", "fc1", "fc2", "layer"]


def reference_internals(model, tokens: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """Walk the model by hand, module by module, recording what each capture should hold."""
    chunk = model.runner.module
    seq = tokens.shape[1]
    positions = torch.arange(seq).unsqueeze(0)
    mask = causal_mask(seq, torch.device("cpu"))
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ALL}
    with torch.no_grad():
        hidden = chunk.embedding(input_ids=tokens, position_ids=positions)  # [seq, batch, hidden]
        for layer in chunk.decoder.layers:
            normed = layer.input_layernorm(hidden)
            out["qkv"].append(layer.self_attention.linear_qkv(normed)[0])
            attention_out, attention_bias = layer.self_attention(normed, mask)
            residual = hidden + attention_out + (attention_bias if attention_bias is not None else 0)
            mlp_in = layer.pre_mlp_layernorm(residual)
            out["fc1"].append(layer.mlp.linear_fc1(mlp_in)[0])
            mlp_out, mlp_bias = layer.mlp(mlp_in)
            out["fc2"].append(mlp_out + mlp_bias)
            hidden = residual + mlp_out + mlp_bias
            out["layer"].append(hidden)
        # the probabilities: softmax of scaled q.k with the causal mask, for the last layer
    return out


def test_captures_equal_tensors_read_from_the_model(tiny_model):
    tokens = torch.tensor([list(b"The cat sat")])
    result = tiny_model.runner.forward(tokens, capture=ALL)
    expected = reference_internals(tiny_model, tokens)
    for kind in ("qkv", "fc1", "fc2", "layer"):
        got = result.captures[kind]  # [layers, batch, positions, width]
        want = torch.stack(expected[kind]).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"capture {kind}")
    seq = tokens.shape[1]
    logits = tiny_model.runner.module(tokens, torch.arange(seq)[None], causal_mask(seq, torch.device("cpu")))
    torch.testing.assert_close(result.logits, logits.detach())
    attention = result.captures["attention"]  # [layers, batch, heads, query, key]
    assert attention.shape == (3, 1, 4, tokens.shape[1], tokens.shape[1])
    torch.testing.assert_close(attention.sum(-1), torch.ones(attention.shape[:-1]))
    assert torch.all(attention.triu(diagonal=1) == 0), "a query attended to a later token"


def test_attention_probabilities_match_manual_softmax(tiny_model):
    tokens = torch.tensor([list(b"abcdef")])
    result = tiny_model.runner.forward(tokens, capture=["attention", "qkv"])
    qkv = result.captures["qkv"][0, 0]  # layer 0: [positions, 3 * hidden] grouped per head as [q k v]
    heads, head_dim = 4, 8
    grouped = qkv.view(qkv.shape[0], heads, 3 * head_dim)
    q, k = grouped[..., :head_dim], grouped[..., head_dim:2 * head_dim]
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    torch.testing.assert_close(result.captures["attention"][0, 0], scores.softmax(-1), rtol=1e-4, atol=1e-5)


def test_capture_off_registers_no_hooks_and_changes_nothing(tiny_model):
    tokens = torch.tensor([list(b"hello")])
    plain = tiny_model.runner.forward(tokens)
    assert plain.captures == {}
    for module in tiny_model.runner.module.modules():
        assert not module._forward_hooks, f"{type(module).__name__} kept a hook"
    captured = tiny_model.runner.forward(tokens, capture=ALL)
    torch.testing.assert_close(plain.logits, captured.logits, rtol=0, atol=0)


def test_bins_reduce_the_hidden_dimension():
    values = torch.arange(12.0).view(1, 12) - 6  # -6 .. 5
    torch.testing.assert_close(reduce_bins(values, 3, "mean"), torch.tensor([[-4.5, -0.5, 3.5]]))
    torch.testing.assert_close(reduce_bins(values, 3, "max"), torch.tensor([[-3.0, 1.0, 5.0]]))
    torch.testing.assert_close(reduce_bins(values, 3, "absmax"), torch.tensor([[6.0, 2.0, 5.0]]))
    uneven = reduce_bins(torch.arange(10.0).view(1, 10), 4, "max")  # groups of 3,3,2,2
    torch.testing.assert_close(uneven, torch.tensor([[2.0, 5.0, 7.0, 9.0]]))
    assert reduce_bins(values, 0, "mean") is values
    with pytest.raises(ValueError):
        reduce_bins(values, 3, "__import__('os')")


def test_frame_round_trip_keeps_arrays_and_header():
    arrays = {"a": np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4), "ids": np.arange(5, dtype=np.int64)}
    header, back = decode_frame(encode_frame({"type": "step", "step": 7}, arrays))
    assert header["type"] == "step" and header["step"] == 7
    np.testing.assert_allclose(back["a"], arrays["a"], atol=2e-3)
    assert back["a"].dtype == np.float16 and back["ids"].dtype == np.int32
    np.testing.assert_array_equal(back["ids"], arrays["ids"])


def test_pca_matches_numpy_svd():
    rng = np.random.default_rng(0)
    points = rng.normal(size=(40, 16)) @ rng.normal(size=(16, 16))
    result = pca(points, 2)
    centred = points - points.mean(0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    for i in range(2):
        # same component up to sign; projected coordinates agree up to the same sign
        sign = np.sign(result.components[i] @ vt[i])
        np.testing.assert_allclose(result.components[i], sign * vt[i], atol=1e-10)
        np.testing.assert_allclose(result.coords[:, i], sign * centred @ vt[i], atol=1e-9)
    np.testing.assert_allclose(result.explained_variance_ratio, (s**2 / (s**2).sum())[:2])
    assert result.explained_variance_ratio[0] >= result.explained_variance_ratio[1]


def test_generator_pca_covers_every_prompt_token(generator):
    frames = []
    generator.generate(GenerateRequest(prompts=["ab", "xyz"], max_new_tokens=3, capture=["layer"]),
                       lambda kind, payload, drop: frames.append(payload))
    result, labels = generator.pca(2)
    # prompt tokens (2 + 3) plus one new position per prompt for steps 1 and 2
    assert result.coords.shape == (2 + 3 + 2 * 2, 2) and len(labels) == 9
    assert {label["sample"] for label in labels} == {0, 1}


def test_logit_lens_of_last_layer_is_the_model_output(tiny_model):
    tokens = torch.tensor([list(b"lens test")])
    result = tiny_model.runner.forward(tokens, lens_top_k=5)
    assert "layer" not in result.captures  # the lens needed it, the client did not ask for it
    final = torch.softmax(result.logits[..., :257].float(), -1).topk(5, -1)
    torch.testing.assert_close(result.lens_ids[-1, 0], final.indices[0])
    torch.testing.assert_close(result.lens_probs[-1, 0], final.values[0])
    assert result.lens_ids.shape == (3, 1, tokens.shape[1], 5)


# --- perturbations -------------------------------------------------------------------------

def _layers(model, tokens, perturbations):
    return model.runner.forward(tokens, capture=["layer", "fc2"], perturbations=perturbations)


def test_disabled_or_zero_perturbation_gives_identical_logits(tiny_model):
    tokens = torch.tensor([list(b"identical")])
    clean = _layers(tiny_model, tokens, [])
    off = [Perturbation(enabled=False, kind="system", type="gaussian", intensity=5.0),
           Perturbation(kind="storage", type="gaussian", intensity=0.0)]
    torch.testing.assert_close(_layers(tiny_model, tokens, off).logits, clean.logits, rtol=0, atol=0)


def test_system_gaussian_noise_has_the_requested_scale_and_place(tiny_model):
    tokens = torch.tensor([list(b"a longer prompt to get many elements")])
    clean = _layers(tiny_model, tokens, [])
    coef = 0.25
    noisy = _layers(tiny_model, tokens, [Perturbation(kind="system", type="gaussian", intensity=coef,
                                                      layers=[1], tokens=(4, 20), seed=7)])
    torch.testing.assert_close(noisy.captures["layer"][0], clean.captures["layer"][0], rtol=0, atol=0)
    delta = noisy.captures["layer"][1, 0] - clean.captures["layer"][1, 0]  # [positions, hidden]
    assert torch.all(delta[:4] == 0) and torch.all(delta[20:] == 0)
    assert abs(float(delta[4:20].std()) - coef) < 0.05 * coef + 0.02
    assert not torch.equal(noisy.logits, clean.logits)
    again = _layers(tiny_model, tokens, [Perturbation(kind="system", type="gaussian", intensity=coef,
                                                      layers=[1], tokens=(4, 20), seed=7)])
    torch.testing.assert_close(again.logits, noisy.logits, rtol=0, atol=0)  # seeded: reproducible


def test_calculation_uniform_noise_scales_mlp_output_within_bounds(tiny_model):
    tokens = torch.tensor([list(b"multiplicative noise on the mlp output")])
    clean = _layers(tiny_model, tokens, [])
    v = 0.3
    noisy = tiny_model.runner.forward(tokens, capture=["fc1", "fc2"], perturbations=[
        Perturbation(kind="calculation", type="uniform", intensity=v, layers=[0])])
    # The attention output is perturbed too, so compare with fc2 recomputed from the noisy run's fc1.
    fc2 = tiny_model.runner.module.decoder.layers[0].mlp.linear_fc2
    unperturbed = torch.nn.functional.linear(torch.nn.functional.gelu(noisy.captures["fc1"][0]), fc2.weight)
    ratio = noisy.captures["fc2"][0] / unperturbed
    assert not torch.allclose(noisy.captures["fc2"][0], clean.captures["fc2"][0])
    assert float(ratio.min()) >= 1 - v - 1e-4 and float(ratio.max()) <= 1 + v + 1e-4
    assert abs(float(ratio.std()) - v / 3**0.5) < 0.02  # U(1-v, 1+v) has std v / sqrt(3)


def test_system_offset_and_bitflip(tiny_model):
    tokens = torch.tensor([list(b"offset")])
    clean = _layers(tiny_model, tokens, [])
    shifted = _layers(tiny_model, tokens, [Perturbation(kind="system", type="offset", intensity=0.5, layers=[2])])
    torch.testing.assert_close(shifted.captures["layer"][2], clean.captures["layer"][2] + 0.5)
    flipped = _layers(tiny_model, tokens, [Perturbation(kind="system", type="bitflip", intensity=1.0, layers=[2])])
    ratio = (flipped.captures["layer"][2] / clean.captures["layer"][2]).abs()
    # one mantissa bit per element: the magnitude changes by less than a factor of two
    assert torch.all(flipped.captures["layer"][2] != clean.captures["layer"][2])
    assert float(ratio.min()) > 0.5 and float(ratio.max()) < 2.0


def test_storage_noise_is_put_back_after_the_forward(tiny_model):
    before = {n: p.detach().clone() for n, p in tiny_model.runner.module.named_parameters()}
    tokens = torch.tensor([list(b"weights")])
    clean = _layers(tiny_model, tokens, [])
    noisy = _layers(tiny_model, tokens, [Perturbation(kind="storage", type="gaussian", intensity=0.05, layers=[1])])
    torch.testing.assert_close(noisy.captures["layer"][0], clean.captures["layer"][0], rtol=0, atol=0)
    assert not torch.allclose(noisy.captures["layer"][1], clean.captures["layer"][1])
    for name, param in tiny_model.runner.module.named_parameters():
        assert torch.equal(param, before[name]), f"{name} was not restored"


def test_gradients_flow_through_perturbations(tiny_model):
    tokens = torch.tensor([list(b"grad")])
    perturbations = [Perturbation(kind="calculation", type="gaussian", intensity=0.1),
                     Perturbation(kind="system", type="bitflip", intensity=0.5, layers=[0])]
    result = tiny_model.runner.forward(tokens, perturbations=perturbations, grad=True)
    result.logits.float().pow(2).mean().backward()
    weight = tiny_model.runner.module.decoder.layers[0].self_attention.linear_qkv.weight
    assert weight.grad is not None and float(weight.grad.abs().sum()) > 0
    tiny_model.runner.module.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad, message", [
    ({"kind": "cosmic"}, "kind"), ({"type": "eval"}, "type"), ({"intensity": "1+1"}, "intensity"),
    ({"layers": [99]}, "layers"), ({"tokens": [5, 2]}, "tokens"), ({"type": "bitflip", "intensity": 2}, "bitflip"),
    ({"what": 1}, "unknown"),
])
def test_bad_perturbation_specs_are_rejected_with_the_field_named(bad, message):
    with pytest.raises(PerturbationError, match=message):
        Perturbation.from_message(bad, num_layers=3, num_heads=4)
