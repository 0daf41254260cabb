"""MegaScan: low-overhead per-rank tracing of training runs, and aggregation of all ranks into one
clock-aligned, dependency-linked Chrome trace (`python -m megatron.scan aggregate DIR`)."""
from megatron.scan.trace_format import FORMAT, VERSION, TraceFormatError, read_rank_file, trace_file_name

__all__ = ["FORMAT", "VERSION", "TraceFormatError", "read_rank_file", "trace_file_name"]
