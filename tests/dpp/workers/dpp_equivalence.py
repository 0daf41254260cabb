"""Worker: in one 4-rank process group, for several parallel layouts, runs one iteration with the
static schedule and with each DPP policy, and 20 training iterations of each; checks loss and
per-parameter gradients equal the static run and writes what it compared to OUT/rank{R}.json."""
import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "app" / "workers"))
from pipeline_grads import synthetic_microbatch  # noqa: E402

from megatron.app.config import ModelConfig, ParallelConfig  # noqa: E402
from megatron.app.device import build_backend  # noqa: E402
from megatron.app.executor import PipelineExecutor, StageContext  # noqa: E402
from megatron.app.model import build_model_chunks  # noqa: E402
from megatron.app.schedule import PipelineLayout, build_schedule  # noqa: E402
from megatron.dpp.order import dpp_executor  # noqa: E402
from megatron.dpp.policy import default_budget  # noqa: E402
from megatron.dpp.transport import TorchP2PTransport, make_shm_transport  # noqa: E402

POLICIES = ("adaptive", "dfc", "bfc", "adaptive+W")  # +W: backwards split into I and W (--dpp-split-backward)
MICROBATCHES, SEQ, MBS, HIDDEN = 8, 16, 2, 64


def build(backend, tp: int, pp: int, layers: int, vpp_layers):
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              num_layers_per_virtual_pipeline_stage=vpp_layers, world_size=dist.get_world_size())
    model = ModelConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                        max_position_embeddings=SEQ, vocab_size=100)
    num_chunks = parallel.virtual_chunks(layers)
    backend.init_model_parallel(tp, pp, num_chunks if num_chunks > 1 else None, seed=7)
    chunks = build_model_chunks(model, parallel, num_chunks, 7, backend.model_construction)
    layout = PipelineLayout(pp_size=pp, num_chunks=num_chunks, num_microbatches=MICROBATCHES)
    stage = StageContext(layout=layout, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                         pp_global_ranks=dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
                         activation_shape=(SEQ, MBS, HIDDEN), dtype=torch.float32, device=torch.device("cpu"))
    tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    return chunks, stage, tp_ranks


def iterate(backend, chunks, executor, stage, iterations: int, lr: float = 0.0):
    """Losses per iteration and the gradients of the first iteration; SGD steps when lr > 0."""
    initial = [p.detach().clone() for c in chunks for p in c.parameters()]
    schedule = build_schedule("interleaved", stage.layout, stage.pp_rank)
    losses, first_grads = [], None
    for iteration in range(iterations):
        backend.zero_grad(chunks)
        result = executor.run(schedule, lambda mb: synthetic_microbatch(iteration * 100 + mb, MBS, SEQ, 100))
        backend.finalize_grads(chunks)
        losses.append(result.losses)
        if first_grads is None:
            first_grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()
                           if p.grad is not None}
        with torch.no_grad():
            for chunk in chunks:
                for param in chunk.parameters():
                    if param.grad is not None:
                        param -= lr * param.grad
    with torch.no_grad():  # every run starts from the same weights
        for param, value in zip([p for c in chunks for p in c.parameters()], initial):
            param.copy_(value)
    return losses, first_grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--curve-iterations", type=int, default=20)
    args = parser.parse_args()
    backend = build_backend("cpu")
    backend.init_distributed(timeout_s=120)
    rank = dist.get_rank()
    shm = make_shm_transport(workload_bytes=256 << 10, multi_node=False, node_ips=(), ranks_per_node=None,
                             job_id="dpp-equivalence")
    layouts = [  # (name, tp, pp, layers, vpp layers, transport)
        ("pp4", 1, 4, 4, None, shm),
        ("pp4-vpp2", 1, 4, 8, 1, shm),
        ("tp2-pp2", 2, 2, 4, None, shm),
        ("tp2-pp2-vpp2-torch", 2, 2, 4, 1, TorchP2PTransport()),
    ]
    compared = []
    for name, tp, pp, layers, vpp, transport in layouts:
        chunks, stage, tp_ranks = build(backend, tp, pp, layers, vpp)
        curve = args.curve_iterations if name == "pp4" else 1
        static_losses, static_grads = iterate(backend, chunks, PipelineExecutor(chunks, stage, shm), stage, curve, 0.05)
        for policy in POLICIES:
            name_of, split = policy.removesuffix("+W"), policy.endswith("+W")
            budget = None if policy != "adaptive" else stage.layout.num_chunks  # tightest budget there is
            run_stage = stage
            if split:  # the default budget, which leaves room for W's to wait
                run_stage = dataclasses.replace(stage, layout=dataclasses.replace(stage.layout, split_backward=True))
                budget = default_budget(name_of, run_stage.layout)
            executor = dpp_executor(chunks, run_stage, transport, policy=name_of, budget=budget, tp_ranks=tp_ranks)
            losses, grads = iterate(backend, chunks, executor, stage, curve, 0.05)
            # Per iteration, microbatch losses in the order the last stage finished them.
            for mine, theirs in zip(losses, static_losses):
                torch.testing.assert_close(sorted(mine), sorted(theirs), rtol=1e-5, atol=1e-6)
            assert grads.keys() == static_grads.keys()
            for key, grad in grads.items():
                torch.testing.assert_close(grad, static_grads[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} {policy} {key}: {m}")
            compared.append({"layout": name, "policy": policy, "iterations": len(losses),
                             "parameters": len(grads), "order": [str(t) for t in executor.last_order],
                             "peak": executor.peak_stored_activations, "budget": budget,
                             "pp_rank": stage.pp_rank, "pp": pp, "chunks": stage.layout.num_chunks, "split": split,
                             "tp_rank": tp_ranks.index(rank),
                             "actions": [[a.op.value, str(a.task) if a.task else None, a.peer, a.tag, a.payload]
                                         for a in executor.last_actions],
                             "losses": [sum(l) / len(l) for l in losses if l]})
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(compared))
    shm.close()
    backend.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
