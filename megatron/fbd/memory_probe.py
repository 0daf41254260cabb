"""A small measurement plugin used by benchmarks/fbd.py: each rank's resident memory before the
model exists and its peak afterwards, its role, and its iteration times, written as JSON."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron.app.plugins import Plugin, register_plugin


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


@register_plugin
class MemoryProbe(Plugin):
    """`--memory-probe DIR`: write DIR/rank{N}.json at shutdown."""

    name = "memory_probe"
    flag = "--memory-probe"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument_group("memory probe").add_argument(
            "--memory-probe", default=None, metavar="DIR",
            help="write each rank's resident memory, role and iteration times to DIR/rank{N}.json at the end")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(args.memory_probe)

    def configure(self, cfg) -> None:
        # Import the model code first so that its module memory is not counted as model memory.
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

        self.out = Path(cfg.args.memory_probe)
        self.before_kib = _status_kib("VmRSS")
        self.times: list[float] = []

    def after_iteration(self, ctx, iteration: int, metrics) -> None:
        self.times.append(metrics["iteration_time"])

    def shutdown(self, ctx) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"rank": ctx.rank, "role": ctx.role or "baseline", "before_kib": self.before_kib,
                  "peak_kib": _status_kib("VmHWM"), "iteration_times": self.times}
        (self.out / f"rank{ctx.rank}.json").write_text(json.dumps(record))
