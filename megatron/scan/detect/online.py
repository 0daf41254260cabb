"""`--online-detect`: during a traced run, rank 0 re-runs the detectors after every traced window
in a background thread (off the training critical path) on everything traced so far (a recent
onset is tested against each rank's earlier standing), logs each suspect with its evidence as a
warning and writes DIR/online_abnormal.json."""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

from megatron.app.config import ConfigError
from megatron.app.plugins import Plugin, register_plugin


# Traced iterations before the first online verdict: with fewer, one rank's persistent share of a
# busy host in the first iterations was named (measured on 4 ranks over 2 cores).
MIN_ITERATIONS = 6


def _windows_on_disk(directory: Path) -> dict[str, int]:
    counts = {}
    for path in directory.glob("benchmark-data-*.json"):
        try:
            with open(path, "rb") as f:
                counts[path.name] = sum(1 for line in f if line.startswith(b'{"type":"window"'))
        except OSError:
            counts[path.name] = 0
    return counts


class OnlineDetector:
    """One worker thread; a request is the number of windows finished and the iterations to keep."""

    def __init__(self, trace_dir: str, world_size: int, windows_kept: int = 2, wait_s: float = 30.0) -> None:
        self.trace_dir = Path(trace_dir)
        self.world_size = world_size
        self.windows_kept = windows_kept
        self.wait_s = wait_s
        self.max_backlog = 8
        self.requests: queue.Queue = queue.Queue()
        self.alerts: list[dict] = []
        self.thread = threading.Thread(target=self._loop, name="megascan-online-detect", daemon=True)
        self.thread.start()

    def submit(self, windows_done: int, first_iteration: int, last_iteration: int) -> None:
        self.requests.put((windows_done, first_iteration, last_iteration))

    def close(self, timeout: float = 60.0) -> None:
        self.requests.put(None)
        self.thread.join(timeout)

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

    def _run(self, windows_done: int, first_iteration: int, last_iteration: int) -> None:
        from megatron.scan.aggregate import aggregate
        from megatron.scan.detect.combine import detect
        from megatron.scan.detect.model import from_aggregation
        from megatron.scan.detect.report import as_dict

        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:  # other ranks' writers append their window a little later
            counts = _windows_on_disk(self.trace_dir)
            if len(counts) >= self.world_size and min(counts.values()) >= windows_done:
                break
            time.sleep(0.2)
        data = from_aggregation(aggregate(self.trace_dir, None, jobs=1))
        if len(np.unique(data.compute["iteration"])) < MIN_ITERATIONS:
            return  # the first iterations (warm-up) alone are no baseline
        # Everything traced so far: a fault that began in the recent windows shows as an onset
        # against each rank's own earlier standing, not only once it dominates the history.
        detection = detect(data)
        result = as_dict(detection)
        result["iterations"] = [first_iteration, last_iteration]
        for suspect in detection.suspects:
            what = (data.label(suspect.ranks[0]) if suspect.kind == "rank"
                    else f"link {suspect.ranks[0]} -> {suspect.ranks[1]}")
            alert = {"iteration": last_iteration, "kind": suspect.kind, "ranks": suspect.ranks,
                     "confidence": suspect.confidence, "evidence": suspect.evidence}
            self.alerts.append(alert)
            print(f"[megascan] WARNING online detection (iterations {first_iteration}-{last_iteration}): {what} is "
                  f"slow, {suspect.slowdown:.2f}x, confidence {suspect.confidence:.2f}: {suspect.evidence[0]}",
                  file=sys.stderr, flush=True)
        result["alerts_so_far"] = self.alerts
        path = self.trace_dir / "online_abnormal.json"
        temporary = path.with_name(".online_abnormal.json.tmp")
        temporary.write_text(json.dumps(result, indent=1))
        os.replace(temporary, path)


@register_plugin
class OnlineDetectPlugin(Plugin):
    name = "online_detect"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("MegaScan online detection")
        g.add_argument("--online-detect", action="store_true",
                       help="with --trace: after every traced window, rank 0 runs slow-rank detection on what is traced so "
                            "far (recent onsets against each rank's earlier iterations) "
                            "in a background thread, warns about suspects, writes DIR/online_abnormal.json")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "online_detect", False))

    def configure(self, cfg) -> None:
        args = cfg.args
        if not getattr(args, "trace", False):
            raise ConfigError("--online-detect reads the traced windows: add --trace (and --trace-dir)")
        self.interval = args.trace_interval
        self.continuous = args.continuous_trace_iterations
        self.trace_dir = args.trace_dir
        self.detector: OnlineDetector | None = None
        self.windows: list[tuple[int, int]] = []

    def setup(self, ctx) -> None:
        # Rank 0 reads every rank's files (one node, or a shared file system).
        if ctx.rank == 0:
            self.detector = OnlineDetector(self.trace_dir, ctx.cfg.parallel.world_size)

    def after_iteration(self, ctx, iteration: int, metrics) -> None:
        if self.detector is None:
            return
        done = iteration - 1  # the spine passes the count of finished iterations
        if done % self.interval != self.continuous - 1:
            return
        self.windows.append((done - self.continuous + 1, done))
        kept = self.windows[-self.detector.windows_kept:]
        self.detector.submit(len(self.windows), kept[0][0], done)

    def shutdown(self, ctx) -> None:
        if self.detector is not None:
            self.detector.close()
