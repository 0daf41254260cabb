"""NVML readings beside a suspect, tested on what NVML read on an H100 (idle, then power-capped
under bf16 matrix products): tests/scan/data/nvml_h100_idle_then_power_capped.json."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from megatron.scan.gpu_counters import GpuCounters, REASONS, decode_reasons, describe_reasons, explain, summarize

RECORDED = json.loads((Path(__file__).parent / "data" / "nvml_h100_idle_then_power_capped.json").read_text())


def as_records(samples: list[dict]) -> list[dict]:
    return [{"gpu_sm_clock_mhz": s["sm_clock_mhz"], "gpu_sm_clock_max_mhz": s["sm_clock_max_mhz"],
             "gpu_power_w": s["power_mw"] / 1000, "gpu_power_limit_w": s["power_limit_mw"] / 1000,
             "gpu_temperature_c": s["temperature_c"], "gpu_reasons": s["clocks_event_reasons"],
             "gpu_ecc_uncorrected": s["ecc_volatile_uncorrected"]} for s in samples]


def test_the_reason_table_matches_the_constants_of_the_real_nvml_library():
    """Every single-bit reason constant nvidia-ml-py exported on the H100 machine decodes to its
    own name (both spellings: ClocksEvent and the older ClocksThrottle)."""
    seen = set()
    for constant, value in RECORDED["constants"].items():
        name = constant.split("Reason", 1)[1]
        if value and value & (value - 1) == 0:
            assert name in decode_reasons(value) or (name == "UserDefinedClocks" and value == 2), constant
            seen.add(value)
    assert seen == set(REASONS), "a reason bit NVML has is missing here, or one here is not NVML's"
    assert sum(REASONS) == RECORDED["constants"]["nvmlClocksEventReasonAll"]


def test_idle_and_power_capped_samples_decode_to_what_the_gpu_was_doing():
    assert {tuple(decode_reasons(s["clocks_event_reasons"])) for s in RECORDED["idle"]} == {("GpuIdle",)}
    assert {tuple(decode_reasons(s["clocks_event_reasons"])) for s in RECORDED["load"]} == {("SwPowerCap",)}
    assert describe_reasons(4) == ["power cap: the power limit holds the clocks down"]
    assert decode_reasons(0x4 | 0x40 | 0x800) == ["SwPowerCap", "HwThermalSlowdown", "0x800"]


def test_a_power_capped_gpu_is_explained_by_its_clock_power_and_reason():
    load = summarize(as_records(RECORDED["load"]))
    assert load["samples"] == 25 and load["slowing"] == ["SwPowerCap"] and load["reasons"] == {"SwPowerCap": 1.0}
    assert 0.55 < load["sm_clock_share"] < 0.75  # 1155-1440 MHz of 1980
    assert 0.85 < load["power_share"] <= 1.01 and load["power_limit_w"] == 700
    assert 50 <= load["temperature_max_c"] <= 60 and load["ecc_uncorrected_new"] == 0
    line = explain(load)
    assert line.startswith("GPU: SM clock ") and "of 700 W" in line and "power cap" in line and "100% of iterations" in line
    idle = summarize(as_records(RECORDED["idle"]))
    assert idle["slowing"] == [] and idle["reasons"] == {"GpuIdle": 1.0} and "power cap" not in explain(idle)
    assert summarize([{"iteration": 1}]) is None and explain(None) == ""


class FakeNvml(types.ModuleType):
    """pynvml's calls used by GpuCounters, answering with the recorded load samples."""
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, samples):
        super().__init__("pynvml")
        self.samples, self.i = samples, 0

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return f"gpu{i}"
    def nvmlDeviceGetUUID(self, handle): return "GPU-0000"
    def nvmlDeviceGetMaxClockInfo(self, handle, kind): return self.samples[0]["sm_clock_max_mhz"]

    def nvmlDeviceGetClockInfo(self, handle, kind):
        self.i += 1  # one reading per iteration: the clock is read first
        return self.samples[(self.i - 1) % len(self.samples)]["sm_clock_mhz"]

    def _now(self): return self.samples[(self.i - 1) % len(self.samples)]
    def nvmlDeviceGetPowerUsage(self, handle): return self._now()["power_mw"]
    def nvmlDeviceGetEnforcedPowerLimit(self, handle): return self._now()["power_limit_mw"]
    def nvmlDeviceGetTemperature(self, handle, kind): return self._now()["temperature_c"]
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle): return self._now()["clocks_event_reasons"]
    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter): raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


def test_counters_read_nvml_once_per_iteration_and_skip_unsupported_readings(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(RECORDED["load"]))
    counters = GpuCounters(0)
    assert counters.unavailable is None
    records = [counters.read() for _ in range(25)]
    counters.close()
    assert all("gpu_ecc_uncorrected" not in r for r in records)  # not supported: left out, not an error
    assert summarize(records)["slowing"] == ["SwPowerCap"]
    assert records[0]["gpu_power_w"] == RECORDED["load"][0]["power_mw"] / 1000


def test_without_nvidia_ml_py_or_a_gpu_nothing_is_read_and_the_reason_is_kept(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    counters = GpuCounters(0)
    assert counters.read() == {} and "nvidia-ml-py is not installed" in counters.unavailable
    assert GpuCounters(None).unavailable == "not a CUDA rank"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU and nvidia-ml-py")
def test_a_real_gpu_reports_its_clock_power_and_reasons():
    pytest.importorskip("pynvml")
    counters = GpuCounters(0)
    assert counters.unavailable is None, counters.unavailable
    record = counters.read()
    counters.close()
    assert record["gpu_sm_clock_max_mhz"] > 0 and record["gpu_power_limit_w"] > 0 and "gpu_reasons" in record


def test_a_suspect_rank_carries_its_gpus_readings_in_the_report(tmp_path):
    """Detection on a job whose slow rank 5 had a power-capped GPU (the recorded H100 samples in
    its iteration records) and whose other ranks idled between kernels: the suspect's evidence and
    abnormal.json say why its GPU was slow; the healthy ranks' readings name nothing."""
    from megatron.scan.aggregate import aggregate
    from megatron.scan.detect.combine import detect
    from megatron.scan.detect.faults import FaultCase, generate_case
    from megatron.scan.detect.model import from_aggregation
    from megatron.scan.detect.report import as_dict, text_report

    generate_case(FaultCase(tp=2, pp=2, dp=2, slow={5: 1.5}), tmp_path)
    aggregation = aggregate(tmp_path, None, jobs=1)
    load, idle = as_records(RECORDED["load"]), as_records(RECORDED["idle"])
    for rank, windows in aggregation.trace.windows.items():
        samples = load if rank == 5 else idle
        for window in windows:
            window["metrics"] = [{"iteration": i, **samples[i % len(samples)]} for i in range(8)]
    detection = detect(from_aggregation(aggregation))
    suspect = detection.suspects[0]
    assert suspect.ranks == [5]
    assert any(line.startswith("GPU: SM clock") and "power cap" in line for line in suspect.evidence), suspect.evidence
    assert as_dict(detection)["suspects"][0]["details"]["gpu"]["slowing"] == ["SwPowerCap"]
    assert "power cap: the power limit holds the clocks down" in text_report(detection)


def test_prometheus_series_carry_the_gpu_readings_and_reasons(monkeypatch, tmp_path):
    """The rank's /metrics page after one power-capped reading: clock, power, limit, temperature and
    one 0/1 series per NVML reason; promtool accepts the page where it is installed."""
    import shutil
    import subprocess

    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from megatron.scan.metrics import RankMetrics

    metrics = RankMetrics({"rank": 3, "world_size": 4})
    metrics.on_gpu({})  # a CPU rank: nothing is set
    assert b"megascan_gpu_sm_clock_mhz{" not in generate_latest(metrics.registry)
    metrics.on_gpu(as_records(RECORDED["load"])[0])
    page = generate_latest(metrics.registry).decode()
    assert 'megascan_gpu_sm_clock_mhz{rank="3"} 1425.0' in page
    assert 'megascan_gpu_power_limit_watts{rank="3"} 700.0' in page
    assert 'megascan_gpu_clocks_event_reason{rank="3",reason="SwPowerCap"} 1.0' in page
    assert 'megascan_gpu_clocks_event_reason{rank="3",reason="HwThermalSlowdown"} 0.0' in page
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
