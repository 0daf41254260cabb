"""The CUDA path (NCCL, megatron-core DDP and optimizer, CUDA-event tracing). Skipped without a
GPU; run on a GPU machine with `pytest tests/app/test_cuda.py`. Tests that need more ranks than
one GPU allows (NCCL puts one rank on each GPU) adapt their layout to the GPUs present."""
from __future__ import annotations

import json

import pytest
import torch

from launch import ROOT, python, torchrun
from logparse import losses as logged_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SMALL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "512",
         "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "0"]
WORKER = ROOT / "tests" / "app" / "workers" / "mcore_schedule_compare.py"


def _train(device: str, extra: list[str], nproc: int = 1, timeout: float = 300):
    proc = torchrun("pretrain_gpt.py", [*SMALL, *extra, "--device", device], nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_cuda_training_follows_the_cpu_loss_curve():
    """Same seed, data and model: CUDA (NCCL, megatron-core DDP + Adam) and CPU (gloo, torch AdamW)
    give the same fp32 loss curve up to float rounding."""
    cuda = _train("cuda", ["--train-iters", "20"])
    cpu = _train("cpu", ["--train-iters", "20"])
    assert "device cuda" in cuda.stdout and "device cpu" in cpu.stdout
    on_cuda, on_cpu = logged_losses(cuda.stdout), logged_losses(cpu.stdout)
    assert sorted(on_cuda) == list(range(1, 21)) and sorted(on_cpu) == list(range(1, 21))
    a = torch.tensor([float(on_cuda[i]) for i in range(1, 21)])
    b = torch.tensor([float(on_cpu[i]) for i in range(1, 21)])
    torch.testing.assert_close(a, b, rtol=2e-3, atol=0.0)
    assert a[-1] < a[0] - 0.5, f"loss did not fall on CUDA: {a.tolist()}"


def test_bf16_trains_with_megatron_core_mixed_precision_optimizer():
    proc = _train("cuda", ["--train-iters", "20", "--bf16"])
    curve = logged_losses(proc.stdout)
    assert float(curve[20]) < float(curve[1]) - 0.5, curve


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_our_executor_equals_megatron_core_schedule(tmp_path, bf16):
    """Our 1F1B executor and megatron-core's own schedule, both under megatron-core DDP and
    optimizer, produce the same losses, grad norms and final weights (PP=2 when two GPUs exist)."""
    pp = 2 if GPUS >= 2 else 1
    results = {}
    for mode in ("ours", "mcore"):
        out = tmp_path / mode
        out.mkdir()
        args = [str(WORKER), "--mode", mode, "--pp", str(pp), "--out", str(out), *(["--bf16"] if bf16 else [])]
        proc = torchrun(args[0], args[1:], nproc=pp) if pp > 1 else python(args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[mode] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(pp)]
    ours, mcore = results["ours"], results["mcore"]
    last = pp - 1
    assert ours[last]["losses"] == mcore[last]["losses"]
    assert ours[last]["norms"] == mcore[last]["norms"]
    for rank in range(pp):
        assert ours[rank]["weights"].keys() == mcore[rank]["weights"].keys()
        for name, value in ours[rank]["weights"].items():
            torch.testing.assert_close(value, mcore[rank]["weights"][name], rtol=0, atol=0, msg=name)
    first, final = ours[last]["losses"][0], ours[last]["losses"][-1]
    assert sum(final) < sum(first), "the weights did not train"


def test_cuda_event_tracing_aggregates(tmp_path):
    trace_dir = tmp_path / "trace"
    _train("cuda", ["--train-iters", "6", "--trace", "--trace-dir", str(trace_dir), "--trace-interval", "3",
                    "--continuous-trace-iterations", "2"])
    from megatron.scan.trace_format import iter_trace_files, read_rank_file

    files = iter_trace_files(trace_dir)
    assert len(files) == 1
    rank_file = read_rank_file(files[0])
    assert rank_file.header["device"] == "cuda" and rank_file.header["timing"] == "cuda-events"
    out = tmp_path / "merged.json"
    proc = python(["scripts/aggregate.py", "-b", str(trace_dir), "-o", str(out)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    events = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    by_name: dict[str, list] = {}
    for event in events:
        by_name.setdefault(event["name"], []).append(event)
    assert len(by_name["iteration"]) == 4 and len(by_name["forward"]) == 4 * 4
    # Device time: every forward lies inside its iteration and takes a positive time.
    for forward in by_name["forward"]:
        assert forward["dur"] > 0
        assert any(it["ts"] <= forward["ts"] and forward["ts"] + forward["dur"] <= it["ts"] + it["dur"] + 1
                   for it in by_name["iteration"])


def test_checkpoint_resume_on_cuda_continues_the_curve(tmp_path):
    full = logged_losses(_train("cuda", ["--train-iters", "8"]).stdout)
    save = tmp_path / "ckpt"
    _train("cuda", ["--train-iters", "8", "--exit-interval", "4", "--save", str(save), "--save-interval", "4"])
    resumed = logged_losses(_train("cuda", ["--train-iters", "8", "--load", str(save)]).stdout)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert {i: full[i] for i in resumed} == resumed


@pytest.mark.skipif(GPUS != 1, reason="checks the one-GPU case")
def test_more_ranks_than_gpus_is_a_clear_error():
    proc = torchrun("pretrain_gpt.py", [*SMALL, "--train-iters", "2", "--device", "cuda"], nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "2 ranks on this node but 1 GPU" in proc.stderr and "--device cpu" in proc.stderr
