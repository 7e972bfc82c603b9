# -*- test-case-name: tests.unit.test_gpus -*-
"""
Which physical GPUs a server has, found without CUDA (the reactor process
never loads it), and what a worker must be given to see exactly its own.

A GPU's id on the command line (C{--gpus 1}) is its nvidia-smi index, which
is the order of PCI bus ids.  Its device node is C{/dev/nvidia<minor>}, and
the minor need not equal the index.  Inside bubblewrap only the worker's own
nodes exist, so the CUDA driver enumerates only those (numbered from 0 in
bus order) and a physical index in C{CUDA_VISIBLE_DEVICES} would name a GPU
it cannot see.  L{cuda_environment} therefore numbers devices as the worker
will see them.

Sources, in order: the driver's C{/proc/driver/nvidia/gpus/*/information}
files (UUID, bus location, device minor), then C{nvidia-smi
--query-gpu=index,uuid,pci.bus_id} (minors taken to be the indexes).
Everything here that reads files or runs a program is BLOCKING: run it in a
thread.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence

import attrs

#: Where the NVIDIA driver lists its GPUs, one directory per PCI bus id.
PROC_GPUS = "/proc/driver/nvidia/gpus"

#: How long C{nvidia-smi} may take before discovery gives up on it.
NVIDIA_SMI_TIMEOUT = 20.0


class GpuDiscoveryError(Exception):
    """A configured GPU id does not exist on this machine."""


def normalize_bus_id(bus_id: str) -> str:
    """
    C{"00000000:00:07.0"} (nvidia-smi) and C{"0000:00:07.0"} (the driver)
    name the same device: give both as C{"0000:00:07.0"}, lower case.
    """
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return text


def _bus_key(bus_id: str) -> tuple[int, ...]:
    """Sort key of a normalized bus id: its numbers, in order."""
    parts = bus_id.replace(".", ":").split(":")
    try:
        return tuple(int(p, 16) for p in parts)
    except ValueError:
        return (1 << 32,)


@attrs.frozen
class GpuDevice:
    """
    One physical GPU.

    @ivar index: the nvidia-smi index (the id C{--gpus} takes).
    @ivar minor: the device node's minor: C{/dev/nvidia<minor>}.
    @ivar uuid: C{GPU-...}, or C{None} when unknown.
    @ivar bus_id: the normalized PCI bus id, or C{None} when unknown.
    """

    index: int
    minor: int
    uuid: str | None = None
    bus_id: str | None = None

    @property
    def node(self) -> str:
        return f"/dev/nvidia{self.minor}"

    def as_log_dict(self) -> dict[str, object]:
        return {"index": self.index, "minor": self.minor, "uuid": self.uuid, "bus_id": self.bus_id}


def parse_information(text: str) -> dict[str, str]:
    """The C{Key: value} lines of a driver C{information} file."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def read_proc_gpus(root: str = PROC_GPUS) -> list[GpuDevice]:
    """
    BLOCKING: the GPUs the driver lists under C{root}, indexed in bus order;
    empty when the directory is missing or unreadable.  Entries without a
    device minor are skipped.
    """
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found: list[tuple[str, int, str | None]] = []
    for name in names:
        try:
            with open(os.path.join(root, name, "information"), encoding="utf-8") as f:
                fields = parse_information(f.read())
        except OSError:
            continue
        try:
            minor = int(fields["Device Minor"])
        except (KeyError, ValueError):
            continue
        bus_id = normalize_bus_id(fields.get("Bus Location") or name)
        found.append((bus_id, minor, fields.get("GPU UUID") or None))
    found.sort(key=lambda entry: _bus_key(entry[0]))
    return [
        GpuDevice(index=i, minor=minor, uuid=uuid, bus_id=bus_id)
        for i, (bus_id, minor, uuid) in enumerate(found)
    ]


def parse_nvidia_smi(text: str) -> list[GpuDevice]:
    """
    Rows of C{nvidia-smi --query-gpu=index,uuid,pci.bus_id
    --format=csv,noheader}; the minor is taken to be the index (what the
    driver does unless told otherwise).
    """
    devices = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 3:
            continue
        try:
            index = int(cells[0])
        except ValueError:
            continue
        devices.append(
            GpuDevice(
                index=index,
                minor=index,
                uuid=cells[1] or None,
                bus_id=normalize_bus_id(cells[2]) if cells[2] else None,
            )
        )
    return sorted(devices, key=lambda d: d.index)


def query_nvidia_smi(executable: str = "nvidia-smi") -> str | None:
    """BLOCKING: nvidia-smi's CSV answer, or C{None} when it cannot tell."""
    path = shutil.which(executable)
    if path is None:
        return None
    try:
        done = subprocess.run(
            [path, "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def discover_gpus(root: str = PROC_GPUS, nvidia_smi: str = "nvidia-smi") -> list[GpuDevice]:
    """
    BLOCKING: every GPU of this machine, from the driver's files or else
    nvidia-smi; empty when neither can tell.
    """
    devices = read_proc_gpus(root)
    if devices:
        return devices
    text = query_nvidia_smi(nvidia_smi)
    return parse_nvidia_smi(text) if text else []


def select_gpus(found: Sequence[GpuDevice], ids: Iterable[int]) -> dict[int, GpuDevice]:
    """
    The configured GPUs by id.

    With nothing discovered (no driver files, no nvidia-smi), each id stands
    for itself: node C{/dev/nvidia<id>}, no UUID.

    @raise GpuDiscoveryError: an id names no GPU of this machine.
    """
    wanted = list(dict.fromkeys(ids))
    if not found:
        return {gpu: GpuDevice(index=gpu, minor=gpu) for gpu in wanted}
    by_index = {device.index: device for device in found}
    missing = [gpu for gpu in wanted if gpu not in by_index]
    if missing:
        have = ", ".join(str(d.index) for d in found)
        raise GpuDiscoveryError(
            f"no GPU with id {', '.join(map(str, missing))} on this machine (it has {have})"
        )
    return {gpu: by_index[gpu] for gpu in wanted}


def cuda_environment(
    devices: Sequence[GpuDevice], *, isolated: bool, connections: int | None = None
) -> dict[str, str]:
    """
    The environment that makes CUDA device C{i} of a worker be C{devices[i]},
    with C{connections} hardware work queues per context when given.

    @param isolated: the worker's sandbox holds only these devices' nodes,
        so the driver enumerates just them, in bus order: name them by
        that in-sandbox ordinal.  Otherwise every GPU is visible: name
        them by UUID when known, else by physical index in bus order.
    """
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if isolated:
        order = sorted(
            range(len(devices)),
            key=lambda i: (_bus_key(devices[i].bus_id or ""), devices[i].index),
        )
        ordinal = {position: rank for rank, position in enumerate(order)}
        names = [str(ordinal[i]) for i in range(len(devices))]
    else:
        names = [device.uuid or str(device.index) for device in devices]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(names)
    if connections is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(connections)
    return env
