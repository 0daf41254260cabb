"""Test-only plugin loaded through MEGATRON_APP_PLUGINS: `--scan-kill-rank RANK:ITER` SIGKILLs one
rank at the start of an iteration, as a crashed host would die, to check trace crash-safety."""
from __future__ import annotations

import os
import signal
import time

from megatron.app.plugins import Plugin, register_plugin


@register_plugin
class ScanRankKiller(Plugin):
    name = "scan_rank_killer"

    def add_arguments(self, parser):
        parser.add_argument_group("scan tests").add_argument("--scan-kill-rank", default=None, metavar="RANK:ITER")

    def enabled(self, args):
        return args.scan_kill_rank is not None

    def setup(self, ctx):
        rank, iteration = ctx.cfg.args.scan_kill_rank.split(":")
        self.rank, self.iteration = int(rank), int(iteration)

    def before_iteration(self, ctx, iteration):
        if ctx.rank == self.rank and iteration == self.iteration:
            time.sleep(0.5)  # lets the writer thread finish the previous window, as time would on a real host
            os.kill(os.getpid(), signal.SIGKILL)
