"""Worker: in one 4-rank process group, for several parallel layouts, runs one training iteration
from the same weights with unsplit 1F1B (the reference), the split 1F1B (each B as I then W at
once) and the zero-bubble orders, and checks that losses, token counts and every parameter
gradient (after the data-parallel and tied-embedding reductions) are bit-for-bit the reference's.
Writes what it compared, with each run's executed actions, to OUT/rank{R}.json."""
import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_grads import synthetic_microbatch  # noqa: E402

from megatron.app.config import ModelConfig, ParallelConfig  # noqa: E402
from megatron.app.device import build_backend  # noqa: E402
from megatron.app.executor import PipelineExecutor, StageContext  # noqa: E402
from megatron.app.model import build_model_chunks  # noqa: E402
from megatron.app.schedule import PipelineLayout, build_schedule  # noqa: E402

SEQ, MBS, HIDDEN, GLOBAL_MICROBATCHES = 16, 2, 64, 8
LAYOUTS = {  # name -> (tp, pp, layers, vpp layers, recompute)
    "pp4": (1, 4, 4, None, None),
    "pp2-dp2": (1, 2, 4, None, None),
    "tp2-pp2": (2, 2, 4, None, None),
    "tp2-pp2-recompute": (2, 2, 4, None, "full"),
    "pp2-dp2-selective": (1, 2, 4, None, "selective"),
    "pp2-dp2-vpp2": (1, 2, 4, 1, None),
    "pp4-vpp2": (1, 4, 8, 1, None),
}


def build(backend, tp, pp, layers, vpp_layers, recompute):
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              num_layers_per_virtual_pipeline_stage=vpp_layers, world_size=dist.get_world_size())
    extra = {}
    if recompute == "full":
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        extra = dict(recompute_granularity="selective")
    model = ModelConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                        max_position_embeddings=SEQ, vocab_size=100, **extra)
    num_chunks = parallel.virtual_chunks(layers)
    backend.init_model_parallel(tp, pp, num_chunks if num_chunks > 1 else None, seed=7)
    chunks = build_model_chunks(model, parallel, num_chunks, 7, backend.model_construction)
    dp = parallel.data_parallel_size
    layout = PipelineLayout(pp_size=pp, num_chunks=num_chunks, num_microbatches=GLOBAL_MICROBATCHES // dp)
    stage = StageContext(layout=layout, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                         pp_global_ranks=dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group()),
                         activation_shape=(SEQ, MBS, HIDDEN), dtype=torch.float32, device=torch.device("cpu"))
    return chunks, stage, parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()


def one_iteration(backend, chunks, stage, schedule: str, split: bool, dp_rank: int):
    layout = dataclasses.replace(stage.layout, split_backward=split)
    stage = dataclasses.replace(stage, layout=layout)
    executor = PipelineExecutor(chunks, stage, measure_memory=True)
    backend.zero_grad(chunks)
    per_dp = layout.num_microbatches
    order = build_schedule(schedule, layout, stage.pp_rank)
    result = executor.run(order, lambda mb: synthetic_microbatch(dp_rank * per_dp + mb, MBS, SEQ, 100))
    backend.finalize_grads(chunks)
    grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()
             if p.grad is not None}
    return result, grads, executor, order


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = parser.parse_args()
    backend = build_backend("cpu")
    backend.init_distributed(timeout_s=120)
    rank = dist.get_rank()
    compared = []
    for name in args.layouts:
        chunks, stage, dp_rank, tp_rank = build(backend, *LAYOUTS[name])
        static = "interleaved" if stage.layout.num_chunks > 1 else "1f1b"
        runs = [(static, False), (static, True), ("zb-h1", True), ("zb-h2", True)]
        reference = None
        for schedule, split in runs:
            result, grads, executor, order = one_iteration(backend, chunks, stage, schedule, split, dp_rank)
            label = f"{schedule}{'-split' if split and not schedule.startswith('zb') else ''}"
            if reference is None:
                reference = (result, grads)
            else:
                ref_result, ref_grads = reference
                assert result.losses == ref_result.losses, f"{name} {label}: losses {result.losses} != {ref_result.losses}"
                assert result.num_tokens == ref_result.num_tokens
                assert grads.keys() == ref_grads.keys(), f"{name} {label}: parameters with gradients differ"
                for key, grad in grads.items():
                    other = ref_grads[key]
                    assert torch.equal(grad, other), (
                        f"{name} {label} rank {rank} {key}: max difference {(grad - other).abs().max().item():.3e}")
            compared.append({
                "layout": name, "schedule": label, "pp_rank": stage.pp_rank, "pp": stage.layout.pp_size,
                "chunks": stage.layout.num_chunks, "microbatches": stage.layout.num_microbatches,
                "tp_rank": tp_rank, "dp_rank": dp_rank, "split": split, "parameters": len(grads),
                "losses": result.losses, "order": [str(t) for t in executor.last_order],
                "static_order": [str(t) for t in order],
                "actions": [[a.op.value, str(a.task) if a.task else None, a.peer, a.tag, a.payload]
                            for a in executor.last_actions],
                "peak_stored": executor.peak_stored_activations, "peak_bytes": executor.memory.peak,
            })
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(compared))
    backend.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
