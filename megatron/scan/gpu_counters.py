"""What the GPU said about itself while a window was traced: NVML's SM clock against its maximum,
power against its limit, temperature, the clocks-event ("throttle") reasons and ECC error counts,
read once per traced iteration on CUDA ranks. The GPU counterpart of host_counters.py: a suspect
rank slow because its GPU is power-capped, hot or clocked down shows why.

NVML comes from the optional `nvidia-ml-py` package (module `pynvml`); without it, or without a
GPU, nothing is read and `GpuCounters.unavailable` says why. Reading costs a handful of NVML
calls (tens of microseconds) per iteration."""
from __future__ import annotations

import statistics
from typing import Any

# NVML's clocks-event reason bits (nvmlClocksEventReason*; the older name is ClocksThrottleReason),
# with what each means for a rank that is slower than its peers.
REASONS: dict[int, tuple[str, str]] = {
    0x1: ("GpuIdle", "idle (nothing to run)"),
    0x2: ("ApplicationsClocksSetting", "clocks limited by the applications clock setting"),
    0x4: ("SwPowerCap", "power cap: the power limit holds the clocks down"),
    0x8: ("HwSlowdown", "hardware slowdown (thermal, power brake or a failing power supply)"),
    0x10: ("SyncBoost", "sync boost: held to the clock of a slower GPU in its group"),
    0x20: ("SwThermalSlowdown", "thermal: the driver lowers clocks to cool the GPU"),
    0x40: ("HwThermalSlowdown", "hardware thermal slowdown: the GPU is too hot"),
    0x80: ("HwPowerBrakeSlowdown", "hardware power brake: an external power-brake signal"),
    0x100: ("DisplayClockSetting", "clocks limited by the display clock setting"),
}
# Reasons that make a GPU slower than its peers (idle and the setting-driven ones do not explain a slowdown).
SLOWING = 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x80


def decode_reasons(mask: int) -> list[str]:
    """NVML reason names of the bits set in `mask`, lowest bit first; unknown bits as hex."""
    names = [name for bit, (name, _) in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return names


def describe_reasons(mask: int) -> list[str]:
    """The same bits, in words."""
    return [text for bit, (_, text) in REASONS.items() if mask & bit]


class GpuCounters:
    """One GPU's NVML readings. `read()` -> a flat dict for the iteration record, {} when NVML is
    unavailable (see `unavailable`)."""

    def __init__(self, device_index: int | None) -> None:
        self.unavailable: str | None = None
        self._nvml = self._handle = None
        if device_index is None:
            self.unavailable = "not a CUDA rank"
            return
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            self._handle = _nvml_handle(pynvml, device_index)
            self._max_sm = pynvml.nvmlDeviceGetMaxClockInfo(self._handle, pynvml.NVML_CLOCK_SM)
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001 - NVMLError and friends: no readings, with the reason
            self.unavailable = f"NVML: {e}"

    def read(self) -> dict[str, Any]:
        if self._nvml is None:
            return {}
        nvml, handle = self._nvml, self._handle
        record: dict[str, Any] = {"gpu_sm_clock_max_mhz": self._max_sm}
        for key, call in (("gpu_sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                          ("gpu_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
                          ("gpu_power_limit_w", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0),
                          ("gpu_temperature_c",
                           lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
                          ("gpu_reasons", lambda: _reasons(nvml, handle)),
                          ("gpu_ecc_uncorrected", lambda: nvml.nvmlDeviceGetTotalEccErrors(
                              handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))):
            try:
                record[key] = call()
            except Exception:  # noqa: BLE001 - a reading this GPU does not support is left out
                pass
        return record

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None


def _nvml_handle(pynvml, device_index: int):
    """NVML numbers GPUs physically; CUDA by CUDA_VISIBLE_DEVICES. Match by UUID where torch knows it."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            found = pynvml.nvmlDeviceGetUUID(handle)
            found = found.decode() if isinstance(found, bytes) else found
            if found.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
                return handle
    except Exception:  # noqa: BLE001 - fall back to the index
        pass
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)


def _reasons(nvml, handle) -> int:
    get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(get(handle))


def summarize(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a rank's GPU readings over its traced iterations say: median SM clock as a share of its
    maximum, median power as a share of its limit, peak temperature, each reason's share of the
    iterations it was set in, and ECC errors that appeared. None without readings."""
    rows = [r for r in records if "gpu_sm_clock_mhz" in r]
    if not rows:
        return None
    out: dict[str, Any] = {"samples": len(rows)}
    clock = statistics.median(r["gpu_sm_clock_mhz"] for r in rows)
    out["sm_clock_mhz"] = clock
    if rows[0].get("gpu_sm_clock_max_mhz"):
        out["sm_clock_share"] = round(clock / rows[0]["gpu_sm_clock_max_mhz"], 3)
    power = [(r["gpu_power_w"], r.get("gpu_power_limit_w")) for r in rows if "gpu_power_w" in r]
    if power:
        out["power_w"] = round(statistics.median(p for p, _ in power), 1)
        limits = [lim for _, lim in power if lim]
        if limits:
            out["power_limit_w"] = round(statistics.median(limits), 1)
            out["power_share"] = round(out["power_w"] / out["power_limit_w"], 3)
    temperatures = [r["gpu_temperature_c"] for r in rows if "gpu_temperature_c" in r]
    if temperatures:
        out["temperature_max_c"] = max(temperatures)
    masks = [int(r["gpu_reasons"]) for r in rows if "gpu_reasons" in r]
    if masks:
        out["reasons"] = {name: round(sum(1 for m in masks if m & bit) / len(masks), 3)
                          for bit, (name, _) in REASONS.items() if any(m & bit for m in masks)}
        out["slowing"] = sorted({name for bit, (name, _) in REASONS.items()
                                 if bit & SLOWING and any(m & bit for m in masks)})
    ecc = [r["gpu_ecc_uncorrected"] for r in rows if "gpu_ecc_uncorrected" in r]
    if ecc:
        out["ecc_uncorrected_new"] = max(ecc) - min(ecc)
        out["ecc_uncorrected_total"] = max(ecc)
    return out


def explain(summary: dict[str, Any] | None) -> str:
    """One line for a report beside a suspect ("" without readings)."""
    if not summary:
        return ""
    parts = []
    if "sm_clock_share" in summary:
        parts.append(f"SM clock {summary['sm_clock_mhz']:.0f} MHz ({summary['sm_clock_share']:.0%} of max)")
    if "power_share" in summary:
        parts.append(f"power {summary['power_w']:.0f} of {summary['power_limit_w']:.0f} W")
    if "temperature_max_c" in summary:
        parts.append(f"up to {summary['temperature_max_c']} C")
    for name in summary.get("slowing", []):
        text = next(t for _, (n, t) in REASONS.items() if n == name)
        parts.append(f"{text} in {summary['reasons'][name]:.0%} of iterations")
    if summary.get("ecc_uncorrected_new"):
        parts.append(f"{summary['ecc_uncorrected_new']} new uncorrected ECC errors")
    return "GPU: " + "; ".join(parts)
