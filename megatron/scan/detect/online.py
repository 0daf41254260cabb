"""`--online-detect`: during a traced run, rank 0 re-runs the detectors after every traced window
on the newest traced iterations (--online-detect-history; a recent onset is tested against each
rank's earlier standing), in a process of its own at low priority (off the training critical path
and off rank 0's interpreter lock), logs each suspect with its evidence as a warning and writes
DIR/online_abnormal.json. A suspect only one analyzer names is reported once consecutive analyses
agree on it (Confirmation)."""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megatron.app.config import ConfigError
from megatron.app.plugins import Plugin, register_plugin
from megatron.scan.detect.online_settings import (CONFIRM_ANALYSES, HISTORY, HISTORY_RANK_ITERATIONS,  # noqa: F401
                                                  MIN_HISTORY, MIN_ITERATIONS, MIN_SLOWDOWN, RECENT_ITERATIONS,
                                                  Confirmation, default_history)

if TYPE_CHECKING:
    from megatron.scan.detect.incremental import WindowedInput


@contextlib.contextmanager
def _without_cyclic_gc():
    """The cyclic garbage collector paused: an analysis makes millions of short-lived objects
    (the parsed lines) beside many long-lived ones, and the collector's passes over them took
    about 0.2 s of the analyzers and report at 4,096 ranks (1.54-1.69 s with it, 1.34-1.49 s
    paused). Reference counting frees nearly all of them; the rest waits for the collector's
    next pass after the analysis."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def analyze(trace_dir: str | os.PathLike, first_iteration: int, last_iteration: int,
            fitted: dict[tuple[int, int], tuple[float, float]] | None = None, *,
            min_slowdown: float | None = MIN_SLOWDOWN, source: WindowedInput | None = None) -> dict | None:
    """One online analysis of what `source` holds (else of everything traced so far): the
    abnormal.json dict with `iterations`,
    and `alerts` (each with its printable `label`); None before MIN_ITERATIONS. `source` (kept
    across analyses) reads, matches and aligns each window once; without it, or for a directory
    it does not cover (a torchrun restart's attempts), the directory is read whole. Then
    `fitted` (updated in place) keeps the clock corrections of the windows every rank has
    written, so that each analysis fits only the new windows: fitting them all again was most of
    an analysis's cost (0.14 of 0.23 s at 24 windows of 4 ranks, and growing with the run), CPU
    taken from a busy host's training. `min_slowdown`: the compute analyzer's factor over a
    rank's peers below which it names nobody."""
    from megatron.scan.detect.combine import detect
    from megatron.scan.detect.compute import peer_comparison
    from megatron.scan.detect.host import host_starvation
    from megatron.scan.detect.report import as_dict

    with _without_cyclic_gc():
        data = source.build() if source is not None else None
        if data is None:
            data = _whole(trace_dir, fitted)
        if len(np.unique(data.compute["iteration"])) < MIN_ITERATIONS:
            return None  # the first iterations (warm-up) alone are no baseline
        # Everything traced so far: a fault that began in the recent windows shows as an onset
        # against each rank's own earlier standing, not only once it dominates the history.
        detection = detect(data, compute=functools.partial(peer_comparison, min_slowdown=min_slowdown),
                           host=functools.partial(host_starvation, recent=RECENT_ITERATIONS))
        result = as_dict(detection)
    # The files may already hold windows newer than the one that asked (an analysis that lagged):
    # name the newest iteration actually seen.
    newest = max(last_iteration, int(data.compute["iteration"].max()))
    result["iterations"] = [min(first_iteration, newest), newest]
    result["history"] = [int(data.compute["iteration"].min()), newest]  # the traced iterations analysed
    result["alerts"] = [
        {"iteration": newest, "kind": suspect.kind, "ranks": suspect.ranks, "confidence": suspect.confidence,
         "evidence": suspect.evidence, "slowdown": suspect.slowdown, "named_by": suspect.named_by,
         "label": suspect.describe(data)}
        for suspect in detection.suspects]
    return result


def _whole(trace_dir: str | os.PathLike, fitted: dict[tuple[int, int], tuple[float, float]] | None):
    """The detection input of the directory read whole (the clock fits in `fitted` reused)."""
    from megatron.scan.aggregate import aggregate
    from megatron.scan.align import fitted_windows
    from megatron.scan.detect.model import from_aggregation

    aggregation = aggregate(trace_dir, None, jobs=1, fitted=fitted)
    if fitted is not None:
        written = min((len(metas) for metas in aggregation.trace.windows.values()), default=0)
        fitted.update(fitted_windows(aggregation.alignment, written))
    return from_aggregation(aggregation)


def serve() -> None:
    """The analysis process (`OnlineDetector` starts it): one JSON request per line on stdin
    (windows finished, first and last iteration), one JSON answer per line on the original
    stdout; anything printed goes to stderr. Each request carries the thresholds in force (they
    can change while the job runs: `python -m megatron.scan capture --online-detect-confirm`). It ends when stdin closes: when rank 0 closes it,
    or when rank 0 dies (the pipe closes with it, so nothing is left behind)."""
    from megatron.scan.detect.incremental import WindowedInput
    from megatron.scan.load import retain_freed_memory
    from megatron.scan.tail import DirectoryTail

    retain_freed_memory()  # this process only analyses: arrays reused, not faulted in again each time
    trace_dir, world_size, wait_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    history = int(sys.argv[4]) or None  # 0: every traced iteration
    confirm = Confirmation()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    windows = DirectoryTail(trace_dir)  # parsed as it is polled: each window is read once
    source = WindowedInput(trace_dir, tail=windows, history=history)
    fitted: dict[tuple[int, int], tuple[float, float]] = {}
    for line in sys.stdin:
        windows_done, first_iteration, last_iteration, settings = json.loads(line)
        confirm.analyses = settings["confirm"]
        try:
            # Waiting for the other ranks' windows happens here too, not in rank 0, whose
            # training it slowed (the throttled rank's windows come late, and rank 0 polled).
            windows.wait_for(world_size, windows_done, wait_s)
            result = analyze(trace_dir, first_iteration, last_iteration, fitted,
                             min_slowdown=settings["min_slowdown"], source=source)
            if result is not None:
                result["alerts"], result["unconfirmed"] = confirm(result["alerts"])
                result["settings"] = settings
        except Exception as exc:  # noqa: BLE001 - a failed analysis must never stop training
            result = {"error": repr(exc)}
        answers.write(json.dumps(result) + "\n")
        answers.flush()


# The analysis process's priority: CPU left over by training, not a share of a busy host. Linux's
# SCHED_IDLE runs it only on a CPU no training thread wants (at nice 10 it still competed: in a run
# on 4 ranks over 2 cores rank 0's run-queue wait doubled while windows were analysed); elsewhere
# nice ANALYSIS_NICE. The process lowers itself first thing, before any import.
ANALYSIS_NICE = 10
_BOOT = f"""import os
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice({ANALYSIS_NICE})
from megatron.scan.detect.online import serve
serve()
"""


class OnlineDetector:
    """A thread of rank 0 that hands each request (windows finished, iterations of the newest
    windows) to the analysis process and reports its answer; training never waits for either.

    The analysis process is a fresh interpreter that imports only the analysis code (a
    multiprocessing child re-imported the trainer's main module, torch and megatron.core: about
    3 s of CPU at full priority beside rank 0, which then was named slow in the first window,
    measured on 4 ranks over 2 cores), at idle CPU priority from its first line (_BOOT)."""

    def __init__(self, trace_dir: str | os.PathLike, world_size: int, *, windows_kept: int = 2,
                 wait_s: float = 30.0, confirm: int = CONFIRM_ANALYSES,
                 min_slowdown: float | None = MIN_SLOWDOWN, history: int | None = None) -> None:
        self.trace_dir = Path(trace_dir)
        self.world_size = world_size
        self.windows_kept = windows_kept
        self.wait_s = wait_s
        self.max_backlog = 8
        self.settings = {"confirm": confirm, "min_slowdown": min_slowdown}
        self.requests: queue.Queue = queue.Queue()
        self.alerts: list[dict] = []
        self._said = None  # the last verdict printed (and its power line): said again only when it changes
        root = str(Path(__file__).resolve().parents[3])  # where this package is imported from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.worker = subprocess.Popen(
            [sys.executable, "-c", _BOOT, os.fspath(self.trace_dir), str(world_size), str(wait_s),
             str(default_history(world_size) if history is None else history)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        self.thread = threading.Thread(target=self._loop, name="megascan-online-detect", daemon=True)
        self.thread.start()

    def submit(self, windows_done: int, first_iteration: int, last_iteration: int) -> None:
        self.requests.put((windows_done, first_iteration, last_iteration, dict(self.settings)))

    def update(self, settings: dict) -> dict:
        """New thresholds (a capture request's), used from the next analysis on; returns those in force."""
        self.settings = {**self.settings, **settings}
        print(f"[megascan] online detection settings changed: {settings}", file=sys.stderr, flush=True)
        return dict(self.settings)

    def close(self, timeout: float = 60.0) -> None:
        self.requests.put(None)
        self.thread.join(timeout)
        try:
            self.worker.stdin.close()  # the analysis process's end of input: it exits
        except OSError:
            pass
        try:
            self.worker.wait(10)
        except subprocess.TimeoutExpired:  # an analysis still running when training ended
            self.worker.kill()
            self.worker.wait()
        self.worker.stdout.close()

    def _loop(self) -> None:
        while True:
            request = self.requests.get()
            # Every window is analyzed in order (so an onset is reported for the window where it
            # shows), unless the analysis falls far behind training: then only the newest counts.
            while request is not None and self.requests.qsize() > self.max_backlog:
                request = self.requests.get()
            if request is None:
                return
            try:
                self._run(*request)
            except Exception as exc:  # noqa: BLE001 - a failed analysis must never stop training
                print(f"[megascan] online detection failed: {exc!r}", file=sys.stderr, flush=True)

    def _run(self, windows_done: int, first_iteration: int, last_iteration: int, settings: dict) -> None:
        try:
            self.worker.stdin.write(json.dumps([windows_done, first_iteration, last_iteration, settings]) + "\n")
            self.worker.stdin.flush()
            answer = self.worker.stdout.readline()
        except (BrokenPipeError, ValueError):
            answer = ""
        if not answer:
            raise RuntimeError(f"the analysis process ended (exit status {self.worker.poll()})")
        result = json.loads(answer)
        if result is None:
            return
        if "error" in result:
            raise RuntimeError(result["error"])
        for alert in result.pop("alerts"):
            label, slowdown = alert.pop("label"), alert.pop("slowdown")
            self.alerts.append(alert)
            first, newest = result["iterations"]
            why = (" and ".join(alert["named_by"]) if len(alert["named_by"]) >= 2
                   else f"{'/'.join(alert['named_by']) or 'found'} in {alert['analyses']} analyses in a row")
            # A rank with no peer to compare its compute with (PP only) has no slowdown figure.
            factor = f"{slowdown:.2f}x" if slowdown == slowdown else "slowdown not measurable"
            print(f"[megascan] WARNING online detection (iterations {first}-{newest}): {label} is "
                  f"slow, {factor}, confidence {alert['confidence']:.2f} ({why}): {alert['evidence'][0]}",
                  file=sys.stderr, flush=True)
        self._say_verdict(result)
        result["alerts_so_far"] = self.alerts
        path = self.trace_dir / "online_abnormal.json"
        temporary = path.with_name(".online_abnormal.json.tmp")
        temporary.write_text(json.dumps(result, indent=1))
        os.replace(temporary, path)


    def _say_verdict(self, result: dict) -> None:
        """A verdict without a suspect is printed when it changes: `healthy` with what it could
        have seen, `inconclusive` with its leading candidate and how many more iterations it needs."""
        if result.get("verdict") not in ("healthy", "inconclusive"):
            self._said = None
            return
        power, leading = result.get("power") or {}, result.get("leading_candidate") or {}
        said = (result["verdict"], power.get("enough"), leading.get("rank"))
        if said == self._said:
            return
        self._said = said
        first, newest = result["iterations"]
        parts = [power["line"]] if power.get("line") else []
        if leading:
            parts.append(f"leading candidate (not named): {leading['text']}")
        print(f"[megascan] online detection (iterations {first}-{newest}): {result['verdict']}"
              f"{': ' if parts else ''}{'; '.join(parts)}", file=sys.stderr, flush=True)


@register_plugin
class OnlineDetectPlugin(Plugin):
    """`--online-detect`: rank 0 analyses each traced window as it lands (needs --trace)."""

    name = "online_detect"
    flag = "--online-detect"
    requires = ("scan",)  # it reads the windows the tracer writes

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("MegaScan online detection")
        g.add_argument("--online-detect", action="store_true",
                       help="with --trace: after every traced window, rank 0 runs slow-rank detection on what is traced so "
                            "far (recent onsets against each rank's earlier iterations) "
                            "in a background thread, warns about suspects, writes DIR/online_abnormal.json")
        g.add_argument("--online-detect-confirm", type=int, default=CONFIRM_ANALYSES, metavar="N",
                       help="with --online-detect: a suspect only one analyzer names (compute, CPU starvation, "
                            "collective arrival, pipeline link) is reported once N analyses in a row name it; two "
                            "analyzers agreeing report it at once. 1 reports every finding at once (more wrong "
                            f"alerts from bursts of host load). Default {CONFIRM_ANALYSES}")
        g.add_argument("--online-detect-min-slowdown", type=float, default=MIN_SLOWDOWN, metavar="X",
                       help="with --online-detect: a rank's compute must be at least X times its peers' to be named "
                            "by the compute analyzer. Default: from the measured noise, 1.05 where an iteration is "
                            "measured to within 5%% (GPU ranks) up to 1.2 on a noisy host (6%% or more). Both thresholds can be "
                            "changed on a "
                            "running job: python -m megatron.scan capture --job DIR --online-detect-confirm N "
                            "--online-detect-min-slowdown X")
        g.add_argument("--online-detect-history", type=int, default=None, metavar="N",
                       help="with --online-detect: each analysis covers the newest traced windows holding at least N "
                            "traced iterations; older windows are let go, so that a long run's analyses keep to a "
                            "bounded memory and time (a rank slow since before then is still compared with its "
                            f"peers). 0 keeps every traced iteration. Default {HISTORY}, fewer where ranks x N would "
                            f"pass {HISTORY_RANK_ITERATIONS} (20 at 4,096 ranks), never below {MIN_HISTORY}")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "online_detect", False))

    def configure(self, cfg) -> None:
        args = cfg.args
        if args.online_detect_confirm < 1:
            raise ConfigError(f"--online-detect-confirm {args.online_detect_confirm}: a suspect needs at least 1 "
                              f"analysis to be reported (1 reports at once)")
        if args.online_detect_min_slowdown is not None and not args.online_detect_min_slowdown >= 1.0:
            raise ConfigError(f"--online-detect-min-slowdown {args.online_detect_min_slowdown}: a factor over the "
                              f"rank's peers, >= 1.0")
        if args.online_detect_history is not None and 0 != args.online_detect_history < MIN_ITERATIONS:
            raise ConfigError(f"--online-detect-history {args.online_detect_history}: an analysis gives a verdict from "
                              f"{MIN_ITERATIONS} traced iterations on; use at least {MIN_ITERATIONS} (0 keeps every one)")
        self.confirm = args.online_detect_confirm
        self.history = args.online_detect_history  # None: default_history of the job's size
        self.min_slowdown = args.online_detect_min_slowdown
        trace = self.peers["scan"].config  # configured before this plugin (it is required)
        self.interval = trace.interval  # the windows it analyses, from the tracer's typed config
        self.continuous = trace.continuous
        self.trace_dir = trace.directory
        self.granularity = trace.granularity
        self.detector: OnlineDetector | None = None
        self.windows: list[tuple[int, int]] = []
        self._window_start: int | None = None

    def setup(self, ctx) -> None:
        # Rank 0 reads every rank's files (one node, or a shared file system).
        if ctx.rank == 0:
            parallel = ctx.cfg.parallel
            if (self.granularity != "full" and parallel.pipeline_model_parallel_size > 1
                    and parallel.data_parallel_size == 1 and parallel.tensor_model_parallel_size == 1):
                # Measured on a 2-core host under background load: a healthy lone stage named in 5 of
                # 8 runs without layer spans, 1 of 11 with (docs/megascan-detection.md, *Not yet*).
                print("[megascan] note: with DP = TP = 1 no pipeline stage has a peer; without per-layer spans "
                      "online detection compares each rank with its own earlier iterations only (onsets, which "
                      "host noise also makes). --trace-granularity full lets the stages be compared layer by layer",
                      file=sys.stderr, flush=True)
            self.detector = OnlineDetector(self.trace_dir, ctx.cfg.parallel.world_size,
                                           confirm=self.confirm, min_slowdown=self.min_slowdown,
                                           history=self.history)
            # Threshold changes asked of the running job arrive with capture requests.
            self.peers["scan"].control.listen_for_settings(self.detector.update)

    def after_iteration(self, ctx, iteration: int, metrics) -> None:
        if self.detector is None:
            return
        done = iteration
        schedule = self.peers["scan"].tracer.schedule  # the dense start, windows and captures alike
        if self._window_start is None and schedule.is_traced(done):
            self._window_start = done
        if self._window_start is None or not schedule.is_window_end(done):
            return
        self.windows.append((self._window_start, done))
        self._window_start = None
        if sum(last - first + 1 for first, last in self.windows) < MIN_ITERATIONS:
            # analyze() gives no verdict before then: asking would only load the traces beside
            # training.
            return
        kept = self.windows[-self.detector.windows_kept:]
        self.detector.submit(len(self.windows), kept[0][0], done)

    def shutdown(self, ctx) -> None:
        if self.detector is not None:
            self.detector.close()
