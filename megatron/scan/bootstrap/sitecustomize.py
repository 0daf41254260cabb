"""Imported by Python at start-up when this directory is on PYTHONPATH (`python -m megatron.scan
launch` puts it there): arms MegaScan in torchrun workers, then runs any other sitecustomize."""
import importlib.util
import os
import sys


def _chain_next_sitecustomize() -> None:
    # Ours shadows the distribution's or the user's sitecustomize; run that one too.
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_megascan_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                try:
                    spec.loader.exec_module(importlib.util.module_from_spec(spec))
                except Exception as exc:  # theirs failing must not look like ours failing
                    print(f"[megascan] {candidate} failed: {exc!r}", file=sys.stderr)
            return


# Only worker processes (torchrun sets RANK for them), never torchrun itself or unrelated tools,
# and only where `launch` (MEGASCAN_SESSION) or an environment written by hand (MEGASCAN_TRACE_DIR
# alone) asks for it: megatron.scan.session.launch_requested.
if "RANK" in os.environ:
    try:
        from megatron.scan.session import launch_requested

        if launch_requested(os.environ):
            from megatron.scan.launch_session import arm

            arm()
    except Exception as exc:  # tracing must never stop the job from starting
        print(f"[megascan] rank {os.environ.get('RANK')}: tracing not armed: {exc!r}", file=sys.stderr)
_chain_next_sitecustomize()
