"""Shared launches for the FBD tests: each (baseline, FBD) pair runs once per test session."""
from __future__ import annotations

import atexit
import functools
import re
import shutil
import tempfile
from pathlib import Path

import torch

from launch import torchrun

MODEL = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "2e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--log-interval", "1", "--device", "cpu",
    "--mock-data", "--vocab-size", "256", "--train-iters", "20",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
_ROOT = Path(tempfile.mkdtemp(prefix="fbd-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)


@functools.lru_cache(maxsize=None)
def launch(name: str, nproc: int, args: tuple[str, ...], iters: int = 20) -> dict:
    """Run pretrain_gpt.py with --save; return its loss curve, output and checkpoint directory."""
    out = _ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    model = [*MODEL[:-1], str(iters)]  # MODEL ends with --train-iters 20
    proc = torchrun("pretrain_gpt.py", [*model, *args, "--save", str(out / "ckpt")], nproc=nproc, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    curve = {int(m.group(1)): float(m.group(2)) for m in LOSS.finditer(proc.stdout)}
    validation = {int(m.group(1)): float(m.group(2)) for m in VALIDATION.finditer(proc.stdout)}
    return {"losses": curve, "validation": validation, "stdout": proc.stdout, "ckpt": out / "ckpt" / f"iter_{iters:07d}", "dir": out}


def assert_same_training(run: dict, baseline: dict, last: int) -> None:
    """An FBD run printed the baseline's loss curve (rtol 2e-6, the printed precision) for
    iterations 1..last and ended with its weights. Gradients are summed in another order (one
    replica of 2x microbatches instead of a DP mean); Adam turns the ~1e-9 differences of near-zero
    gradients into ~1e-6 steps, hence atol on the weights."""
    assert sorted(run["losses"]) == list(range(1, last + 1)), run["stdout"][-2000:]
    steps = sorted(baseline["losses"])
    torch.testing.assert_close(torch.tensor([run["losses"][i] for i in steps]),
                               torch.tensor([baseline["losses"][i] for i in steps]), rtol=2e-6, atol=0)
    expected, got = weights(baseline["ckpt"]), weights(run["ckpt"])
    assert expected and set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Final model weights by (tp, pp) file and parameter name."""
    result = {}
    for path in sorted(ckpt.glob("mp_rank_*/model_optim_rng.pt")):
        payload = torch.load(path, map_location="cpu", weights_only=False)
        for index, state in enumerate(payload["model"]):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and "_extra_state" not in key:
                    result[f"{path.parent.name}/{index}/{key}"] = value
    return result
