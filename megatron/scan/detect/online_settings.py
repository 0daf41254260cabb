"""Online detection's settings and the confirmation of its findings over consecutive analyses
(`--online-detect`, megatron.scan.detect.online): when the first verdict comes, what an analysis
covers, and which findings are reported."""
from __future__ import annotations

# Traced iterations before the first online verdict: with fewer, one rank's persistent share of a
# busy host in the first iterations was named (measured on 4 ranks over 2 cores).
MIN_ITERATIONS = 6
# Iterations at the end of the trace over which a rank starved of CPU must still be starved to be
# reported online (host_starvation's `recent`): a burst of host load that is over is history.
RECENT_ITERATIONS = 3
# Traced iterations an online analysis covers by default (--online-detect-history): the newest
# whole windows holding at least HISTORY, fewer in a job so large that ranks x iterations would pass
# HISTORY_RANK_ITERATIONS, never fewer than MIN_HISTORY. Older windows' tables are let go: at 4,096
# ranks each traced iteration kept about 95 MB and lengthened every later analysis (one analysis
# 9.5 s at 10 iterations, 14.6 s and 6.9 GB at 60); with 20 kept, 9.1-11.4 s and 3.1 GB from then
# on (benchmarks/online_analysis.py). 20 is where a rank 1.1x slower among 4,096 stands clear.
HISTORY, HISTORY_RANK_ITERATIONS, MIN_HISTORY = 50, 4096 * 20, 20


def default_history(world_size: int) -> int:
    """--online-detect-history's default for a job of `world_size` ranks."""
    return max(MIN_HISTORY, min(HISTORY, HISTORY_RANK_ITERATIONS // max(world_size, 1)))


# The compute analyzer's default factor over a rank's peers (peer_comparison's min_slowdown):
# None follows the measured noise, as offline (multiplicity.compute_floor: 1.05 on quiet ranks,
# 1.2 on a noisy host).
MIN_SLOWDOWN = None


# Analyses in a row that must name a suspect only one analyzer found before it is reported. Each
# analysis sees a few more iterations than the last, so a burst of host contention at the end of
# the trace reads as an onset until the next windows show it over. Replayed over 84 kept runs of
# 4-8 ranks on 2 cores (docs/megascan-detection.md), reporting at once gave a wrong alert in 4 runs,
# two analyses in a row in 1, and the faulty ranks were named one window later.
CONFIRM_ANALYSES = 2


class Confirmation:
    """Which of an analysis's suspects to report: those two analyzers name together (say a
    rank whose compute is slower than its peers' and which also arrives last at collectives),
    and those named by `analyses` consecutive analyses (kept across calls). Called once per
    analysis with its alerts (each with `kind`, `ranks`, `named_by`); returns (reported, pending)."""

    def __init__(self, analyses: int = CONFIRM_ANALYSES) -> None:
        if analyses < 1:
            raise ValueError(f"a suspect needs at least 1 analysis to be reported, not {analyses}")
        self.analyses = analyses
        self.streak: dict[tuple[str, tuple[int, ...]], int] = {}

    def __call__(self, alerts: list[dict]) -> tuple[list[dict], list[dict]]:
        def key(alert: dict) -> tuple[str, tuple[int, ...]]:
            return alert["kind"], tuple(alert["ranks"])

        self.streak = {key(a): self.streak.get(key(a), 0) + 1 for a in alerts}
        reported, pending = [], []
        for alert in alerts:
            alert["analyses"] = self.streak[key(alert)]
            ok = len(alert.get("named_by", ())) >= 2 or alert["analyses"] >= self.analyses
            (reported if ok else pending).append(alert)
        return reported, pending
