"""Forward/backward spans under the zero-code launcher: the model's forward and backward per
microbatch (gradient accumulation under DDP `no_sync` included), the data wait and the optimizer
step, recorded as the trainer records them so the compute analyzer compares the ranks; a backward
ends at its last DDP bucket's issue, so a healthy rank's backward does not absorb a slow peer."""
from __future__ import annotations

import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from launch import free_port, python

MICROBATCHES = 3
STEPS = 6
SLOW_RANK = 1
SLEEP_MS = 120.0

# A plain DDP program (nothing from megatron): 3 microbatches per step, the first two under
# no_sync, batches from a DataLoader, an evaluation forward under no_grad after each step.
SCRIPT = textwrap.dedent(f"""
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn({STEPS * MICROBATCHES} * 8, 32, generator=generator),
                         torch.randn({STEPS * MICROBATCHES} * 8, 1, generator=generator))
    batches = iter(DataLoader(data, batch_size=8))
    for step in range({STEPS}):
        for microbatch in range({MICROBATCHES}):
            inputs, targets = next(batches)
            last = microbatch == {MICROBATCHES} - 1
            with model.no_sync() if not last else torch.enable_grad():
                loss = torch.nn.functional.mse_loss(model(inputs), targets) / {MICROBATCHES}
                if last and rank == {SLOW_RANK}:
                    time.sleep({SLEEP_MS} / 1e3)  # a slow device: its peer waits in the bucket all-reduce
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model(inputs)  # evaluation: not a training microbatch
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compute")
    script = directory / "accumulate.py"
    script.write_text(SCRIPT)
    trace_dir = directory / "trace"
    # Every step traced (a window of 2 every 2 steps).
    proc = python(["-m", "megatron.scan", "launch", "--trace-dir", str(trace_dir), "--trace-interval", "2",
                   "--continuous-trace-iterations", "2", "--hang-timeout", "60", "--",
                   sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), str(script)], timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from megatron.scan.trace_format import read_rank_file

    return trace_dir, {r: read_rank_file(trace_dir / f"benchmark-data-{r}-pipeline-0-tensor-0.json") for r in (0, 1)}


def _rows(trace, name: str, iteration: int | None = None) -> np.ndarray:
    c = trace.columns
    if name not in trace.names:
        return np.zeros(0, dtype=np.int64)
    rows = c["name"] == trace.names.index(name)
    if iteration is not None:
        rows &= c["iteration"] == iteration
    return np.flatnonzero(rows)


def test_each_step_has_its_microbatches(launched):
    _, traces = launched
    for rank, trace in traces.items():
        assert trace.header["trace"]["granularity"] == "coarse" and trace.header["num_microbatches"] == MICROBATCHES
        c = trace.columns
        for iteration in range(STEPS):
            for kind in ("forward", "backward", "data"):
                rows = _rows(trace, kind, iteration)
                assert sorted(c["microbatch"][rows].tolist()) == list(range(MICROBATCHES)), (rank, iteration, kind)
            assert (c["chunk"][_rows(trace, "forward", iteration)] == 0).all()
            assert len(_rows(trace, "optimizer", iteration)) == 1, (rank, iteration)
            # DDP's bucket is all-reduced at the last microbatch only (the others ran under no_sync).
            assert len(_rows(trace, "grad_sync", iteration)) == 1, (rank, iteration)


def test_backward_ends_at_the_last_bucket_issue(launched):
    """The healthy rank waits for its slow peer after issuing its bucket: in grad_sync, not in backward."""
    _, traces = launched
    healthy = traces[1 - SLOW_RANK]
    c = healthy.columns
    backward = _rows(healthy, "backward")
    last = backward[c["microbatch"][backward] == MICROBATCHES - 1]
    sync = _rows(healthy, "grad_sync")
    assert len(last) == len(sync) == STEPS
    backward_ms = (c["end_ns"][last] - c["start_ns"][last]) / 1e6
    sync_ms = (c["end_ns"][sync] - c["start_ns"][sync]) / 1e6
    assert np.median(backward_ms) < SLEEP_MS / 4, backward_ms
    assert np.median(sync_ms) > SLEEP_MS / 2, sync_ms
    assert (np.sort(c["end_ns"][last]) <= np.sort(c["start_ns"][sync])).all()


def test_aggregation_compares_compute(launched):
    from megatron.scan.detect import run_detection

    trace_dir, _ = launched
    detection = run_detection(trace_dir, jobs=1, what_if=False)
    assert not any("forward/backward" in note or "compute" in note
                   for note in detection.compute.notes + detection.notes), detection.notes
    assert sorted(detection.compute.findings) == [0, 1]
    # The sleep is this rank's own time between its forward and backward: its compute is the slower.
    assert detection.compute.findings[SLOW_RANK].slowdown > detection.compute.findings[1 - SLOW_RANK].slowdown


# --- in-process: the model spans on a stand-in tracer ------------------------------------------------
class _Tracer:
    def __init__(self) -> None:
        self.active, self.iteration, self.context, self.events, self.gpu = True, 0, (-1, -1), [], None


@pytest.fixture
def spans():
    from megatron.scan.launch_spans import ModelSpans

    tracer = _Tracer()
    spans = ModelSpans(tracer).install()
    yield spans
    spans.uninstall()


def _kinds(tracer, kind: str) -> list[tuple]:
    return [e for e in tracer.events if e[0] == kind]


def test_the_outermost_module_an_optimizer_holds_is_the_model(spans):
    from torch.nn.modules import module as module_hooks

    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1)

    class Wrapper(torch.nn.Module):  # an outer module holding the optimizer's parameters, as DDP is
        def __init__(self) -> None:
            super().__init__()
            self.module = inner

        def forward(self, x):
            return self.module(x)

    wrapper = Wrapper()
    x = torch.randn(2, 4)
    frozen(x)  # no optimizer holds it: not the model
    with torch.no_grad():
        wrapper(x)  # evaluation before training: not the model's microbatch, not even a candidate
    assert spans.model is None
    for _ in range(2):
        wrapper(frozen(x)).sum().backward()
    assert spans.model is wrapper
    # Every module call paid for the global hook until the model was found; no more.
    assert spans._finder is None and spans._find_model not in module_hooks._global_forward_pre_hooks.values()
    with torch.no_grad():
        wrapper(x)
    tracer = spans.tracer
    assert [e[4] for e in _kinds(tracer, "forward")] == [0, 1] and [e[4] for e in _kinds(tracer, "backward")] == [0, 1]
    assert all(e[5] == 0 and e[3] == 0 for e in _kinds(tracer, "forward") + _kinds(tracer, "backward"))
    optimizer.step()
    assert spans.step_done() == 2 and spans.forwards == spans.backwards == 0
    tracer.active = False  # outside a traced window nothing is recorded
    wrapper(x).sum().backward()
    assert len(_kinds(tracer, "forward")) == 2 and spans.forwards == 0


def test_backward_span_ends_at_the_last_bucket_issue_unit(spans):
    """As DDP does: buckets issued from gradient hooks during backward, then the end-of-backward
    callback waiting for the all-reduce (here a sleep standing for a slow peer)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    torch.optim.SGD(model.parameters(), lr=0.1)

    def issue(grad):
        spans.bucket_issued()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: time.sleep(0.2))
        return grad

    model[0].weight.register_hook(issue)
    loss = model(torch.randn(2, 4)).sum()
    started = time.perf_counter_ns()
    loss.backward()
    returned = time.perf_counter_ns()
    (backward,), (sync,) = _kinds(spans.tracer, "backward"), _kinds(spans.tracer, "grad_sync")
    assert backward[1] >= started and backward[2] == sync[1] and sync[2] <= returned
    assert (backward[2] - backward[1]) < 0.1e9 < (sync[2] - sync[1])


def test_data_waits_and_megatron_core_deferral(spans):
    from torch.utils.data import DataLoader, TensorDataset

    model = torch.nn.Linear(4, 1)
    torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    for _ in range(2):
        (x,) = next(batches)
        model(x).sum().backward()
    assert [e[4] for e in _kinds(spans.tracer, "data")] == [0, 1]
    spans.step_done()
    spans.defer()  # megatron-core's schedule spans record forward/backward themselves
    (x,) = next(batches)
    model(x).sum().backward()
    assert len(_kinds(spans.tracer, "forward")) == 2 and len(_kinds(spans.tracer, "data")) == 2


def test_a_cuda_model_switches_the_compute_spans_to_device_time(spans, monkeypatch):
    """What happens when the model's parameters are on CUDA, with a stand-in for the CUDA timer (no GPU
    here): the window in progress gets the timer's reference, the tracer resolves its tokens, and
    the spans carry the device-time flag."""
    import megatron.scan.timers as timers
    from megatron.scan.trace_format import FLAG_DEVICE_TIME

    class FakeCudaTimer(timers.HostTimer):
        device_timed = True
        started = 0

        def window_start(self) -> None:
            self.started += 1

    monkeypatch.setattr(timers, "build_timer", lambda kind, device=None: FakeCudaTimer())
    tracer = spans.tracer
    tracer.timer = timers.HostTimer()
    spans.use_device_clock(torch.device("cuda", 0))
    assert isinstance(tracer.timer, FakeCudaTimer) and tracer.timer.started == 1 and spans.device_timed
    # Block spans read tracer.mark when they fire: the device clock too.
    assert tracer.mark == tracer.timer.mark
    model = torch.nn.Linear(4, 1)
    torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    assert [e[11] for e in tracer.events if e[0] in ("forward", "backward")] == [FLAG_DEVICE_TIME] * 2


def test_megatron_core_schedule_spans_take_device_time_when_the_model_is_on_cuda(spans, monkeypatch):
    """A megatron-core program (Megatron-LM's pretrain_gpt.py) under launch: its schedule's spans go
    through the tracer, so at the schedule's first forward a model on CUDA moves the tracer's span
    clock to CUDA events (stand-in timer here), while collectives keep the host clock."""
    from types import SimpleNamespace

    import megatron.scan.timers as timers
    from megatron.scan.launch_session import LaunchSession, _model_device
    from megatron.scan.trace_format import FLAG_DEVICE_TIME

    class FakeCudaTimer(timers.HostTimer):
        device_timed = True

        def window_start(self) -> None:
            pass

    monkeypatch.setattr(timers, "build_timer", lambda kind, device=None: FakeCudaTimer())
    tracer = spans.tracer
    tracer.timer = timers.HostTimer()
    tracer.mark, tracer.device_flag = tracer.timer.mark, 0
    session = LaunchSession.__new__(LaunchSession)
    session.spans, session.tracer = spans, tracer

    cpu_model = torch.nn.Linear(2, 2)
    assert _model_device(("step", iter(()), cpu_model), {}) == torch.device("cpu")
    session._time_schedule_on(_model_device(("step", iter(()), cpu_model), {}))
    assert tracer.device_flag == 0 and not spans.device_timed  # a CPU job keeps the host clock

    class CudaModel:  # what forward_step's `model` argument is on a GPU rank
        def parameters(self):
            return iter([SimpleNamespace(device=torch.device("cuda", 0))])

    session._time_schedule_on(_model_device((), {"model": CudaModel()}))
    assert spans.device_timed and isinstance(tracer.timer, FakeCudaTimer)
    assert tracer.mark == tracer.timer.mark and tracer.device_flag == FLAG_DEVICE_TIME
    assert _model_device((), {"model": object()}) is None  # nothing to read: no switch, no error
