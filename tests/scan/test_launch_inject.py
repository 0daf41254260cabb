"""`launch --inject-slowdown RANK:FACTOR`: a slower device in a program MegaScan did not write,
for validating detection on it. The extra time is spent inside each call of the model's repeated
blocks (found by `repeated_blocks`), or of each module holding parameters in a model that has none
(inside autograd, before DDP issues the gradient buckets they feed); detection then names that
rank."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from launch import ROOT, env, free_port
from megatron.scan.layers import repeated_blocks

LOOPS_DIR = Path(__file__).resolve().parent / "loops"


def launched(trace_dir: Path, script: str, inject: str, *args: str, steps: int = 12) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir),
               "--inject-slowdown", inject, "--",
               sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(LOOPS_DIR / script), "--steps", str(steps), *args]
    return subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)


def detected(trace_dir: Path) -> dict:
    from megatron.scan.detect import run_detection
    from megatron.scan.detect.report import as_dict

    return as_dict(run_detection(trace_dir, jobs=1, what_if=False))


def test_a_slowdown_inside_each_block_is_named_by_the_typical_layer_call(tmp_path):
    proc = launched(tmp_path, "fsdp2.py", "1:1.5", "--width", "128")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[inject] rank 1: compute x1.5 from step 0, per block (2 FSDPBlock)" in proc.stderr
    result = detected(tmp_path)
    assert [s["ranks"] for s in result["suspects"]] == [[1]], json.dumps(result["suspects"])[:2000]
    compute = result["suspects"][0]["details"]["compute"]
    assert compute["measure"] == "typical"  # FSDP2 waits make its busy total misleading
    # x1.5 injected reads 1.27-1.60 on 2 busy cores (the same traces give the same figure every time)
    assert 1.2 < result["suspects"][0]["slowdown"] < 1.8


def test_a_model_without_blocks_is_slowed_in_each_module_with_parameters(tmp_path):
    proc = launched(tmp_path, "torch_ddp.py", "0:2", "--width", "128")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # The plain DDP script's MLP: 2 blocks of Linear-GELU-Linear plus a head, all in one Sequential.
    assert "[inject] rank 0: compute x2 from step 0, per module with parameters (5: Linear; no repeated blocks " \
           "found)" in proc.stderr
    result = detected(tmp_path)
    assert [s["ranks"] for s in result["suspects"]] == [[0]], json.dumps(result["suspects"])[:2000]


def test_a_bad_slowdown_says_the_form():
    proc = subprocess.run([sys.executable, "-m", "megatron.scan", "launch", "--trace-dir", "unused",
                           "--inject-slowdown", "1", "--", "true"], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "--inject-slowdown wants RANK:FACTOR[:START_ITER]" in proc.stderr + proc.stdout


def test_repeated_blocks_are_the_largest_stack_of_one_block_class():
    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

        def forward(self, x):
            return self.b(self.a(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.ModuleList(Block(2) for _ in range(3))
            self.layers = torch.nn.ModuleList(Block(16) for _ in range(4))
            self.head = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))  # leaves: no blocks

    model = Model()
    assert repeated_blocks(model) == list(model.layers)
    flat = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    assert repeated_blocks(flat) == []
