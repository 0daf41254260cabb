"""scripts/gpu_control.sh against a stand-in `nvidia-smi` that logs its arguments: `limit` records the
GPU it changed, `reset` with no index undoes exactly those, `reset all` every GPU, and bad input
says what to pass. (On a GPU node the same calls go to the real nvidia-smi.)"""
from __future__ import annotations

import os
import subprocess

import pytest

from launch import ROOT

SCRIPT = ROOT / "scripts" / "gpu_control.sh"
FAKE = """#!/usr/bin/env bash
echo "$*" >> "$NVSMI_LOG"
case "$*" in
  *power.default_limit*) echo " 700.00" ;;
  *--query-gpu=index*) printf '0\\n1\\n2\\n3\\n' ;;
esac
"""


@pytest.fixture
def gpu(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NVSMI_LOG": str(log),
                   "MEGASCAN_GPU_STATE_DIR": str(tmp_path / "state")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], env=environment, capture_output=True, text=True)

    def calls() -> list[str]:
        lines = log.read_text().splitlines() if log.exists() else []
        log.write_text("")
        return lines

    run.calls = calls
    run.state = tmp_path / "state" / "changed"
    return run


def test_reset_without_index_undoes_every_gpu_it_changed(gpu):
    assert gpu("limit", "2", "900").returncode == 0
    assert gpu("limit", "0", "1100").returncode == 0
    assert gpu.calls() == ["-i 2 -pm 1", "-i 2 --lock-gpu-clocks=0,900", "-i 0 -pm 1", "-i 0 --lock-gpu-clocks=0,1100"]
    assert gpu.state.read_text().split() == ["0", "2"]
    proc = gpu("reset")
    assert proc.returncode == 0, proc.stderr
    assert gpu.calls() == ["-i 0 --reset-gpu-clocks", "-i 0 --query-gpu=power.default_limit --format=csv,noheader,nounits",
                           "-i 0 -pl 700.00",
                           "-i 2 --reset-gpu-clocks", "-i 2 --query-gpu=power.default_limit --format=csv,noheader,nounits",
                           "-i 2 -pl 700.00"]
    assert "GPU 0: clocks unlocked" in proc.stdout and "GPU 2: clocks unlocked" in proc.stdout
    assert not gpu.state.exists()
    again = gpu("reset")
    assert again.returncode == 0 and "nothing to reset" in again.stdout and gpu.calls() == []


def test_reset_of_one_gpu_keeps_the_others_recorded(gpu):
    gpu("limit", "1", "900"), gpu("limit", "3", "900")
    gpu.calls()
    assert gpu("reset", "1").returncode == 0
    assert [c for c in gpu.calls() if "--reset-gpu-clocks" in c] == ["-i 1 --reset-gpu-clocks"]
    assert gpu.state.read_text().split() == ["3"]


def test_reset_all_resets_every_gpu_on_the_node(gpu):
    assert gpu("reset", "all").returncode == 0
    assert [c for c in gpu.calls() if "--reset-gpu-clocks" in c] == [f"-i {i} --reset-gpu-clocks" for i in range(4)]


@pytest.mark.parametrize("args,message", [
    (["limit", "first", "900"], "GPU must be an nvidia-smi index"),
    (["limit", "0", "fast"], "MHZ must be a whole number of MHz"),
    (["reset", "gpu0"], "GPU must be an nvidia-smi index"),
])
def test_bad_input_says_what_to_pass(gpu, args, message):
    proc = gpu(*args)
    assert proc.returncode == 2 and message in proc.stderr
    assert gpu.calls() == []
