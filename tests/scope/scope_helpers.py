"""Helpers shared by MegaScope tests (a uniquely named module: several conftest.py files exist)."""
from __future__ import annotations

from launch import env


def fresh_job_env() -> dict[str, str]:
    """launch.env() without the rendezvous variables that this session's in-process fixtures
    set for their own store, so a one-process child job picks its own."""
    return {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}


def ctrl_c_reaches_child() -> None:
    """Popen preexec_fn: a test run started in the background of a shell without job control
    inherits SIGINT ignored, and so would the child; the tests press Ctrl-C (SIGINT) on it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
