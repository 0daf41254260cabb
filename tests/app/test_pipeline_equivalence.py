"""Pipelined loss and per-parameter gradients equal an unpipelined single-rank reference."""
from __future__ import annotations

import pytest
import torch

from launch import ROOT, python, torchrun

WORKER = ROOT / "tests" / "app" / "workers" / "pipeline_grads.py"


def _run(tmp_path, nproc: int, args: list[str]) -> list[dict]:
    out = tmp_path / f"run{nproc}_{'_'.join(args).replace('-', '')}"
    out.mkdir()
    if nproc == 1:
        proc = python([str(WORKER), *args, "--out", str(out)])
    else:
        proc = torchrun(WORKER, [*args, "--out", str(out)], nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def _assemble(ranks: list[dict]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Full gradients by global name: TP shards concatenated along their partition dim."""
    losses: list[float] = []
    shards: dict[str, dict[int, tuple[torch.Tensor, int | None]]] = {}
    for rank in ranks:
        if rank["tp_rank"] == 0:
            losses.extend(rank["losses"])
        if rank["dp_rank"] != 0:
            continue
        for name, (grad, dim) in rank["grads"].items():
            shards.setdefault(name, {})[rank["tp_rank"]] = (grad, dim)
    full = {}
    swiglu = ranks[0].get("swiglu", False)
    for name, by_tp in shards.items():
        ordered = [by_tp[k] for k in sorted(by_tp)]
        dim = ordered[0][1]
        if swiglu and dim == 0 and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            # each TP rank holds [its gate rows; its up rows]; the full tensor is [gate; up]
            halves = [g.chunk(2, dim=0) for g, _ in ordered]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            continue
        full[name] = ordered[0][0] if dim is None else torch.cat([g for g, _ in ordered], dim=dim)
        if dim is None:
            for other, _ in ordered[1:]:
                torch.testing.assert_close(other, ordered[0][0], msg=f"{name}: TP replicas disagree")
    return losses, full


CASES = [
    # (nproc, args)                                       what it covers
    (2, ["--pp", "2"]),                                   # 1F1B, tied embedding across stages
    (4, ["--pp", "4"]),                                   # 1F1B, 4 stages
    (4, ["--tp", "2", "--pp", "2"]),                      # TP + PP
    (2, ["--pp", "2", "--vpp-layers", "1"]),              # interleaved, 2 chunks per rank
    (4, ["--pp", "4", "--vpp-layers", "1", "--layers", "8"]),  # interleaved PP=4
    (4, ["--pp", "2", "--untie"]),                        # PP + DP=2, untied output layer
    (4, ["--pp", "2", "--per-token"]),                    # --calculate-per-token-loss over PP + DP=2
    (4, ["--tp", "2", "--pp", "2", "--swiglu"]),          # Llama-style (SwiGLU, RMSNorm, RoPE, GQA, 1p norms)
    (2, ["--pp", "2", "--split", "1,3"]),                 # --pipeline-layer-split: uneven stages
    (2, ["--pp", "2", "--vpp-layers", "2", "--layers", "8", "--split", "2,6"]),  # uneven stages, 2 chunks each
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Unpipelined single-rank results, computed once per model variant."""
    cache: dict[tuple, tuple] = {}

    def get(reference_args: list[str]):
        key = tuple(reference_args)
        if key not in cache:
            cache[key] = _assemble(_run(tmp_path_factory.mktemp("reference"), 1, reference_args))
        return cache[key]

    return get


@pytest.mark.parametrize("nproc,args", CASES, ids=[" ".join(a) for _, a in CASES])
def test_pipelined_equals_unpipelined(tmp_path, reference, nproc, args):
    layers = args[args.index("--layers") + 1] if "--layers" in args else "4"
    reference_args = ["--layers", layers, "--microbatches", "4"] + [
        flag for flag in ("--untie", "--per-token", "--swiglu") if flag in args]
    ref_losses, ref_grads = reference(reference_args)
    extra = [] if "--layers" in args else ["--layers", layers]
    losses, grads = _assemble(_run(tmp_path, nproc, [*args, *extra, "--microbatches", "4"]))

    assert len(losses) == 4
    torch.testing.assert_close(sorted(losses), sorted(ref_losses), rtol=1e-5, atol=1e-6)
    expected = {k.replace("@output", ""): v for k, v in ref_grads.items()}
    assert {k.replace("@output", "") for k in grads} == set(expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name.replace("@output", "")], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


MCORE_CASES = [
    (2, ["--pp", "2"]),                                   # 1F1B, tied embedding across stages
    (4, ["--pp", "4"]),                                   # 1F1B, 4 stages
    (2, ["--pp", "2", "--vpp-layers", "1"]),              # interleaved, 2 chunks per rank (unbatched P2P)
    (4, ["--tp", "2", "--pp", "2"]),                      # TP + PP
    (2, ["--pp", "2", "--split", "3,1"]),                 # uneven stages
]


@pytest.mark.parametrize("nproc,args", MCORE_CASES, ids=[" ".join(a) for _, a in MCORE_CASES])
def test_megatron_core_schedule_equals_ours_on_cpu(tmp_path, nproc, args):
    """megatron-core's get_forward_backward_func() and this project's executor, run one after the
    other on the same model and microbatches over gloo, give identical losses, token counts and
    every parameter gradient, bit for bit (they accumulate each gradient in the same order)."""
    ranks = _run(tmp_path, nproc, [*args, "--microbatches", "4", "--schedule", "both"])
    last_stage_losses = 0
    for rank in ranks:
        ours, theirs = rank["ours"], rank["megatron-core"]
        assert theirs["losses"] == ours["losses"], f"pp rank {rank['pp_rank']}"
        assert theirs["num_tokens"] == ours["num_tokens"]
        last_stage_losses += len(ours["losses"])
        assert set(theirs["grads"]) == set(ours["grads"])
        for name, (grad, _) in ours["grads"].items():
            other = theirs["grads"][name][0]
            assert torch.equal(other, grad), (
                f"pp rank {rank['pp_rank']} tp rank {rank['tp_rank']} {name}: "
                f"max difference {(other - grad).abs().max().item():.3e}")
    tp = int(args[args.index("--tp") + 1]) if "--tp" in args else 1
    assert last_stage_losses == 4 * tp  # every microbatch's loss, on each TP rank of the last stage


def test_per_token_loss_weighs_tokens_not_microbatches(tmp_path, reference):
    """With uneven loss masks the per-token gradient is not the mean of per-microbatch means."""
    _, per_token = reference(["--layers", "4", "--microbatches", "4", "--per-token"])
    _, per_microbatch = reference(["--layers", "4", "--microbatches", "4"])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    difference = (per_token[name] - per_microbatch[name]).abs().max().item()
    assert difference > 1e-4 * per_microbatch[name].abs().max().item(), difference

