"""`python -m megatron.scan fault ...`: faults applied from outside a running job, for validating
slow-rank detection the way real slowness arrives (nothing in the process knows). A rank is found
by the `RANK` in its workers' environment (or by PID); the job never cooperates.

    throttle --rank R --cpu-fraction F   cgroup CPU quota on every thread of rank R (v1 or v2)
    freeze --rank R / thaw --rank R      SIGSTOP / SIGCONT
    kill --rank R [--signal S]           SIGKILL (or S)
    release [--rank R]                   undo what a killed `throttle` left behind
    list                                 the ranks of the jobs on this host

`throttle` and `freeze` hold until Ctrl-C (or SIGTERM), `--for SECONDS`, or the rank's processes
are gone, then undo what they did: threads back in their own cgroup, the fault group removed, a
frozen rank continued."""
from __future__ import annotations

from megatron.scan.fault.commands import add_arguments, run
from megatron.scan.fault.targets import FaultError

__all__ = ["FaultError", "add_arguments", "run"]
