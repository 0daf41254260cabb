"""`--straggler-mitigation`: when a rank is slow, the trainer works around it.

Every iteration each rank measures its forward and backward time per microbatch (the compute
rate MegaScan's detectors use) and the ranks exchange it in one small all-gather, off the trace.
From those rates every rank computes the same decision (megatron.mitigation.balance):

- data parallelism: a slow replica (as slow as its slowest TP / PP member) runs fewer of the
  global batch's microbatches and the others more; the global batch, its samples and the
  optimizer step stay those of the even split (megatron.app.microbatches);
- pipeline: where data parallelism cannot absorb a slow stage (DP=1, or the same stage slow in
  every replica), a layer split that moves layers off the slow stage is recommended, written to
  `--save`/mitigation.json and applied (with the checkpoint converted) when the job restarts.

Each change is one `[mitigation]` log line, a Prometheus series (with --metrics-port), and an
instant event plus a per-iteration microbatch count in the trace (with --trace); the end of
training prints a summary with the time saved, predicted and measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.app.config import ConfigError
from megatron.app.logs import print_rank_0
from megatron.app.microbatches import MicrobatchPlan
from megatron.app.observer import get_observer, remove_observer, set_observer
from megatron.app.plugins import Plugin, register_plugin
from megatron.mitigation.balance import Decision, Rebalancer, split_layers, stage_cost
from megatron.scan.speed import ComputeClock, reference_seconds, relative_speed

RECOMMENDATION_FILE = "mitigation.json"
WARMUP_ITERATIONS = 2  # measured but not used: the first iterations of a run are slow on every rank


@dataclass(frozen=True, slots=True)
class MitigationConfig:
    threshold: float  # a new plan must be predicted this much faster (fraction)
    patience: int  # in this many consecutive measurements
    window: int  # measurements whose median is used
    save: str | None  # where the layer-split recommendation goes (--save)


@dataclass
class Ledger:
    """What the summary reports."""

    changes: int = 0
    rebalanced: int = 0  # iterations run under an uneven plan
    predicted_saving: float = 0.0  # seconds: sum over those of (even plan - plan), what-if model
    predicted_even: list[float] = field(default_factory=list)
    predicted_plan: list[float] = field(default_factory=list)
    straggling_even: list[float] = field(default_factory=list)  # measured s/it: straggler present, even split
    mitigated: list[float] = field(default_factory=list)  # measured s/it under an uneven plan
    recommendation: tuple[int, ...] | None = None
    own_seconds: float = 0.0  # spent in the exchange and the decisions (on rank 0)
    iterations: int = 0
    iteration_seconds: float = 0.0


@register_plugin
class MitigationPlugin(Plugin):
    name = "mitigation"
    flag = "--straggler-mitigation"
    after = ("scan", "scan_metrics")  # the tracer and metrics exist by setup and see this iteration first
    conflicts = {"fbd": "MegaFBD's forward and backward roles run fixed per-microbatch action lists, so a "
                        "replica's microbatch count cannot change; drop one of the two flags"}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("straggler mitigation")
        g.add_argument("--straggler-mitigation", action="store_true",
                       help="work around slow ranks: slow data-parallel replicas get fewer of the global batch's "
                            "microbatches (same samples and step); a slow pipeline stage gets a layer-split "
                            "recommendation applied at restart")
        g.add_argument("--mitigation-threshold", type=float, default=0.1, metavar="FRACTION",
                       help="change the plan only when predicted faster by more than this fraction (default 0.1)")
        g.add_argument("--mitigation-patience", type=int, default=3, metavar="N",
                       help="... in N consecutive iterations (default 3)")
        g.add_argument("--mitigation-window", type=int, default=8, metavar="N",
                       help="decide on the median of the last N iterations' measured rates (default 8)")

    def enabled(self, args: argparse.Namespace) -> bool:
        return bool(args.straggler_mitigation)

    def configure_layout(self, cfg):
        """Restarting from a checkpoint whose run recommended a layer split: take it, unless the
        command line names one (the checkpoint is converted as it is loaded)."""
        load = cfg.checkpoint.load
        if not load or getattr(cfg.parallel, "pipeline_layer_split", None):
            return
        path = Path(load) / RECOMMENDATION_FILE
        if not path.is_file():
            return
        try:
            saved = json.loads(path.read_text())
            split = tuple(int(n) for n in saved["pipeline_layer_split"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} is not a layer-split recommendation ({exc}); delete it to start without "
                              "one") from None
        if len(split) != cfg.parallel.pipeline_model_parallel_size or sum(split) != cfg.model.num_layers:
            print_rank_0(f"[mitigation] ignoring {path}: its split {_csv(split)} is not for "
                         f"{cfg.model.num_layers} layers on {cfg.parallel.pipeline_model_parallel_size} stages")
            return
        print_rank_0(f"[mitigation] applying --pipeline-layer-split {_csv(split)} recommended at iteration "
                     f"{saved.get('iteration', '?')} ({saved.get('reason', 'slow stage')}); the checkpoint is "
                     "converted as it loads")
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_layer_split=split))

    def configure(self, cfg) -> None:
        args = cfg.args
        if not 0 < args.mitigation_threshold < 1:
            raise ConfigError(f"--mitigation-threshold must be in (0, 1), got {args.mitigation_threshold}")
        for flag, value in (("--mitigation-patience", args.mitigation_patience),
                            ("--mitigation-window", args.mitigation_window)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        self.config = MitigationConfig(threshold=args.mitigation_threshold, patience=args.mitigation_patience,
                                       window=args.mitigation_window, save=cfg.checkpoint.save)

    def setup(self, ctx) -> None:
        cfg = ctx.cfg
        p = cfg.parallel
        self.dp, self.pp = p.data_parallel_size, p.pipeline_model_parallel_size
        self.nominal = cfg.num_microbatches
        chunks = cfg.num_chunks
        # The interleaved schedule runs microbatches in groups of pp.
        granularity = self.pp if chunks > 1 else 1
        self.rebalancer = Rebalancer(self.dp, self.nominal, bubble=(self.pp - 1) / chunks, granularity=granularity,
                                     threshold=self.config.threshold, patience=self.config.patience,
                                     window=self.config.window)
        self.plan = MicrobatchPlan.even(self.dp, self.nominal)  # what plan_iteration hands the trainer
        self.clock = ComputeClock(ctx.backend.device)
        set_observer(self.clock)
        self.device = ctx.backend.device
        self.ledger = Ledger()
        self.stage_history: list[tuple[float, ...]] = []
        self.rank_history: deque[list[float]] = deque(maxlen=self.config.window)  # for the log line
        self.announce = False  # mark the next iteration (a new plan's first) in the trace
        self.gauges = self._gauges(ctx)
        self.first_iteration = ctx.iteration
        if self.dp == 1 and self.pp == 1:
            print_rank_0("[mitigation] one replica of one stage: nothing to rebalance (measuring only)")

    def _gauges(self, ctx):
        r = getattr(self.peers.get("scan_metrics"), "registry", None)  # the metrics plugin's, once set up
        if r is None:
            return None
        from prometheus_client import Counter, Gauge

        rank = str(ctx.rank)
        gauges = {
            "share": Gauge("megascan_mitigation_microbatches", "microbatches of the global batch this rank's "
                           "data-parallel replica runs per iteration", ["rank"], registry=r).labels(rank),
            "speed": Gauge("megascan_mitigation_replica_speed", "this replica's measured speed relative to the "
                           "fastest replica (1 = as fast, 0.5 = half speed)", ["rank"], registry=r).labels(rank),
            "changes": Counter("megascan_mitigation_changes", "plan changes made by straggler mitigation",
                               ["rank"], registry=r).labels(rank),
            "saving": Gauge("megascan_mitigation_predicted_saving_seconds", "per iteration: predicted compute "
                            "seconds of the even split minus the current plan's", ["rank"], registry=r).labels(rank),
        }
        gauges["share"].set(self.nominal)
        gauges["speed"].set(1.0)
        return gauges

    def plan_iteration(self, ctx, iteration: int, plan: MicrobatchPlan) -> MicrobatchPlan:
        """The replicas' shares of the global batch for this iteration: the last decision's."""
        return self.plan

    def before_iteration(self, ctx, iteration: int) -> None:
        if self.announce:
            # Marks the first iteration of a new plan in the trace (the "microbatches" counter shows it).
            get_observer().instant("mitigation", microbatch=-1)
            self.announce = False

    def after_iteration(self, ctx, iteration: int, metrics: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            self._after_iteration(ctx, iteration, metrics)
        finally:
            self.ledger.own_seconds += time.perf_counter() - started
            self.ledger.iterations += 1
            self.ledger.iteration_seconds += float(metrics.get("iteration_time") or 0.0)

    def _after_iteration(self, ctx, iteration: int, metrics: dict[str, Any]) -> None:
        # This rank's speed, as detection and the metrics define it: compute seconds per microbatch
        # of this replica's share in the iteration just run.
        per_microbatch = self.clock.take_per_microbatch(self.plan.count(ctx.dp_rank))
        mine = [float(ctx.dp_rank), float(ctx.pp_rank), per_microbatch, float(metrics["iteration_time"])]
        rows = self._gather(mine)
        if iteration - self.first_iteration < WARMUP_ITERATIONS:
            return  # allocation and first-touch costs: not a rank's speed
        self.rank_history.append([row[2] for row in rows])
        per_rank = [statistics.median(column) for column in zip(*self.rank_history)]
        replica_times = [max(row[2] for row in rows if int(row[0]) == d) for d in range(self.dp)]
        decision = self.rebalancer.observe(replica_times, rows[0][3])
        self._account(iteration, rows[0][3])
        if decision is not None:
            self._apply(ctx, iteration, decision, per_rank)
        if self.pp > 1:
            self._consider_layers(ctx, iteration, rows)
        if self.gauges is not None:
            self.gauges["speed"].set(relative_speed(self.rebalancer.times, reference="fastest")[ctx.dp_rank])
            self.gauges["saving"].set(self.rebalancer.predicted(self._even) - self.rebalancer.predicted())

    @property
    def _even(self) -> tuple[int, ...]:
        return (self.nominal,) * self.dp

    def _gather(self, values: list[float]) -> list[list[float]]:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [values]
        from megatron.scan.collectives import untraced

        # The unwrapped collective: this bookkeeping is not the training job's (it stays out of the
        # trace, its sequence numbers and the hang watchdog's view).
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        untraced(dist.all_gather)(out, mine)
        return [t.tolist() for t in out]

    def _account(self, iteration: int, iteration_time: float) -> None:
        r, ledger = self.rebalancer, self.ledger
        if not r.times:
            return
        even = r.predicted(self._even)
        if r.shares != self._even:
            ledger.rebalanced += 1
            ledger.predicted_saving += even - r.predicted()
            ledger.predicted_even.append(even)
            ledger.predicted_plan.append(r.predicted())
            ledger.mitigated.append(iteration_time)
        else:
            best = r.best()
            if r.predicted(best) < even * (1 - r.threshold):
                ledger.straggling_even.append(iteration_time)

    def _apply(self, ctx, iteration: int, decision: Decision, per_rank: list[float]) -> None:
        self.plan = MicrobatchPlan(shares=decision.shares, nominal=self.nominal)
        self.ledger.changes += 1
        self.announce = True
        typical, speeds = reference_seconds(per_rank) or 0.0, relative_speed(per_rank)
        slow = sorted((speeds[rank], rank) for rank, t in enumerate(per_rank)
                      if t > 0 and t > typical * (1 + self.config.threshold))
        who = "; ".join(f"rank {rank} at {speed:.2f}x" for speed, rank in slow[:4]) or \
              f"every rank within {self.config.threshold:.0%} of the median"
        back = " back to even" if decision.shares == self._even else ""
        if decision.undone is not None:
            before, after = decision.undone
            print_rank_0(f"[mitigation] iteration {iteration + 2}: DP shares{back} {_csv(decision.shares)} "
                         f"microbatches; undoing the last change, which made iterations slower ({before:.3f} -> "
                         f"{after:.3f} s); next change no sooner than {self.rebalancer.hold_off} iterations "
                         f"(predicted {decision.predicted_before:.3f} -> {decision.predicted_after:.3f} s)")
        else:
            print_rank_0(f"[mitigation] iteration {iteration + 2}: DP shares{back} {_csv(decision.shares)} "
                         f"microbatches; {who} (predicted {decision.predicted_before:.3f} -> "
                         f"{decision.predicted_after:.3f} s of compute per iteration)")
        if self.gauges is not None:
            self.gauges["share"].set(decision.shares[ctx.dp_rank])
            self.gauges["changes"].inc()

    def _consider_layers(self, ctx, iteration: int, rows: list[list[float]]) -> None:
        """A slow stage data parallelism leaves in place: recommend moving layers off it."""
        split = _current_split(ctx.cfg)
        # Seconds per microbatch of each stage: its slowest TP rank, the median over the replicas.
        stage_times = []
        for stage in range(self.pp):
            by_replica = [max(row[2] for row in rows if int(row[0]) == d and int(row[1]) == stage) for d in range(self.dp)]
            stage_times.append(statistics.median(by_replica))
        self.stage_history.append(tuple(stage_times))
        self.stage_history = self.stage_history[-self.config.window:]
        r = self.rebalancer
        if len(self.stage_history) < self.config.window or r.shares != self._even:
            return  # still measuring, or data parallelism is absorbing it
        best_dp = r.best()
        if r.predicted(best_dp) < r.predicted() * (1 - r.threshold):
            return  # the rebalancer will act on it
        times = [statistics.median(column) for column in zip(*self.stage_history)]
        per_layer = [t / n for t, n in zip(times, split)]
        recommended = split_layers(sum(split), per_layer, unit=ctx.cfg.num_chunks)
        now, then = stage_cost(split, per_layer), stage_cost(recommended, per_layer)
        if recommended == tuple(split) or then >= now * (1 - self.config.threshold):
            return
        if recommended == self.ledger.recommendation:
            return
        self.ledger.recommendation = recommended
        slowest = max(range(self.pp), key=lambda p: per_layer[p])
        fastest = min(range(self.pp), key=lambda p: per_layer[p])
        reason = (f"stage {slowest} takes {per_layer[slowest] / per_layer[fastest]:.2f}x the time per layer of "
                  f"stage {fastest}" + (" in every replica" if self.dp > 1 else ""))
        where = ""
        if self.config.save:
            if ctx.rank == 0:
                _write_json(Path(self.config.save) / RECOMMENDATION_FILE,
                            {"pipeline_layer_split": list(recommended), "previous": list(split),
                             "iteration": iteration + 1, "reason": reason,
                             "predicted_stage_seconds": [now, then]})
            where = f"; written to {Path(self.config.save) / RECOMMENDATION_FILE}, applied when the job restarts " \
                    "from that checkpoint with --straggler-mitigation"
        print_rank_0(f"[mitigation] iteration {iteration + 1}: {reason}; data parallelism cannot absorb it; "
                     f"recommended --pipeline-layer-split {_csv(recommended)} instead of {_csv(split)} "
                     f"(predicted {now:.3f} -> {then:.3f} s per microbatch on the slowest stage){where}")

    def shutdown(self, ctx) -> None:
        remove_observer(self.clock)
        ledger = self.ledger
        parts = [f"{ledger.changes} plan change{'s' if ledger.changes != 1 else ''}",
                 f"{ledger.rebalanced} iteration{'s' if ledger.rebalanced != 1 else ''} rebalanced"]
        if ledger.rebalanced:
            parts.append(f"estimated saving {ledger.predicted_saving:.2f} s (what-if: "
                         f"{statistics.mean(ledger.predicted_even):.3f} s even split -> "
                         f"{statistics.mean(ledger.predicted_plan):.3f} s rebalanced, compute per iteration)")
            if ledger.straggling_even:
                before, after = statistics.median(ledger.straggling_even), statistics.median(ledger.mitigated)
                parts.append(f"measured {before:.3f} s/it with the straggler on the even split "
                             f"({len(ledger.straggling_even)} it) -> {after:.3f} s/it rebalanced: "
                             f"{(before - after) * ledger.rebalanced:.2f} s saved")
        if ledger.recommendation:
            parts.append(f"layer split {_csv(ledger.recommendation)} recommended")
        if ledger.iterations:
            parts.append(f"own cost {ledger.own_seconds / ledger.iterations * 1e3:.2f} ms per iteration "
                         f"({ledger.own_seconds / max(1e-9, ledger.iteration_seconds):.2%} of iteration time)")
        print_rank_0("[mitigation] summary: " + "; ".join(parts))


def _current_split(cfg) -> tuple[int, ...]:
    return tuple(cfg.parallel.layers_per_stage(cfg.model.num_layers))


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
