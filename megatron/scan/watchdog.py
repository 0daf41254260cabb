"""Per-rank hang watchdog and crash capture: a rank that makes no progress for the timeout dumps
the stacks of all its threads and its per-group collective state into the trace dir (the job keeps
running); uncaught exceptions and fatal signals are written there too, with rank and stack. Over
400 lines because the watchdog, the crash capture and their plugin share the process identity and
the dump format, which one reader checks in one place."""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from megatron.app.plugins import Plugin, register_plugin
from megatron.scan.collectives import CollectiveObserver, GroupInfo, installed_observer
from megatron.scan.session import DEFAULT_HANG_TIMEOUT_S, shared_trace_config

DUMP_FORMAT = "megascan-hang"
# Spans whose open state says who this rank is waiting for.
P2P_KINDS = frozenset({"send", "recv"})


def dump_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"hang-rank{rank}.json"


def crash_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"crash-rank{rank}.json"


def fatal_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"crash-rank{rank}-fatal.txt"


def frames_of(frame_list: list[traceback.FrameSummary]) -> list[dict[str, Any]]:
    """Frames outermost first, as the dumps store them."""
    return [{"file": f.filename, "line": f.lineno, "function": f.name, "code": (f.line or "").strip()}
            for f in frame_list]


def thread_stacks() -> list[dict[str, Any]]:
    """The Python stack of every thread of this process."""
    threads = {t.ident: t for t in threading.enumerate()}
    main_ident = threading.main_thread().ident
    stacks = []
    for ident, frame in sys._current_frames().items():
        thread = threads.get(ident)
        stacks.append({"name": thread.name if thread else f"thread-{ident}", "ident": ident,
                       "main": ident == main_ident, "daemon": bool(thread and thread.daemon),
                       "frames": frames_of(traceback.extract_stack(frame))})
    stacks.sort(key=lambda s: (not s["main"], s["name"]))
    return stacks


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    # A reader (the `hang` command, run while the job is still stuck) must never see half a dump.
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def process_identity(rank: int | None = None, world_size: int | None = None,
                     coordinates: dict[str, int] | None = None) -> dict[str, Any]:
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return {"rank": rank, "world_size": world_size, "coordinates": coordinates or {},
            "host": socket.gethostname(), "pid": os.getpid(),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}


def shared_collective_observer() -> CollectiveObserver:
    """The collective observer already wrapping torch.distributed (the tracer's), or a new one that
    counts and tracks progress without recording anything."""
    observer = installed_observer()
    if observer is None:
        observer = CollectiveObserver(time.perf_counter_ns, lambda *event: None)
        observer.install()
    return observer


class Watchdog:
    """A daemon thread that dumps this rank's state once per stall of `timeout` seconds. Progress is
    any finished collective, finished span or iteration boundary, reported through `progress`."""

    def __init__(self, *, directory: str | os.PathLike, identity: dict[str, Any], timeout: float,
                 observer: CollectiveObserver | None = None, poll_interval: float | None = None) -> None:
        self.directory = Path(directory)
        self.identity = identity
        self.rank = int(identity["rank"])
        self.timeout = float(timeout)
        self.observer = observer
        self.poll_interval = poll_interval or max(0.2, min(5.0, self.timeout / 10))
        self.last_progress = time.monotonic()
        self.last_progress_what = "start"
        self.iteration = -1
        self.hung = False
        self.dumps_written = 0
        self.open_spans: list[tuple[str, dict[str, Any], float]] = []
        self.hang_listeners: list[Callable[[bool], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megascan-watchdog", daemon=True)

    # --- progress (called on the training thread; must stay cheap) -------------------
    def progress(self, what: str) -> None:
        self.last_progress = time.monotonic()
        self.last_progress_what = what
        if self.hung:
            self.hung = False
            self._notify(False)

    def on_collective(self, op: str, info: GroupInfo, seq: int, start_ns: int, end_ns: int) -> None:
        self.last_progress = time.monotonic()
        self.last_progress_what = op
        if self.hung:
            self.hung = False
            self._notify(False)

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.progress("iteration")

    def stalled_seconds(self) -> float:
        return max(0.0, time.monotonic() - self.last_progress)

    # --- thread --------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            if self.hung or self.stalled_seconds() < self.timeout:
                continue
            self.hung = True
            try:
                path = self.dump("no progress")
                print(f"[megascan] rank {self.rank}: no progress for {self.stalled_seconds():.0f} s "
                      f"(last: {self.last_progress_what}); stacks and collectives written to {path}",
                      file=sys.stderr, flush=True)
            except Exception as exc:  # the watchdog must never take the job down
                print(f"[megascan] rank {self.rank}: hang dump failed: {exc!r}", file=sys.stderr, flush=True)
            self._notify(True)

    def _notify(self, hung: bool) -> None:
        for listener in self.hang_listeners:
            try:
                listener(hung)
            except Exception:
                pass

    # --- the dump ------------------------------------------------------------------------
    def collective_state(self) -> list[dict[str, Any]]:
        if self.observer is None:
            return []
        now = time.monotonic()
        groups = []
        for info in list(self.observer.groups.values()):
            in_flight = info.in_flight
            last = info.last_completed
            groups.append({
                "name": info.name, "ranks": list(info.ranks), "desc": info.desc, "issued": info.seq,
                "in_flight": None if in_flight is None else
                {"op": in_flight[0], "seq": in_flight[1], "waiting_s": round(now - in_flight[2], 3)},
                "last_completed": None if last is None else {"op": last[0], "seq": last[1]},
            })
        return groups

    def snapshot(self, reason: str) -> dict[str, Any]:
        now = time.monotonic()
        spans = [{"kind": kind, **attrs, "open_s": round(now - since, 3)} for kind, attrs, since in list(self.open_spans)]
        return {
            "type": "hang-dump", "format": DUMP_FORMAT, "version": 1, **self.identity,
            "reason": reason, "wall_ns": time.time_ns(), "timeout_s": self.timeout,
            "stalled_s": round(self.stalled_seconds(), 3), "last_progress": self.last_progress_what,
            "iteration": self.iteration, "dump_index": self.dumps_written,
            "groups": self.collective_state(),
            "p2p_in_flight": [s for s in spans if s["kind"] in P2P_KINDS],
            "open_spans": spans,
            "threads": thread_stacks(),
        }

    def dump(self, reason: str) -> Path:
        path = dump_path(self.directory, self.rank)
        write_json_atomically(path, self.snapshot(reason))
        self.dumps_written += 1
        return path


class _OpenSpan:
    __slots__ = ("watchdog", "entry")

    def __init__(self, watchdog: Watchdog, kind: str, attrs: dict[str, Any]) -> None:
        keep = {k: attrs[k] for k in ("peer", "chunk", "microbatch", "iteration", "direction") if k in attrs}
        self.watchdog = watchdog
        self.entry = (kind, keep, time.monotonic())

    def __enter__(self) -> None:
        self.watchdog.open_spans.append(self.entry)

    def __exit__(self, *exc) -> bool:
        spans = self.watchdog.open_spans
        if spans and spans[-1] is self.entry:
            spans.pop()
        elif self.entry in spans:
            spans.remove(self.entry)
        self.watchdog.progress(self.entry[0])
        return False


class WatchdogSpans:
    """Observer for the spine's spans: keeps the stack of open spans (a blocked `recv` names the
    peer this rank waits for) and counts every finished span as progress."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def span(self, kind: str, **attrs: Any) -> _OpenSpan:
        return _OpenSpan(self.watchdog, kind, attrs)

    def instant(self, kind: str, **attrs: Any) -> None:
        return None

    def collective(self, op: str, group: GroupInfo, seq: int, start_ns: int, end_ns: int) -> None:
        self.watchdog.on_collective(op, group, seq, start_ns, end_ns)


class CrashCapture:
    """Writes uncaught exceptions (any thread) as JSON and fatal signals (faulthandler, all threads)
    as text into the trace dir, named by rank. The previous hooks still run."""

    # Besides SEGV/FPE/ABRT/BUS/ILL, which faulthandler.enable covers: torchrun stops the surviving
    # ranks of a failed job with SIGTERM, and where each was at that moment is worth keeping.
    FATAL_SIGNALS = ("SIGTERM",)

    def __init__(self, directory: str | os.PathLike, identity: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.identity = identity
        self.rank = int(identity["rank"])
        self._previous_excepthook = None
        self._previous_threading_hook = None
        self._fatal_file = None
        self._fatal_header = 0
        self.installed = False

    def install(self) -> "CrashCapture":
        if self.installed:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        self._previous_excepthook = sys.excepthook
        self._previous_threading_hook = threading.excepthook
        sys.excepthook = self._excepthook
        threading.excepthook = self._threading_excepthook
        path = fatal_path(self.directory, self.rank)
        self._fatal_file = open(path, "w")
        header = (f"megascan fatal-signal capture: rank {self.rank} world_size {self.identity.get('world_size')} "
                  f"host {self.identity.get('host')} pid {self.identity.get('pid')}\n")
        self._fatal_file.write(header)
        self._fatal_file.flush()
        self._fatal_header = len(header.encode())
        faulthandler.enable(file=self._fatal_file, all_threads=True)
        for name in self.FATAL_SIGNALS:
            number = getattr(signal, name, None)
            # A signal the program handles itself is left to the program.
            if number is not None and signal.getsignal(number) in (signal.SIG_DFL, None):
                faulthandler.register(number, file=self._fatal_file, all_threads=True, chain=True)
        self.installed = True
        # A process that ends without shutdown (an uncaught exception) must not leave an empty file.
        atexit.register(self._remove_empty_fatal_file)
        return self

    def _remove_empty_fatal_file(self) -> None:
        if self._fatal_file is None:
            return
        path = Path(self._fatal_file.name)
        try:
            if path.stat().st_size <= self._fatal_header:
                path.unlink()
        except OSError:
            pass

    def write_exception(self, exc_type, exc, tb, thread_name: str) -> Path:
        path = crash_path(self.directory, self.rank)
        payload = {"type": "crash", "format": DUMP_FORMAT, "version": 1, **self.identity, "wall_ns": time.time_ns(),
                   "kind": "exception", "thread": thread_name, "exception": getattr(exc_type, "__name__", str(exc_type)),
                   "message": str(exc), "frames": frames_of(traceback.extract_tb(tb)),
                   "text": "".join(traceback.format_exception(exc_type, exc, tb))}
        write_json_atomically(path, payload)
        return path

    def _excepthook(self, exc_type, exc, tb) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            try:
                self.write_exception(exc_type, exc, tb, threading.current_thread().name)
            except Exception:
                pass
        (self._previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)

    def _threading_excepthook(self, hook_args) -> None:
        if hook_args.exc_type is not SystemExit:
            try:
                name = hook_args.thread.name if hook_args.thread is not None else "thread"
                self.write_exception(hook_args.exc_type, hook_args.exc_value, hook_args.exc_traceback, name)
            except Exception:
                pass
        (self._previous_threading_hook or threading.__excepthook__)(hook_args)

    def uninstall(self) -> None:
        """Restore the hooks; remove the fatal-signal file when nothing was written to it."""
        if not self.installed:
            return
        self.installed = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if threading.excepthook == self._threading_excepthook:
            threading.excepthook = self._previous_threading_hook
        for name in self.FATAL_SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                try:
                    faulthandler.unregister(number)
                except (ValueError, RuntimeError):
                    pass
        faulthandler.disable()
        self._fatal_file.close()
        self._remove_empty_fatal_file()
        atexit.unregister(self._remove_empty_fatal_file)


def start_watchdog(directory: str | os.PathLike, identity: dict[str, Any], timeout: float,
                   observer: CollectiveObserver | None) -> tuple[CrashCapture, Watchdog | None]:
    """Crash capture, and for `timeout` > 0 a running watchdog over `observer`'s groups: the same
    for the trainer's plugin and a launched job's ranks, which differ only in how progress reaches
    the watchdog (the spine's observer, or the launcher's collective listener)."""
    crash = CrashCapture(directory, identity).install()
    if timeout <= 0:
        return crash, None
    watchdog = Watchdog(directory=directory, identity=identity, timeout=timeout, observer=observer)
    return crash, watchdog.start()


# ------------------------------------------------------------------------------ trainer plugin


def parse_inject_hang(text: str) -> tuple[int, int, float | None]:
    """`RANK:ITER[:SECONDS]` -> (rank, iteration, seconds or None for forever)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        rank, iteration = int(parts[0]), int(parts[1])
        seconds = float(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ValueError(f"--inject-hang wants RANK:ITER[:SECONDS] (e.g. 1:3), got {text!r}") from None
    if rank < 0 or iteration < 0 or (seconds is not None and seconds <= 0):
        raise ValueError(f"--inject-hang {text}: need RANK >= 0, ITER >= 0, SECONDS > 0")
    return rank, iteration, seconds


def inject_hang(directory: Path, rank: int, iteration: int, seconds: float | None) -> None:
    """Block this rank at the start of `iteration`, before its first collective or P2P. A marker
    file records when, so a test can check how soon every rank dumped."""
    write_json_atomically(Path(directory) / f"hang-injected-rank{rank}.json",
                          {"rank": rank, "iteration": iteration, "wall_ns": time.time_ns(), "seconds": seconds})
    print(f"[megascan] rank {rank}: injected hang at iteration {iteration} "
          f"({'forever' if seconds is None else f'{seconds:g} s'})", file=sys.stderr, flush=True)
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.5)


@register_plugin
class WatchdogPlugin(Plugin):
    """`--hang-timeout`: per-rank watchdog and crash capture (on with --trace or on its own);
    `--inject-hang RANK:ITER`: block one rank, to test it."""

    name = "scan_watchdog"
    flag = "--hang-timeout"
    # The tracer's collective observer is installed first and shared; --trace-dir is its config.
    after = ("scan",)

    def add_arguments(self, parser) -> None:
        g = parser.add_argument_group("MegaScan hang diagnosis")
        g.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                       help=f"dump stacks and collective state when a rank makes no progress for SECONDS "
                            f"(default {DEFAULT_HANG_TIMEOUT_S:g} when --trace is on; 0 turns it off)")
        g.add_argument("--inject-hang", default=None, metavar="RANK:ITER[:SECONDS]",
                       help="testing: RANK blocks at the start of iteration ITER (forever, or SECONDS)")

    def enabled(self, args) -> bool | None:
        if args.hang_timeout == 0:
            return args.inject_hang is not None
        if args.hang_timeout is not None or args.inject_hang:
            return True
        return None  # on when --trace enables it

    def configure(self, cfg) -> None:
        from megatron.app.config import ConfigError

        args = cfg.args
        if args.hang_timeout is not None and args.hang_timeout < 0:
            raise ConfigError(f"--hang-timeout must be >= 0 seconds, got {args.hang_timeout:g}")
        try:
            self.hang = parse_inject_hang(args.inject_hang) if args.inject_hang else None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.timeout = DEFAULT_HANG_TIMEOUT_S if args.hang_timeout is None else args.hang_timeout
        self.directory = shared_trace_config(self.peers, args).directory  # --trace-dir, as the tracer has it
        self.watchdog = None
        self.crash = None

    def setup(self, ctx) -> None:
        from megatron.app.observer import hang as observer_hang
        from megatron.app.observer import set_observer

        identity = process_identity(ctx.rank, ctx.cfg.parallel.world_size,
                                    {"dp": ctx.dp_rank, "pp": ctx.pp_rank, "tp": ctx.tp_rank})
        # Collectives are wrapped (by the tracer, or here) and reported through the spine's observer.
        observer = shared_collective_observer() if self.timeout > 0 else None
        self.crash, self.watchdog = start_watchdog(self.directory, identity, self.timeout, observer)
        if self.watchdog is not None:
            self.spans = WatchdogSpans(self.watchdog)
            set_observer(self.spans)
            self.watchdog.hang_listeners.append(observer_hang)  # every observer learns of a hang

    def before_iteration(self, ctx, iteration: int) -> None:
        if self.watchdog is not None:
            self.watchdog.set_iteration(iteration)
        if self.hang is not None and self.hang[0] == ctx.rank and self.hang[1] == iteration:
            inject_hang(self.directory, ctx.rank, iteration, self.hang[2])

    def after_iteration(self, ctx, iteration: int, metrics) -> None:
        if self.watchdog is not None:
            self.watchdog.progress("iteration")

    def shutdown(self, ctx) -> None:
        from megatron.app.observer import remove_observer

        if self.watchdog is not None:
            self.watchdog.stop()
            remove_observer(self.spans)
        if self.crash is not None:
            self.crash.uninstall()
