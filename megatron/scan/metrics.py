"""Live Prometheus metrics per rank (`--metrics-port PORT`, port PORT + local rank): iteration time,
span and collective latency by op and group kind, P2P bytes and bandwidth, hang flag and suspect
score. Every label set is bounded by the job's shape, never by microbatch or iteration."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.app.plugins import Plugin, register_plugin
from megatron.scan.collectives import GroupInfo, untraced
from megatron.scan.session import shared_trace_config
from megatron.scan.speed import COMPUTE_SPANS, slowness
from megatron.scan.watchdog import shared_collective_observer, write_json_atomically

# The spine's span kinds worth a latency summary; any other kind is ignored so that a new span in
# the trainer cannot grow the label set unnoticed.
SPAN_KINDS = frozenset({"data", *COMPUTE_SPANS, "send", "recv", "grad_sync", "optimizer"})
# Megatron group descriptions -> a short, bounded group kind.
_GROUP_KINDS = (("TENSOR_AND_DATA", "tp_dp"), ("TENSOR", "tp"), ("PIPELINE", "pp"), ("EMBEDDING", "embedding"),
                ("POSITION", "embedding"), ("CONTEXT", "cp"), ("EXPERT", "ep"), ("DATA", "dp"))


def group_kind(info: GroupInfo, world_size: int) -> str:
    desc = (info.desc or "").upper()
    for needle, kind in _GROUP_KINDS:
        if needle in desc:
            return kind
    return "world" if len(info.ranks) == world_size else "other"


class RankMetrics:
    """The series of one rank in its own registry (a process serves exactly its own rank)."""

    def __init__(self, identity: dict[str, Any]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info, Summary

        self.identity = identity
        self.rank = str(identity["rank"])
        self.world_size = int(identity.get("world_size") or 1)
        self.registry = CollectorRegistry()
        r = self.registry
        Info("megascan_rank", "where this rank sits in the job", ["rank"], registry=r).labels(self.rank).info(
            {"host": str(identity.get("host", "")), "world_size": str(self.world_size),
             **{k: str(v) for k, v in (identity.get("coordinates") or {}).items()}})
        self.iteration_seconds = Summary("megascan_iteration_seconds", "wall time of one training iteration",
                                         ["rank"], registry=r).labels(self.rank)
        self.iterations = Counter("megascan_iterations", "training iterations finished", ["rank"], registry=r).labels(self.rank)
        self.tokens = Counter("megascan_tokens", "tokens processed by this rank", ["rank"], registry=r).labels(self.rank)
        self.loss = Gauge("megascan_loss", "last training loss (last pipeline stage only)", ["rank"], registry=r).labels(self.rank)
        self.compute_seconds = Summary("megascan_compute_seconds", "forward + backward time per iteration",
                                       ["rank"], registry=r).labels(self.rank)
        self._span = Summary("megascan_span_seconds", "latency of trainer spans by kind", ["rank", "kind"], registry=r)
        self._collective = Summary("megascan_collective_seconds", "latency of torch.distributed collectives "
                                   "(async ones: time to issue)", ["rank", "op", "group_kind"], registry=r)
        self._p2p_bytes = Counter("megascan_p2p_bytes", "P2P bytes", ["rank", "direction"], registry=r)
        self._p2p_bandwidth = Gauge("megascan_p2p_bandwidth_bytes_per_second",
                                    "bytes / span time of the last P2P message (recv: includes waiting)",
                                    ["rank", "direction"], registry=r)
        self.hang = Gauge("megascan_hang", "1 while the watchdog sees no progress for --hang-timeout",
                          ["rank"], registry=r).labels(self.rank)
        self.stalled = Gauge("megascan_seconds_since_progress", "seconds since the last finished collective, "
                             "span or iteration", ["rank"], registry=r).labels(self.rank)
        self.suspect = Gauge("megascan_suspect_score", "this rank's compute time / the job median "
                             "(1 = typical, 1.5 = 50% slower)", ["rank"], registry=r).labels(self.rank)
        # NVML readings of this rank's GPU (CUDA ranks with nvidia-ml-py), set once per iteration.
        gpu = [("sm_clock_mhz", "SM clock (MHz)"), ("sm_clock_max_mhz", "maximum SM clock (MHz)"),
               ("power_w", "power draw (W)"), ("power_limit_w", "enforced power limit (W)"),
               ("temperature_c", "GPU temperature (C)"), ("ecc_uncorrected", "volatile uncorrected ECC errors")]
        names = {"power_w": "power_watts", "power_limit_w": "power_limit_watts", "temperature_c": "temperature_celsius",
                 "ecc_uncorrected": "ecc_uncorrected_errors"}
        self._gpu = {key: Gauge(f"megascan_gpu_{names.get(key, key)}", text, ["rank"], registry=r)
                     for key, text in gpu}
        self._gpu_reason = Gauge("megascan_gpu_clocks_event_reason", "1 while NVML reports this clocks-event "
                                 "(throttle) reason for the GPU", ["rank", "reason"], registry=r)
        self._spans = {kind: self._span.labels(self.rank, kind) for kind in SPAN_KINDS}
        self._collectives: dict[tuple[str, int], Any] = {}
        self._p2p = {d: (self._p2p_bytes.labels(self.rank, d), self._p2p_bandwidth.labels(self.rank, d))
                     for d in ("send", "recv")}
        self._compute_this_iteration = 0.0
        self.last_progress = time.monotonic()  # any finished collective, span or iteration
        self.stalled.set_function(lambda: max(0.0, time.monotonic() - self.last_progress))
        self.server = None
        self.port = None

    # --- feeding ------------------------------------------------------------------------
    def on_collective(self, op: str, info: GroupInfo, seq: int, start_ns: int, end_ns: int) -> None:
        self.last_progress = time.monotonic()
        key = (op, info.gid)
        child = self._collectives.get(key)
        if child is None:
            child = self._collectives[key] = self._collective.labels(self.rank, op, group_kind(info, self.world_size))
        child.observe((end_ns - start_ns) * 1e-9)

    def on_span(self, kind: str, attrs: dict[str, Any], seconds: float) -> None:
        self.last_progress = time.monotonic()
        child = self._spans.get(kind)
        if child is None:
            return
        child.observe(seconds)
        if kind in COMPUTE_SPANS:
            self._compute_this_iteration += seconds
        elif kind in ("send", "recv"):
            size = attrs.get("bytes", -1)
            if size and size > 0:
                counter, bandwidth = self._p2p[kind]
                counter.inc(size)
                if seconds > 0:
                    bandwidth.set(size / seconds)

    def on_iteration(self, metrics: dict[str, Any]) -> float:
        """Record one finished iteration; returns its compute seconds (for the suspect score)."""
        self.last_progress = time.monotonic()
        self.iterations.inc()
        if metrics.get("iteration_time") is not None:
            self.iteration_seconds.observe(metrics["iteration_time"])
        if metrics.get("num_tokens"):
            self.tokens.inc(float(metrics["num_tokens"]))
        if metrics.get("lm loss") is not None:
            self.loss.set(float(metrics["lm loss"]))
        compute, self._compute_this_iteration = self._compute_this_iteration, 0.0
        if compute > 0:
            self.compute_seconds.observe(compute)
        return compute

    def on_gpu(self, record: dict[str, Any]) -> None:
        """One GpuCounters.read(): the gauges it has values for ({} on CPU ranks sets nothing)."""
        from megatron.scan.gpu_counters import REASONS

        for key, gauge in self._gpu.items():
            if f"gpu_{key}" in record:
                gauge.labels(self.rank).set(float(record[f"gpu_{key}"]))
        if "gpu_reasons" in record:
            mask = int(record["gpu_reasons"])
            for bit, (name, _) in REASONS.items():
                self._gpu_reason.labels(self.rank, name).set(1 if mask & bit else 0)

    def on_hang(self, hung: bool) -> None:
        self.hang.set(1 if hung else 0)

    # --- serving ------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "0.0.0.0", control=None) -> int:
        """Serves GET /metrics on `port` (0: any free port, returned); with `control`, also the
        capture requests (megatron.scan.control.http_server)."""
        from megatron.scan.control import http_server

        self.server = http_server(self.registry, port, addr, control)
        self.port = self.server.server_port
        return self.port

    def write_target(self, directory: str | os.PathLike) -> Path:
        """A Prometheus file_sd entry for this rank: point `file_sd_configs` at DIR/metrics-targets-*.json
        and ephemeral ports (`--metrics-port 0`) are found without configuration."""
        import socket

        path = Path(directory) / f"metrics-targets-rank{self.rank}.json"
        write_json_atomically(path, [{"targets": [f"{socket.gethostname()}:{self.port}"],
                                      "labels": {"megascan_rank": self.rank}}])
        return path

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class _TimedSpan:
    __slots__ = ("metrics", "kind", "attrs", "start")

    def __init__(self, metrics: RankMetrics, kind: str, attrs: dict[str, Any]) -> None:
        self.metrics, self.kind, self.attrs = metrics, kind, attrs

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        self.metrics.on_span(self.kind, self.attrs, time.perf_counter() - self.start)
        return False


class MetricsSpans:
    """Observer feeding span latencies into the rank's metrics (host time: on CUDA a span's host
    time is its launch time unless the span synchronizes, as P2P waits do)."""

    _null = None

    def __init__(self, metrics: RankMetrics) -> None:
        import contextlib

        self.metrics = metrics
        self._null = contextlib.nullcontext()

    def span(self, kind: str, **attrs: Any):
        if kind not in SPAN_KINDS:
            return self._null
        return _TimedSpan(self.metrics, kind, attrs)

    def instant(self, kind: str, **attrs: Any) -> None:
        return None

    def collective(self, op: str, group: GroupInfo, seq: int, start_ns: int, end_ns: int) -> None:
        self.metrics.on_collective(op, group, seq, start_ns, end_ns)

    def hang(self, hung: bool) -> None:
        self.metrics.on_hang(hung)


def start_rank_metrics(identity: dict[str, Any], directory: str | os.PathLike, *, port: int,
                       addr: str = "0.0.0.0", token: str | None = None, traced: bool = False) -> RankMetrics:
    """This rank's metrics, served on `port` + its local rank (0: any free port) and announced in
    `directory` for Prometheus: the trainer's plugin and a launched job's ranks alike. Only rank 0's
    port takes capture requests (with `token`); the others answer where to send them."""
    from megatron.scan.control import control_handler, not_rank_zero

    metrics = RankMetrics(identity)
    control = control_handler(directory, token, traced) if identity["rank"] == 0 else not_rank_zero
    metrics.serve(0 if port == 0 else port + identity["local_rank"], addr, control=control)
    metrics.write_target(directory)
    print(f"[megascan] rank {identity['rank']}: metrics on :{metrics.port}/metrics", file=sys.stderr, flush=True)
    return metrics


def suspect_scores(compute_seconds: list[float]) -> list[float]:
    """Each rank's compute time over the median of all ranks (ranks with no compute count as 1):
    its slowness relative to its peers (megatron.scan.speed)."""
    return slowness(compute_seconds)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The live-metrics section, from its flags."""

    port: int  # PORT + local rank, or 0: an ephemeral port per rank
    addr: str
    score_interval: int  # iterations between suspect-score exchanges (0: never)
    control_token: str | None = None  # POST /capture on rank 0 needs it; None: the port is read-only
    traced: bool = False  # --trace: captures can be taken


@register_plugin
class MetricsPlugin(Plugin):
    """`--metrics-port PORT`: every rank serves /metrics on PORT + its local rank (0: any free port,
    announced in DIR/metrics-targets-rank*.json for Prometheus file_sd). Plugins that follow it
    add their own series to its public `registry`."""

    name = "scan_metrics"
    flag = "--metrics-port"
    # Their collective observer and watchdog exist by setup; --trace-dir is the scan plugin's config.
    after = ("scan", "scan_watchdog")

    def add_arguments(self, parser) -> None:
        g = parser.add_argument_group("MegaScan live metrics")
        g.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics on PORT + local rank (0: ephemeral ports)")
        g.add_argument("--metrics-addr", default="0.0.0.0", metavar="ADDR", help="address the metrics server binds")
        g.add_argument("--metrics-score-interval", type=int, default=10, metavar="N",
                       help="every N iterations ranks exchange compute times for the suspect score (0: never)")
        g.add_argument("--metrics-control-token-file", default=None, metavar="FILE",
                       help="accept POST /capture on rank 0's metrics port from callers presenting the token in "
                            "FILE (`Authorization: Bearer TOKEN`); without it the port is read-only")

    def enabled(self, args) -> bool:
        return args.metrics_port is not None

    @property
    def registry(self):
        """This rank's Prometheus registry (prometheus_client.CollectorRegistry) once set up, where
        other plugins add their series (it is served with MegaScan's); None before setup."""
        metrics = getattr(self, "metrics", None)
        return metrics.registry if metrics is not None else None

    def configure(self, cfg) -> None:
        from megatron.app.config import ConfigError

        args = cfg.args
        if not 0 <= args.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
        if args.metrics_score_interval < 0:
            raise ConfigError(f"--metrics-score-interval must be >= 0, got {args.metrics_score_interval}")
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError("--metrics-port needs the prometheus-client package (pip install prometheus-client)") from None
        token = None
        if args.metrics_control_token_file:
            try:
                from megatron.scan.control import read_control_token

                token = read_control_token(args.metrics_control_token_file)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.config = MetricsConfig(port=args.metrics_port, addr=args.metrics_addr,
                                    score_interval=args.metrics_score_interval, control_token=token,
                                    traced="scan" in self.peers)
        self.directory = shared_trace_config(self.peers, args).directory  # --trace-dir, as the tracer has it
        self.metrics = None
        self.gpu = None
        self._window: list[float] = []

    def setup(self, ctx) -> None:
        from megatron.app.observer import set_observer
        from megatron.scan.watchdog import process_identity

        config = self.config
        identity = process_identity(ctx.rank, ctx.cfg.parallel.world_size,
                                    {"dp": ctx.dp_rank, "pp": ctx.pp_rank, "tp": ctx.tp_rank})
        self.metrics = metrics = start_rank_metrics(identity, self.directory, port=config.port, addr=config.addr,
                                                    token=config.control_token, traced=config.traced)
        from megatron.scan.gpu_counters import GpuCounters

        self.gpu = GpuCounters(_cuda_device())
        shared_collective_observer()  # collectives wrapped (by the tracer, or here), reported to observers
        set_observer(MetricsSpans(metrics))

    def after_iteration(self, ctx, iteration: int, metrics: dict[str, Any]) -> None:
        self._window.append(self.metrics.on_iteration(metrics))
        if self.gpu is not None:
            self.metrics.on_gpu(self.gpu.read())
        interval = self.config.score_interval
        if interval and (iteration + 1) % interval == 0:
            self._exchange_scores(ctx)

    def _exchange_scores(self, ctx) -> None:
        import torch
        import torch.distributed as dist

        mean = sum(self._window) / max(1, len(self._window))
        self._window = []
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.metrics.suspect.set(1.0)
            return
        # This bookkeeping exchange is not part of the training job: untraced.
        values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        untraced(dist.all_gather)(values, torch.tensor([mean], dtype=torch.float64))
        scores = suspect_scores([float(v) for v in values])
        self.metrics.suspect.set(scores[dist.get_rank()])

    def shutdown(self, ctx) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.gpu is not None:
            self.gpu.close()


def _cuda_device() -> int | None:
    """This process's CUDA device once CUDA is in use (NVML is read for it), else None."""
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, tuple], float]:
    """Parse one /metrics page into {(sample name, sorted labels): value} (tests, tooling)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def read_targets(directory: str | os.PathLike) -> dict[int, str]:
    """rank -> host:port from the file_sd entries the ranks wrote."""
    targets = {}
    for path in Path(directory).glob("metrics-targets-rank*.json"):
        entry = json.loads(path.read_text())[0]
        targets[int(entry["labels"]["megascan_rank"])] = entry["targets"][0]
    return targets
