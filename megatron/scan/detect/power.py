"""What a verdict could have seen: whether a rank of the smallest slowdown that matters would have
been named with the iterations traced and the noise measured (the test's power), and, when it
would not, the leading candidate and how many more traced iterations would settle it."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.scan.detect.compute import Z_RANK, ComputeStage

# The smallest slowdown that matters: a rank this much slower than its peers is what a `healthy`
# verdict promises would have been named.
POWER_SLOWDOWN = 1.2
# Standard errors beyond the naming bar that such a rank's expected score must stand: at one, it
# is named in about 5 runs of 6 (the score is normal around its expectation).
POWER_MARGIN = 1.0
# The median's standard error over the mean's for normal noise (the compute test is on medians).
_MEDIAN_SE = 1.2533


@dataclass(kw_only=True)
class Power:
    slowdown: float  # the slowdown it speaks of
    iterations: int  # traced iterations of the least-compared rank
    noise: float  # spread of one per-iteration log ratio to the peers
    needed: int  # iterations at which that slowdown would have been named
    method: str  # "peers" | "layers": what the ranks were compared with
    # A rank slower in every call (a steadily slower device) also shows in its typical call (see
    # typical.typical_ratios), a far quieter series: its noise and the iterations it needs, and
    # what the call is ("" where no typical call was compared). `healthy` asks for the totals'
    # power, which a slowdown of any shape, bursts included, needs.
    steady_measure: str = ""
    steady_noise: float = float("nan")
    steady_needed: int = 0

    @property
    def enough(self) -> bool:
        return self.iterations >= self.needed

    @property
    def more(self) -> int:
        return max(self.needed - self.iterations, 0)

    def line(self) -> str:
        noise = f"noise {100 * math.expm1(self.noise):.0f}% per iteration"
        steady = ""
        if self.steady_measure:
            could = "would" if self.iterations >= self.steady_needed else "could not"
            steady = (f"; one slower in every call {could} have been ({self.steady_measure}: noise "
                      f"{100 * math.expm1(self.steady_noise):.0f}%, {self.steady_needed} iterations needed)")
        if self.enough:
            return (f"a rank {self.slowdown:.2g}x slower than its {self.method} would have been named: "
                    f"{self.iterations} iterations, {noise}{steady}")
        return (f"a rank {self.slowdown:.2g}x slower than its {self.method} could not have been named: "
                f"{self.iterations} iterations at {noise} in busy totals{steady}; about {self.more} more "
                f"traced iterations (--trace-interval, --continuous-trace-iterations, --train-iters) would settle it")

    def as_dict(self) -> dict:
        return {"slowdown": self.slowdown, "iterations": self.iterations, "noise": round(float(self.noise), 4),
                "needed": self.needed, "enough": self.enough, "method": self.method,
                "steady": {"measure": self.steady_measure, "noise": round(float(self.steady_noise), 4),
                           "needed": self.steady_needed} if self.steady_measure else None,
                "line": self.line()}


def iterations_needed(noise: float, slowdown: float = POWER_SLOWDOWN, *, z_rank: float = Z_RANK,
                      margin: float = POWER_MARGIN) -> int:
    """Iterations at which a rank `slowdown` times slower scores z_rank + margin standard errors."""
    return max(int(math.ceil(((z_rank + margin) * _MEDIAN_SE * noise / math.log(slowdown)) ** 2)), 2)


def compute_power(stage: ComputeStage, *, slowdown: float = POWER_SLOWDOWN) -> Power | None:
    """The power of the compute comparison over the ranks compared with peers (same stage, or
    layer by layer): the fewest iterations any of them was compared over, at the largest noise
    of their busy totals' series (what a slowdown in bursts needs), with the typical call's
    figures beside it (a slowdown in every call is named by that quieter test too). None when no
    rank had a peer."""
    compared = [f for f in stage.findings.values() if f.method != "history" and f.iterations > 0]
    if not compared:
        return None
    noise = max(float(f.series_noise) if f.series_noise == f.series_noise else stage.iteration_noise
                for f in compared)
    iterations = min(f.iterations for f in compared)
    method = "peers" if all(f.method == "peers" for f in compared) else "peers (layer by layer)"
    power = Power(slowdown=slowdown, iterations=iterations, noise=noise, needed=iterations_needed(noise, slowdown),
                  method=method)
    typical = stage.typical_noise
    if typical == typical and all(f.typical_z == f.typical_z for f in compared):
        power.steady_measure = "its typical layer call" if stage.layer_typical else "its typical task"
        power.steady_noise, power.steady_needed = typical, iterations_needed(typical, slowdown)
    return power

def leading_candidate(stage: ComputeStage, arrival) -> dict | None:
    """The rank that looks slowest short of being named: the highest compute score over its peers
    (or, with no compute compared, the rank arriving last most beyond chance). None when no rank
    leans slow at all."""
    leads = []
    for f in stage.findings.values():
        if f.method == "history":
            continue
        if f.slowdown > 1.0 and f.z > 0:
            leads.append((f.z, f, f.slowdown, f.slower_iterations, ""))
        if f.typical_z == f.typical_z and f.typical_slowdown > 1.0 and f.typical_z > 0:
            leads.append((f.typical_z, f, f.typical_slowdown, f.typical_slower_iterations, " in its typical call"))
    if leads:
        # Nearest to being named: the lesser of its share of the standard errors and of the
        # slowdown the test asks for (a steady 1.05x at 1.5 standard errors leads less than a
        # 1.22x at 1.2).
        z, best, slowdown, slower, where = max(
            leads, key=lambda lead: min(lead[0] / Z_RANK, math.log(lead[2]) / math.log(POWER_SLOWDOWN)))
        return {"rank": best.rank, "slowdown": round(float(slowdown), 3), "z": round(float(z), 2),
                "by": "compute",
                "text": f"rank {best.rank}, compute {slowdown:.2f}x its peers{where} ({z:.1f} standard errors, "
                        f"slower in {slower} of {best.iterations} iterations)"}
    late = [f for f in arrival.findings.values() if f.last > f.expected_last and f.z > 0]
    if late:
        best = max(late, key=lambda f: f.z)
        cost = "" if best.cost_share != best.cost_share else f", its peers waited {100 * best.cost_share:.0f}% of an iteration"
        return {"rank": best.rank, "z": round(float(best.z), 2), "by": "arrival",
                "text": f"rank {best.rank}, arrived last at {best.last} of {best.instances} collectives "
                        f"(chance {best.expected_last:.1f}; {best.z:.1f} standard errors over {best.iterations} "
                        f"iterations{cost})"}
    return None



def verdict_lines(detection) -> list[str]:
    """What a detection's verdict could have seen (the power line) and, when inconclusive, who
    leads: the lines the text and HTML reports print under the verdict."""
    lines = []
    if detection.power is not None and detection.verdict in ("healthy", "inconclusive"):
        lines.append(f"power: {detection.power.line()}")
    if detection.leading is not None:
        lines.append(f"leading candidate (not named): {detection.leading['text']}")
    return lines
