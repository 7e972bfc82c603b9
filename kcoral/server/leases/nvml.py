# -*- test-case-name: tests.unit.test_gpu_monitor -*-
"""
What the GPU monitor reads from a GPU: one L{GpuSample} at a time.

L{IGpuSampler} is the seam: L{NvmlSampler} reads NVML (nvidia-ml-py) on the
GPU machine; L{kcoral.testing.fakes.FakeGpuSampler} plays a script of
samples in unit tests.  A sampler's calls block (an NVML call takes from a
few microseconds to a few milliseconds), so the monitor makes them in a
thread, never on the reactor.

NVML numbers GPUs in PCI bus order, as CUDA does in the workers
(C{CUDA_DEVICE_ORDER=PCI_BUS_ID}, L{kcoral.server.leases.gpus}), so a
server GPU id is an NVML index.  NVML reports process ids as the calling
process sees them: a worker in a bubblewrap PID namespace appears under its
host pid (seen on an H200 with driver 580).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
from zope.interface import Interface, implementer

__all__ = [
    "THROTTLING",
    "GpuSample",
    "IGpuSampler",
    "NvmlSampler",
    "ProcessUse",
    "SamplerUnavailable",
    "throttle_names",
]

#: The clock event reasons that slow a measurement down (NVML's
#: C{nvmlClocksThrottleReason*} bits).  Left out: C{GpuIdle} (0x1, set
#: whenever nothing runs), C{ApplicationsClocksSetting} (0x2, an operator's
#: choice), C{SyncBoost} (0x10) and C{DisplayClockSetting} (0x100).
THROTTLING: dict[int, str] = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}
THROTTLE_MASK = sum(THROTTLING)


def throttle_names(reasons: int) -> list[str]:
    """The names of the throttling bits set in C{reasons}."""
    return [name for bit, name in THROTTLING.items() if reasons & bit]


class SamplerUnavailable(Exception):
    """NVML cannot be used here (no library, no driver, no such GPU)."""


@attrs.frozen
class ProcessUse:
    """
    One of NVML's per-process utilization samples: C{pid} kept the SMs busy
    C{sm} percent and the memory C{mem} percent of the sample period that
    ended at C{at} (seconds since the epoch).
    """

    pid: int
    sm: int
    mem: int
    at: float


@attrs.frozen
class GpuSample:
    """
    One reading of one GPU.

    @ivar taken_at: when it was read (seconds since the epoch).
    @ivar processes: the pids holding a compute context on the GPU.
    @ivar usage: the per-process utilization samples newer than the
        sampler was asked for (the driver keeps a short history of them,
        so consecutive readings miss none).
    @ivar throttle: NVML's clock event reasons, a bit mask (L{THROTTLING}).
    """

    gpu: int
    taken_at: float
    processes: tuple[int, ...] = ()
    usage: tuple[ProcessUse, ...] = ()
    sm_clock_mhz: int = 0
    mem_clock_mhz: int = 0
    sm_clock_max_mhz: int = 0
    throttle: int = 0
    temperature_c: int = 0
    power_w: float = 0.0


class IGpuSampler(Interface):
    """Reads GPUs' state; every method may block, so the monitor calls them in a thread."""

    def name(gpu: int) -> str:  # type: ignore[misc]
        """
        The device's marketing name (C{"NVIDIA H200"}).

        @raise SamplerUnavailable: no such GPU, or NVML cannot be used.
        """

    def memory_bandwidth(gpu: int) -> float | None:  # type: ignore[misc]
        """
        The theoretical memory bandwidth (bytes/s: bus width x the highest
        memory clock x 2 transfers per clock), C{None} if not known.
        """

    def sample(gpu: int, usage_since: float) -> GpuSample:  # type: ignore[misc]
        """
        Read C{gpu} now, with the per-process utilization samples taken
        after C{usage_since} (seconds since the epoch; 0: all the driver
        still has).

        @raise SamplerUnavailable: no such GPU, or NVML cannot be used.
        """


@implementer(IGpuSampler)
class NvmlSampler:
    """L{IGpuSampler} through NVML (nvidia-ml-py's C{pynvml}), initialised on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handles: dict[int, object] = {}
        self._max_sm: dict[int, int] = {}

    def _handle(self, gpu: int) -> object:
        with self._lock:
            if self._nvml is None:
                try:
                    import pynvml
                except ImportError as e:
                    raise SamplerUnavailable(f"nvidia-ml-py is not installed: {e}") from e
                try:
                    pynvml.nvmlInit()
                except pynvml.NVMLError as e:
                    raise SamplerUnavailable(f"NVML: {e}") from e
                self._nvml = pynvml
            handle = self._handles.get(gpu)
            if handle is None:
                try:
                    handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu)
                except self._nvml.NVMLError as e:
                    raise SamplerUnavailable(f"NVML has no GPU {gpu}: {e}") from e
                self._handles[gpu] = handle
            return handle

    def name(self, gpu: int) -> str:
        handle = self._handle(gpu)
        name = self._nvml.nvmlDeviceGetName(handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def memory_bandwidth(self, gpu: int) -> float | None:
        handle = self._handle(gpu)
        nvml = self._nvml
        try:
            bits = nvml.nvmlDeviceGetMemoryBusWidth(handle)
            mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
        except nvml.NVMLError:
            return None
        return float(bits) / 8 * float(mhz) * 1e6 * 2

    def sample(self, gpu: int, usage_since: float) -> GpuSample:
        handle = self._handle(gpu)
        nvml = self._nvml
        taken_at = time.time()
        try:
            processes = tuple(p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except nvml.NVMLError as e:
            raise SamplerUnavailable(f"NVML could not list GPU {gpu}'s processes: {e}") from e
        try:
            raw = nvml.nvmlDeviceGetProcessUtilization(handle, int(usage_since * 1e6))
        except nvml.NVMLError:
            raw = []  # NVML_ERROR_NOT_FOUND: no sample since then
        usage = tuple(
            ProcessUse(int(u.pid), int(u.smUtil), int(u.memUtil), u.timeStamp / 1e6)
            for u in raw
            if u.timeStamp / 1e6 > usage_since
        )
        if gpu not in self._max_sm:
            self._max_sm[gpu] = int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
        return GpuSample(
            gpu=gpu,
            taken_at=taken_at,
            processes=processes,
            usage=usage,
            sm_clock_mhz=int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
            mem_clock_mhz=int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
            sm_clock_max_mhz=self._max_sm[gpu],
            throttle=int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)),
            temperature_c=int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            power_w=nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        )
