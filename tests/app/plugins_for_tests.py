"""Plugins used by the tests through MEGATRON_APP_PLUGINS (imported by the trainer processes)."""
from __future__ import annotations

import json
import os
import signal

from megatron.app.plugins import Plugin, register_plugin
from megatron.app.transport import TorchDistributedTransport


class CountingTransport(TorchDistributedTransport):
    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.received = 0

    def post(self, sends, recvs):
        self.sent += len(sends)
        self.received += len(recvs)
        return super().post(sends, recvs)


@register_plugin
class HookRecorder(Plugin):
    """`--record-hooks DIR`: writes, per rank, the hooks called and the messages its transport moved."""

    name = "hook_recorder"

    def add_arguments(self, parser):
        group = parser.add_argument_group("hook recorder (tests)")
        group.add_argument("--record-hooks", default=None, metavar="DIR")

    def enabled(self, args):
        return args.record_hooks is not None

    def configure(self, cfg):
        self.calls = ["configure"]
        self.out = cfg.args.record_hooks

    def make_transport(self, ctx):
        self.transport = CountingTransport()
        return self.transport

    def setup(self, ctx):
        self.calls.append("setup")
        self.calls.append(f"executor_transport={ctx.executor.transport.name}")

    def before_iteration(self, ctx, iteration):
        self.calls.append(f"before_iteration:{iteration}")

    def after_iteration(self, ctx, iteration, metrics):
        self.calls.append(f"after_iteration:{iteration}")

    def before_optimizer_step(self, ctx, iteration):
        self.calls.append(f"before_optimizer_step:{iteration}")

    def after_optimizer_step(self, ctx, iteration):
        self.calls.append(f"after_optimizer_step:{iteration}")

    def shutdown(self, ctx):
        self.calls.append("shutdown")
        with open(os.path.join(self.out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump({"calls": self.calls, "sent": self.transport.sent, "received": self.transport.received}, f)


@register_plugin
class RankKiller(Plugin):
    """`--kill-rank RANK:ITER`: SIGKILLs one rank at the start of an iteration (a crashed GPU host),
    in the job's first attempt only (torchrun's restarts, TORCHELASTIC_RESTART_COUNT > 0, run on)."""

    name = "rank_killer"

    def add_arguments(self, parser):
        parser.add_argument_group("rank killer (tests)").add_argument("--kill-rank", default=None)

    def enabled(self, args):
        return args.kill_rank is not None

    def setup(self, ctx):
        rank, iteration = ctx.cfg.args.kill_rank.split(":")
        self.rank, self.iteration = int(rank), int(iteration)

    def before_iteration(self, ctx, iteration):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if ctx.rank == self.rank and iteration == self.iteration and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
