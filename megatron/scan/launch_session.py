"""One worker's zero-code tracing, armed by the bootstrap sitecustomize of `python -m megatron.scan
launch` and started at `init_process_group`: optimizer-step windows, collectives with DDP's buckets,
P2P, the model's forward/backward per microbatch (launch_spans), megatron-core's schedule and layout,
watchdog, crash files, metrics, capture, gathering."""
from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported once the process group exists, not at start-up
    from megatron.scan.launch_spans import ModelSpans
    from megatron.scan.session import LaunchOptions, TraceSession

_C10D = "torch.distributed.distributed_c10d"
_MCORE_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
# Modules whose early `from torch.distributed import all_reduce` aliases are rebound too.
ALIAS_PREFIXES = ("__main__", "megatron", "torch.nn.parallel", "torch.distributed.fsdp",
                  "torch.distributed.algorithms", "torch.distributed.tensor")



class _ImportHook(importlib.abc.MetaPathFinder):
    """Calls `then(module)` the moment the module named `name` has been imported (without
    importing it, or torch, any earlier)."""

    def __init__(self, name: str, then) -> None:
        self.name = name
        self.then = then

    def find_spec(self, name: str, path: Any, target: Any = None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module
        then = self.then

        def exec_module(module) -> None:
            original_exec(module)
            then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def when_imported(name: str, then) -> None:
    """`then(module)` now if `name` is imported already, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    else:
        sys.meta_path.insert(0, _ImportHook(name, then))


def armed(environ) -> bool:
    """Whether `launch` (or its printed environment) asked this process to trace."""
    from megatron.scan.session import launch_requested

    return launch_requested(environ)


def arm() -> None:
    """Called from the bootstrap sitecustomize in each worker."""
    module = sys.modules.get(_C10D)
    if module is not None:
        _patch_init(module)
        if getattr(sys.modules.get("torch.distributed"), "init_process_group", None) is not module.init_process_group:
            sys.modules["torch.distributed"].init_process_group = module.init_process_group
    else:
        when_imported(_C10D, _patch_init)


def _patch_init(c10d) -> None:
    original = c10d.init_process_group
    if getattr(original, "__megascan_launch__", False):
        return

    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            LaunchSession.start_from_environment()
        except Exception as exc:  # a tracing failure must not fail the job
            print(f"[megascan] tracing not started: {exc!r}", file=sys.stderr, flush=True)
        return result

    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__megascan_launch__ = True  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    c10d.init_process_group = init_process_group
    _patch_destroy(c10d)


def _patch_destroy(c10d) -> None:
    """The program's `destroy_process_group()` ends tracing first: the trace file gets its end,
    and a node without rank 0's file system sends the rest of it while the groups still exist."""
    original = c10d.destroy_process_group

    def destroy_process_group(group=None):
        if group is None and LaunchSession.current is not None:
            try:
                LaunchSession.current.close("destroy_process_group")
            except Exception as exc:  # noqa: BLE001 - a tracing failure must not fail the job
                print(f"[megascan] closing the trace failed: {exc!r}", file=sys.stderr, flush=True)
        return original(group)

    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = original.__doc__
    c10d.destroy_process_group = destroy_process_group
    module = sys.modules.get("torch.distributed")
    if module is not None and getattr(module, "destroy_process_group", None) is original:
        module.destroy_process_group = destroy_process_group



class LaunchSession:
    """One worker's tracing: the tracer (windows of optimizer steps), its collective observer with
    DDP buckets, the watchdog, crash capture and optional metrics."""

    current: "LaunchSession | None" = None

    @classmethod
    def start_from_environment(cls) -> "LaunchSession | None":
        if cls.current is not None or not armed(os.environ):
            return cls.current
        from megatron.scan.launcher import options_from_environment

        cls.current = cls(options_from_environment(os.environ), os.environ)
        cls.current.start()
        return cls.current

    def __init__(self, options: "LaunchOptions", environ: dict[str, str] | os._Environ) -> None:
        self.options = options
        self.directory = options.trace.directory
        self.run_id = environ.get("MEGASCAN_RUN_ID") or f"{environ.get('MASTER_ADDR')}-{environ.get('MASTER_PORT')}"
        self.session: TraceSession | None = None
        self.control = None
        self.gathering = None
        self._closed = False
        self.tracer = None
        self.watchdog = None
        self.crash = None
        self.metrics = None
        self._undo_steps = None
        self.spans: ModelSpans | None = None
        self.fault = None  # --inject-slowdown's DeviceFault on this rank
        self._compute_noted = False
        self._layout_known = False
        self.iteration = 0
        self._optimizer_id: int | None = None
        self._iteration_start = 0
        self._step_start = 0
        self._step_flags = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        import torch.distributed as dist

        from megatron.scan.launch_spans import ModelSpans, hook_ddp
        from megatron.scan.session import start_trace
        from megatron.scan.timers import build_timer
        from megatron.scan.watchdog import process_identity, start_watchdog

        rank, world_size = dist.get_rank(), dist.get_world_size()
        # Without a model of the program's parallelism every rank is a data-parallel replica; the
        # groups each collective ran on are in the trace, which is what matching needs. Rank 0's
        # run id is the job's: each node's `launch` made its own. Layer scopes come with the model
        # (its repeated blocks, at --trace-granularity full); the header names what is recorded
        # (full or coarse once the model's spans are found, megatron-core's with its schedule).
        self.session = session = start_trace(
            self.options.trace, rank=rank, world_size=world_size, run_id=self.run_id,
            coordinates={"dp": rank, "pp": 0, "tp": 0}, sizes={"dp": world_size, "pp": 1, "tp": 1, "vpp": 1},
            timer=build_timer("cpu", None), granularity="collectives",
            extra={"device": "launched", "timing": "host-monotonic", "backend": str(dist.get_backend()),
                   "launcher": {"argv": sys.argv[:16]}, "num_microbatches": 1, "schedule": []})
        self.run_id, self.control, self.gathering = session.run_id, session.control, session.gathering
        self.tracer = tracer = session.tracer
        tracer.collectives.install(ALIAS_PREFIXES)
        tracer.trace_point_to_point(ALIAS_PREFIXES)
        identity = process_identity(rank, world_size, {"dp": rank, "pp": 0, "tp": 0})
        self.crash, self.watchdog = start_watchdog(self.directory, identity, self.options.hang_timeout,
                                                   tracer.collectives)
        if self.watchdog is not None:
            tracer.collectives.listeners.append(self.watchdog.on_collective)
        if self.options.metrics_port is not None:
            self._start_metrics(identity)
        self.fault = self._device_fault(rank)
        if os.environ.get("MEGASCAN_MODEL_SPANS", "1") != "0":
            self.spans = ModelSpans(tracer, rank, layers=self.options.trace.granularity == "full",
                                    fault=self.fault).install()
        self._hook_optimizers()
        hook_ddp(self)
        if os.environ.get("MEGASCAN_MCORE_HOOKS", "1") != "0":
            when_imported(_MCORE_SCHEDULES, self._hook_megatron_core)
        self._iteration_start = time.perf_counter_ns()
        tracer.begin_iteration(0)
        atexit.register(self.close, "exit")

    def _device_fault(self, rank: int):
        """`--inject-slowdown` for this rank: an inject.DeviceFault, told each step's number."""
        from megatron.scan.inject import DeviceFault, Slowdown

        slowdowns = [s for s in map(Slowdown.parse, self.options.inject_slowdown) if s.rank == rank]
        if not slowdowns:
            return None
        fault = DeviceFault(slowdowns)
        fault.begin_iteration(0)
        return fault

    def _start_metrics(self, identity: dict[str, Any]) -> None:
        from megatron.scan.control import read_control_token
        from megatron.scan.metrics import start_rank_metrics

        token_file = self.options.metrics_control_token_file
        self.metrics = start_rank_metrics(identity, self.directory, port=self.options.metrics_port,
                                          token=read_control_token(token_file) if token_file else None, traced=True)
        self.tracer.collectives.listeners.append(self.metrics.on_collective)
        if self.watchdog is not None:
            self.watchdog.hang_listeners.append(self.metrics.on_hang)
            self.metrics.stalled.set_function(self.watchdog.stalled_seconds)

    # --- iterations = optimizer steps -------------------------------------------------
    def _hook_optimizers(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)

    def _first_optimizer(self, optimizer) -> bool:
        # Programs with several optimizers step them all once per iteration: count the first one.
        if self._optimizer_id is None:
            self._optimizer_id = id(optimizer)
        return id(optimizer) == self._optimizer_id

    def _before_step(self, optimizer, args, kwargs) -> None:
        spans = self.spans
        if spans is not None and spans.model is None:
            spans.note_optimizer(optimizer)
        if self._first_optimizer(optimizer):
            # On the compute spans' clock (CUDA events on CUDA) in a window: the step is device work too.
            device = spans is not None and spans.device_timed and self.tracer.active
            self._step_start = spans.mark() if device else time.perf_counter_ns()
            self._step_flags = spans.flags if device else 0

    def _after_step(self, optimizer, args, kwargs) -> None:
        if not self._first_optimizer(optimizer) or self.tracer is None or self.tracer.closed:
            return
        tracer, now = self.tracer, time.perf_counter_ns()
        step_end = self.spans.mark() if self._step_flags and self.spans is not None else now
        microbatches = self.spans.step_done() if self.spans is not None else 0
        with self._lock:
            if tracer.active:
                if microbatches and not self._compute_noted:
                    self._note_compute(microbatches)
                tracer.events.append(("optimizer", self._step_start, step_end, self.iteration, -1, -1, -1, -1, -1,
                                      -1, -1, self._step_flags, None))
                tracer.events.append(("iteration", self._iteration_start, now, self.iteration, -1, -1, -1, -1, -1,
                                      -1, -1, 0, None))
            seconds = (now - self._iteration_start) * 1e-9
            self.control.after_iteration(self.iteration)  # a window agreed on may close the current one
            tracer.end_iteration(self.iteration, {"iteration_time": seconds})
            self.iteration += 1
            self._iteration_start = now
            if self.fault is not None:
                self.fault.begin_iteration(self.iteration)
            tracer.begin_iteration(self.iteration)
        if self.watchdog is not None:
            self.watchdog.set_iteration(self.iteration)
        if self.metrics is not None:
            self.metrics.on_iteration({"iteration_time": seconds})

    def _note_compute(self, microbatches: int) -> None:
        """The first traced step with the model's spans: the header says what the trainer's does (while
        no window was written; after that the header stays as it is)."""
        self._compute_noted = True
        writer = self.tracer.writer
        granularity = "full" if self.tracer.layer_scopes is not None else "coarse"
        fields: dict[str, Any] = {"trace": {**writer.header.get("trace", {}), "granularity": granularity},
                                  "num_microbatches": microbatches}
        if self.spans is not None and self.spans.device_timed:
            fields["timing"] = "cuda-events+host-monotonic"  # compute and optimizer on CUDA events
        writer.update_header(fields)

    # --- megatron-core's pipeline schedule ---------------------------------------------------
    def _hook_megatron_core(self, schedules) -> None:
        from megatron.app.mcore_schedule import install_step_spans

        self._undo_steps = install_step_spans(self.tracer, on_forward=self._on_forward)

    def _on_forward(self, args: tuple, kwargs: dict) -> None:
        """At the first forward of megatron-core's schedule its parallel state is set up: put this
        rank's coordinates, the layout's sizes and the microbatch count in the trace header."""
        if self.spans is not None:
            self.spans.defer()
        if self._layout_known:
            return
        self._layout_known = True
        self._time_schedule_on(_model_device(args, kwargs))
        try:
            from megatron.core import parallel_state as ps

            from megatron.scan.trace_format import trace_file_name

            if not ps.model_parallel_is_initialized():
                return
            coordinates = {"dp": ps.get_data_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                           "tp": ps.get_tensor_model_parallel_rank()}
            sizes = {"dp": ps.get_data_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                     "tp": ps.get_tensor_model_parallel_world_size(),
                     "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1}
            microbatches = kwargs.get("num_microbatches", args[3] if len(args) > 3 else 1)
            writer = self.tracer.writer
            trace = {**writer.header.get("trace", {}), "granularity": "megatron-core"}
            timing = {"timing": "cuda-events+host-monotonic"} if self.spans is not None and self.spans.device_timed else {}
            path = self.directory / trace_file_name(coordinates["dp"], coordinates["pp"], coordinates["tp"],
                                                    attempt=writer.header.get("attempt", 0))
            if not writer.update_header({"coordinates": coordinates, "sizes": sizes, "trace": trace,
                                         "num_microbatches": int(microbatches), **timing}, path):
                print("[megascan] megatron-core's layout was found after the first traced window was written; "
                      "the trace keeps every rank as a data-parallel replica", file=sys.stderr, flush=True)
        except Exception as exc:  # a tracing failure must not fail the job
            print(f"[megascan] megatron-core layout not recorded: {exc!r}", file=sys.stderr, flush=True)

    def _time_schedule_on(self, device) -> None:
        """A model on a GPU: the schedule's forward/backward spans (and the optimizer step) are timed
        by CUDA events on the current stream, as the trainer's are; collectives and P2P keep the host
        clock they were installed with. Read at the schedule's first forward, when the program has
        picked its device (whether it called set_device before init_process_group or after)."""
        if device is None or device.type != "cuda" or self.spans is None or self.spans.device_timed:
            return
        from megatron.scan.trace_format import FLAG_DEVICE_TIME

        try:
            self.spans.use_device_clock(device)
        except Exception as exc:  # noqa: BLE001 - a tracing failure must not fail the job
            print(f"[megascan] forward/backward stay on the host clock: {exc!r}", file=sys.stderr, flush=True)
            return
        tracer = self.tracer
        tracer.mark, tracer.device_flag = tracer.timer.mark, FLAG_DEVICE_TIME

    # --- DDP ------------------------------------------------------------------------------
    def async_collective(self, op: str, tensor, group, issue):
        """Issue an async collective and record it from issue to completion (a future callback),
        with a sequence number from the shared per-group counter."""
        observer = self.tracer.collectives
        info = observer.group_info(group)
        seq = info.seq
        info.seq += 1
        size, dtype = tensor.numel() * tensor.element_size(), str(tensor.dtype).replace("torch.", "")
        info.in_flight = (op, seq, time.monotonic())
        start = time.perf_counter_ns()
        work = issue()

        def done(future):
            end = time.perf_counter_ns()
            if info.in_flight is not None and info.in_flight[1] == seq:
                info.in_flight = None
            if info.last_completed is None or info.last_completed[1] < seq:
                info.last_completed = (op, seq)
            if observer.recording:
                with self._lock:
                    observer.sink(op, start, end, size, dtype, info.gid, seq, 0)
            for listener in observer.listeners:
                listener(op, info, seq, start, end)
            return future.value()[0]

        return work.get_future().then(done)

    def close(self, reason: str = "exit") -> None:
        if self._closed:  # at destroy_process_group, then again at exit
            return
        self._closed = True
        if self.session is not None:
            # At most 10 s for the last capture broadcast: at exit some peers may be gone already.
            self.session.close(reason, end={"iterations": self.iteration}, control_timeout=10.0,
                               gather_timeout=120.0, lock=self._lock)
            self.gathering = None
        if self._undo_steps is not None:
            self._undo_steps()
        if self.spans is not None:
            self.spans.uninstall()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.crash is not None:
            self.crash.uninstall()


def _model_device(args: tuple, kwargs: dict):
    """The device of the model megatron-core's `forward_step(forward_step_func, data_iterator, model,
    ...)` runs (None where it cannot be read)."""
    model = kwargs.get("model", args[2] if len(args) > 2 else None)
    try:
        first = next(iter(model.parameters()), None) if model is not None else None
    except Exception:  # noqa: BLE001 - not a module: no device to read
        return None
    return None if first is None else first.device
