"""Compare the static schedule with the DPP policies on the simulator's cost model, over many
jitter seeds: mean and p95 makespan, ratio to static, peak stored activations. With
`--split-backward` also the zero-bubble static orders and each policy with backwards split into I
and W (`policy+W`, what `--dpp-split-backward` runs).
`python -m megatron.dpp.simulate --help`."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.app.schedule import ZERO_BUBBLE_SCHEDULES, PipelineLayout, ScheduleError
from megatron.app.simulator import (CostModel, SimulationDeadlock, add_simulation_arguments, simulate,
                                    simulation_from_args, static_policies, write_chrome_trace)

from .policy import POLICY_NAMES, default_budget, dpp_policies


@dataclass(frozen=True, slots=True)
class Comparison:
    name: str
    makespans: tuple[float, ...]  # one per seed
    peak_activations: int  # max over ranks and seeds
    budget: int | None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.makespans)

    @property
    def p95(self) -> float:
        ordered = sorted(self.makespans)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def compare(layout: PipelineLayout, costs: CostModel, *, seeds: int = 1, budget: int | None = None,
            static: str | None = None, policies: Sequence[str] = POLICY_NAMES,
            split: bool = False) -> list[Comparison]:
    """The static order (first row) and each policy on the same per-seed costs; with `split` also
    the zero-bubble orders and each policy on split backwards ("adaptive+W")."""
    static = static or ("1f1b" if layout.num_chunks == 1 else "interleaved")
    split_layout = dataclasses.replace(layout, split_backward=True)
    statics = [(static, layout)] + ([(name, split_layout) for name in ZERO_BUBBLE_SCHEDULES] if split else [])
    dynamics = [(policy, policy, layout) for policy in policies]
    if split:
        dynamics += [(f"{policy}+W", policy, split_layout) for policy in policies]
    runs: dict[str, list] = {name: [] for name, _ in statics} | {row: [] for row, _, _ in dynamics}
    budgets: dict[str, int | None] = {name: None for name, _ in statics}
    for seed in range(seeds):
        seeded = CostModel(**{**_fields(costs), "seed": costs.seed + seed})
        for name, on in statics:
            runs[name].append(simulate(on, static_policies(on, name), seeded))
        for row, policy, on in dynamics:
            chosen = budget if budget is not None else default_budget(policy, on)
            budgets[row] = chosen
            runs[row].append(simulate(on, dpp_policies(on, policy, chosen), seeded))
    return [Comparison(name, tuple(r.makespan for r in results),
                       max(max(r.peak_stored_activations) for r in results), budgets[name])
            for name, results in runs.items()]


def _fields(costs: CostModel) -> dict:
    return {name: getattr(costs, name) for name in costs.__dataclass_fields__}


def format_table(rows: Sequence[Comparison]) -> str:
    base = rows[0].mean
    lines = [f"{'schedule':<12} {'mean ms':>9} {'p95 ms':>9} {'vs static':>9} {'peak act.':>9} {'budget':>8}"]
    for row in rows:
        budget = "-" if row.budget is None else str(row.budget)
        lines.append(f"{row.name:<12} {row.mean:>9.2f} {row.p95:>9.2f} {row.mean / base:>8.2f}x "
                     f"{row.peak_activations:>9} {budget:>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.dpp.simulate",
                                     description="Static schedule vs DPP policies on a simulated pipeline.")
    add_simulation_arguments(parser)
    parser.add_argument("--seeds", type=int, default=20,
                        help="jitter seeds to average over, from --seed on (default %(default)s)")
    parser.add_argument("--budget", type=int, default=None, help="stored activations per rank (all policies)")
    parser.add_argument("--policy", choices=POLICY_NAMES, action="append", default=None,
                        help="a DPP policy to compare with the static schedule (repeatable; default: all)")
    parser.add_argument("--split-backward", action="store_true",
                        help="also the zero-bubble orders (zb-h1, zb-h2) and each policy with backwards split "
                             "into I and W (rows 'policy+W'); W takes --weight-grad-fraction of a backward")
    parser.add_argument("--chrome-trace", metavar="PATH", help="Chrome trace of the first policy, first seed")
    args = parser.parse_args(argv)
    policies = args.policy or list(POLICY_NAMES)
    try:
        layout, costs = simulation_from_args(args)
        rows = compare(layout, costs, seeds=max(1, args.seeds), budget=args.budget, policies=policies,
                       split=args.split_backward)
    except (ValueError, ScheduleError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SimulationDeadlock as deadlock:
        print(str(deadlock), file=sys.stderr)
        return 1
    print(f"pp={args.pp} chunks={args.chunks} microbatches={args.microbatches} seeds={args.seeds} "
          f"jitter={args.jitter} link-jitter={args.link_jitter}")
    print(format_table(rows))
    if args.chrome_trace:
        budget = args.budget if args.budget is not None else default_budget(policies[0], layout)
        write_chrome_trace(simulate(layout, dpp_policies(layout, policies[0], budget), costs), args.chrome_trace)
        print(f"chrome trace ({policies[0]}): {args.chrome_trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
