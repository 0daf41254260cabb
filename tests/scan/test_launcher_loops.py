"""Training loops this project did not write, run the way their users run them (torchrun, CPU,
gloo, each library setting up DDP itself) under the zero-code launcher, `python -m megatron.scan
launch -- torchrun ...`: Hugging Face `transformers.Trainer`, PyTorch Lightning's `Trainer` with
its DDP strategy, pytorch-ignite's `create_supervised_trainer`, and as baselines a plain DDP script
with gradient accumulation under `no_sync` and an FSDP2 (`fully_shard`) script over gloo (scripts
in tests/scan/loops/). Each job
must succeed with a finished trace file per rank that aggregates with every collective matched
and runs detection, and every traced iteration must hold a forward and a backward span per
microbatch."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from launch import ROOT, env, free_port, kill_tree

LOOPS_DIR = Path(__file__).resolve().parent / "loops"
NPROC = 2
ACCUM = 2  # gradient accumulation steps: microbatches per optimizer step in every loop
STEPS = 6
JOB_TIMEOUT = 150  # seconds; a loop takes 5-15 s on 2 idle cores


@dataclass(frozen=True)
class Loop:
    name: str
    script: str
    requires: str  # the package the loop comes from ("" for torch alone)
    extra: tuple[str, ...] = ()


LOOPS = [
    Loop("torch_ddp", "torch_ddp.py", ""),
    Loop("hf_trainer", "hf_trainer.py", "transformers"),
    Loop("lightning", "lightning_ddp.py", "lightning"),
    Loop("ignite", "ignite_trainer.py", "ignite"),
    Loop("fsdp2", "fsdp2.py", ""),
]
# Loops whose model is built of repeated blocks (GPT-2's `h`, the FSDP2 script's `blocks`), and how
# many: the launcher records each block's calls, as `--trace-granularity full` does in the trainer.
BLOCKS = {"hf_trainer": 2, "fsdp2": 2}


def launch_loop(loop: Loop, trace_dir: Path, steps: int = STEPS) -> subprocess.CompletedProcess:
    """`launch --trace-dir trace_dir -- torchrun --nproc-per-node 2 loop --steps N`, with windows
    of 2 steps out of every 3 (steps 0-1 and 3-4 of 6); the whole process tree is killed if it
    outlives JOB_TIMEOUT."""
    command = [sys.executable, "-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir),
               "--trace-interval", "3", "--continuous-trace-iterations", "2", "--hang-timeout", "120", "--",
               sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(LOOPS_DIR / loop.script), "--steps", str(steps), "--accum", str(ACCUM), *loop.extra]
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{loop.name} did not finish in {JOB_TIMEOUT} s:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def crash_text(trace_dir: Path) -> str:
    texts = []
    for path in sorted(trace_dir.glob("crash-rank*.json")):
        try:
            texts.append(json.loads(path.read_text()).get("text", ""))
        except (OSError, ValueError):
            texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


@pytest.fixture(scope="module", params=LOOPS, ids=[loop.name for loop in LOOPS])
def launched(request, tmp_path_factory):
    """(loop, trace dir) of one finished launch of the loop."""
    loop: Loop = request.param
    if loop.requires and importlib.util.find_spec(loop.requires) is None:
        pytest.skip(f"{loop.requires} is not installed (pip install -e .[test] brings it)")
    trace_dir = tmp_path_factory.mktemp(f"loop_{loop.name}")
    proc = launch_loop(loop, trace_dir)
    if proc.returncode != 0:
        crashes = crash_text(trace_dir)
        pytest.fail(f"{loop.name} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}\n"
                    f"{crashes[-3000:]}")
    return loop, trace_dir


def rank_files(trace_dir: Path) -> dict:
    from megatron.scan.trace_format import read_rank_file

    traces = [read_rank_file(path) for path in sorted(trace_dir.glob("benchmark-data-*.json"))]
    return {trace.rank: trace for trace in traces}


def completed_iterations(trace) -> list[int]:
    """The traced iterations that ended with their optimizer step (not the tail after the last)."""
    c = trace.columns
    if "optimizer" not in trace.names:
        return []
    return sorted(set(c["iteration"][c["name"] == trace.names.index("optimizer")].tolist()))


def test_every_rank_traced(launched):
    loop, trace_dir = launched
    traces = rank_files(trace_dir)
    assert sorted(traces) == list(range(NPROC)), sorted(p.name for p in trace_dir.iterdir())
    for rank, trace in traces.items():
        assert trace.ended and not trace.warnings, (rank, trace.warnings)
        # Windows of 2 steps out of every 3: optimizer steps 0, 1, 3 and 4 are traced on every rank.
        assert completed_iterations(trace) == [0, 1, 3, 4], (loop.name, rank, completed_iterations(trace))
        assert any(name in trace.names for name in ("all_reduce", "all_gather", "broadcast")), trace.names
    assert not list(trace_dir.glob("crash-rank*")), crash_text(trace_dir)[-3000:]
    assert not list(trace_dir.glob("hang-rank*"))


def test_gradient_all_reduce_every_step(launched):
    """DDP's gradient buckets are in the trace (through the launcher's comm hook) in every traced
    step: at least one all-reduce of the model's gradient size per step on every rank (FSDP2's
    gradients: a reduce-scatter per block)."""
    loop, trace_dir = launched
    op = "reduce_scatter_single" if loop.name == "fsdp2" else "all_reduce"
    for rank, trace in rank_files(trace_dir).items():
        c = trace.columns
        rows = c["name"] == trace.names.index(op)
        biggest = int(c["bytes"][rows].max())
        assert biggest > 10_000, (loop.name, rank, biggest)  # gradients, not a logged scalar
        per_step = {it: int(((c["iteration"] == it) & rows & (c["bytes"] == biggest)).sum())
                    for it in completed_iterations(trace)}
        assert all(n >= 1 for n in per_step.values()), (loop.name, rank, per_step)


def test_aggregate_and_detect(launched, tmp_path):
    """`scripts/aggregate.py -b DIR -d` as a user runs it, and the API behind it: every collective
    instance is complete (all members recorded it) with one op."""
    loop, trace_dir = launched
    from megatron.scan.aggregate import aggregate

    summary = aggregate(trace_dir, tmp_path / "merged.json", jobs=1).summary()
    assert summary["ranks"] == list(range(NPROC))
    assert summary["collective_instances"] >= 4, summary
    assert summary["collective_instances_incomplete"] == 0, summary
    assert summary["collective_op_mismatches"] == 0, summary
    script = subprocess.run([sys.executable, str(ROOT / "scripts" / "aggregate.py"), "-b", str(trace_dir), "-d",
                             "-o", str(tmp_path / "merged-cli.json")], cwd=ROOT, env=env(), capture_output=True,
                            text=True, timeout=120)
    assert script.returncode == 0, script.stdout[-2000:] + script.stderr[-2000:]
    # The verdict's vocabulary is detection's business; here detection must have run and said one.
    verdict = json.loads((trace_dir / "abnormal.json").read_text())["verdict"]
    assert isinstance(verdict, str) and verdict, verdict
    assert f"verdict: {verdict}" in (trace_dir / "detection.txt").read_text()
    assert (tmp_path / "merged-cli.json").stat().st_size > 0


def test_forward_backward_per_microbatch(launched):
    """Each traced iteration holds a forward and a backward span per microbatch (2 with gradient
    accumulation 2) on every rank: the launcher finds the model each library trains."""
    loop, trace_dir = launched
    traces = rank_files(trace_dir)
    for rank, trace in traces.items():
        c = trace.columns
        counts = {}
        for kind in ("forward", "backward"):
            assert kind in trace.names, (loop.name, rank, kind, trace.names)
            rows = c["name"] == trace.names.index(kind)
            for it in completed_iterations(trace):
                in_it = rows & (c["iteration"] == it)
                microbatches = c["microbatch"][in_it]
                counts[kind, it] = int(in_it.sum())
                if (microbatches >= 0).any():
                    assert sorted(microbatches.tolist()) == list(range(ACCUM)), (loop.name, rank, kind, it,
                                                                                  microbatches.tolist())
        assert all(n == ACCUM for n in counts.values()), (loop.name, rank, counts)
        # Each backward follows its forward.
        forward = np.sort(c["start_ns"][c["name"] == trace.names.index("forward")])
        backward = np.sort(c["start_ns"][c["name"] == trace.names.index("backward")])
        assert len(forward) == len(backward) and (backward > forward).all(), (loop.name, rank)


def test_the_models_blocks_are_traced_per_call(launched):
    """Where the model is built of repeated blocks, every traced iteration holds a layer_forward
    and a layer_backward per block and microbatch (the first block's backward too: its input is
    an embedding's output), numbered 1.., and the header says `full`; a flat MLP has none and
    says `coarse`."""
    loop, trace_dir = launched
    for rank, trace in rank_files(trace_dir).items():
        c = trace.columns
        blocks = BLOCKS.get(loop.name, 0)
        assert trace.header["trace"]["granularity"] == ("full" if blocks else "coarse"), (loop.name, trace.header)
        for kind in ("layer_forward", "layer_backward"):
            if not blocks:
                assert kind not in trace.names, (loop.name, rank, kind)
                continue
            rows = c["name"] == trace.names.index(kind)
            for it in completed_iterations(trace):
                in_it = rows & (c["iteration"] == it)
                assert int(in_it.sum()) == blocks * ACCUM, (loop.name, rank, kind, it, int(in_it.sum()))
                assert sorted(set(c["layer"][in_it].tolist())) == list(range(1, blocks + 1))
