"""
Tests for L{kcoral.server.leases.gpus}: GPU discovery from fake driver files and
nvidia-smi output, and what each worker is told to see.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.leases.gpus import (
    GpuDevice,
    GpuDiscoveryError,
    cuda_environment,
    discover_gpus,
    normalize_bus_id,
    parse_information,
    parse_nvidia_smi,
    read_proc_gpus,
    select_gpus,
)
from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox
from kcoral.server.sandbox.nosandbox import NoSandbox
from kcoral.server.workers.pool import WorkerPool
from kcoral.testing.fakes import FakeSandbox, FakeSpawner, FakeWorker, pool_config

#: What the driver writes (seen on a two-H200 machine), with placeholders.
INFORMATION = (
    "Model: \t\t NVIDIA H200\n"
    "IRQ:   \t\t 41\n"
    "GPU UUID: \t {uuid}\n"
    "Video BIOS: \t 96.00.a5.00.1a\n"
    "Bus Type: \t PCIe\n"
    "DMA Size: \t 52 bits\n"
    "DMA Mask: \t 0xfffffffffffff\n"
    "Bus Location: \t {bus}\n"
    "Device Minor: \t {minor}\n"
    "GPU Firmware: \t 580.159.04\n"
    "GPU Excluded:\t No\n"
)

UUID_A = "GPU-34bb36a1-773b-2ecb-4d06-2ce78e9fdef2"
UUID_B = "GPU-d8ac3bd7-0d3c-09d4-23a8-3c50b3d4a908"


def _fake_proc(test: SynchronousTestCase, gpus: list[tuple[str, int, str]]) -> str:
    """A fake C{/proc/driver/nvidia/gpus}: one directory per (bus, minor, uuid)."""
    root = tempfile.mkdtemp(prefix="kcoral-test-gpus-")
    test.addCleanup(_remove, root)
    for bus, minor, uuid in gpus:
        os.mkdir(os.path.join(root, bus))
        with open(os.path.join(root, bus, "information"), "w") as f:
            f.write(INFORMATION.format(uuid=uuid, bus=bus, minor=minor))
    return root


def _remove(root: str) -> None:
    import shutil

    shutil.rmtree(root, ignore_errors=True)


class ParseTests(SynchronousTestCase):
    def test_information(self) -> None:
        fields = parse_information(INFORMATION.format(uuid=UUID_A, bus="0000:00:06.0", minor=3))
        self.assertEqual(fields["GPU UUID"], UUID_A)
        self.assertEqual(fields["Bus Location"], "0000:00:06.0")
        self.assertEqual(fields["Device Minor"], "3")
        self.assertEqual(fields["Model"], "NVIDIA H200")

    def test_bus_ids_compare_across_sources(self) -> None:
        self.assertEqual(normalize_bus_id("00000000:00:07.0"), "0000:00:07.0")
        self.assertEqual(normalize_bus_id("0000:1A:00.0"), "0000:1a:00.0")
        self.assertEqual(normalize_bus_id("odd"), "odd")

    def test_nvidia_smi(self) -> None:
        text = (
            f"1, {UUID_B}, 00000000:00:07.0\n0, {UUID_A}, 00000000:00:06.0\nNo devices were found\n"
        )
        self.assertEqual(
            parse_nvidia_smi(text),
            [
                GpuDevice(0, 0, UUID_A, "0000:00:06.0"),
                GpuDevice(1, 1, UUID_B, "0000:00:07.0"),
            ],
        )


class ProcDiscoveryTests(SynchronousTestCase):
    def test_indexes_follow_bus_order_minors_from_the_driver(self) -> None:
        """Minors need not equal indexes: the index is the bus order, the minor the node."""
        root = _fake_proc(
            self,
            [("0000:41:00.0", 0, UUID_B), ("0000:00:06.0", 2, UUID_A)],
        )
        self.assertEqual(
            read_proc_gpus(root),
            [
                GpuDevice(0, 2, UUID_A, "0000:00:06.0"),
                GpuDevice(1, 0, UUID_B, "0000:41:00.0"),
            ],
        )

    def test_missing_directory(self) -> None:
        self.assertEqual(read_proc_gpus("/nonexistent-kcoral-proc"), [])

    def test_entry_without_minor_skipped(self) -> None:
        root = _fake_proc(self, [("0000:00:06.0", 0, UUID_A)])
        os.mkdir(os.path.join(root, "0000:00:07.0"))
        with open(os.path.join(root, "0000:00:07.0", "information"), "w") as f:
            f.write("Model: \t\t something\n")
        self.assertEqual([d.uuid for d in read_proc_gpus(root)], [UUID_A])

    def test_discover_prefers_driver_files(self) -> None:
        root = _fake_proc(self, [("0000:00:06.0", 5, UUID_A)])
        self.assertEqual(
            discover_gpus(root, nvidia_smi="/nonexistent/nvidia-smi"),
            [GpuDevice(0, 5, UUID_A, "0000:00:06.0")],
        )

    def test_discover_nvidia_smi_fallback(self) -> None:
        """Without driver files, nvidia-smi's answer is used (minor = index)."""
        bindir = tempfile.mkdtemp(prefix="kcoral-test-smi-")
        self.addCleanup(_remove, bindir)
        smi = os.path.join(bindir, "nvidia-smi")
        with open(smi, "w") as f:
            f.write(f"#!/bin/sh\necho '0, {UUID_A}, 00000000:00:06.0'\n")
        os.chmod(smi, 0o755)
        self.assertEqual(
            discover_gpus("/nonexistent-kcoral-proc", nvidia_smi=smi),
            [GpuDevice(0, 0, UUID_A, "0000:00:06.0")],
        )

    def test_discover_nothing(self) -> None:
        self.assertEqual(
            discover_gpus("/nonexistent-kcoral-proc", nvidia_smi="/nonexistent/nvidia-smi"), []
        )


FOUND = [
    GpuDevice(0, 1, UUID_A, "0000:00:06.0"),
    GpuDevice(1, 0, UUID_B, "0000:00:07.0"),
]


class SelectTests(SynchronousTestCase):
    def test_select(self) -> None:
        self.assertEqual(select_gpus(FOUND, [1]), {1: FOUND[1]})
        self.assertEqual(select_gpus(FOUND, [1, 0, 1]), {1: FOUND[1], 0: FOUND[0]})

    def test_unknown_id(self) -> None:
        with self.assertRaises(GpuDiscoveryError) as caught:
            select_gpus(FOUND, [0, 2])
        self.assertEqual(str(caught.exception), "no GPU with id 2 on this machine (it has 0, 1)")

    def test_nothing_discovered_ids_stand_for_themselves(self) -> None:
        self.assertEqual(select_gpus([], [3]), {3: GpuDevice(3, 3)})


class CudaEnvironmentTests(SynchronousTestCase):
    def test_isolated_single_gpu_is_ordinal_zero(self) -> None:
        """In the sandbox GPU 1 is the only device the driver enumerates: ordinal 0."""
        self.assertEqual(
            cuda_environment([FOUND[1]], isolated=True),
            {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"},
        )

    def test_connections(self) -> None:
        """The context's work queues, when given, are CUDA_DEVICE_MAX_CONNECTIONS."""
        env = cuda_environment([FOUND[0]], isolated=True, connections=4)
        self.assertEqual(env["CUDA_DEVICE_MAX_CONNECTIONS"], "4")

    def test_isolated_ordinals_follow_bus_order(self) -> None:
        """CUDA device i is devices[i]: the ordinals are ranks in bus order."""
        self.assertEqual(
            cuda_environment([FOUND[1], FOUND[0]], isolated=True)["CUDA_VISIBLE_DEVICES"], "1,0"
        )
        self.assertEqual(cuda_environment(FOUND, isolated=True)["CUDA_VISIBLE_DEVICES"], "0,1")

    def test_isolated_without_bus_ids_uses_index_order(self) -> None:
        devices = [GpuDevice(3, 3), GpuDevice(1, 1)]
        self.assertEqual(cuda_environment(devices, isolated=True)["CUDA_VISIBLE_DEVICES"], "1,0")

    def test_shared_names_uuids(self) -> None:
        """Without isolation every GPU is visible: UUIDs say which."""
        self.assertEqual(
            cuda_environment([FOUND[1]], isolated=False),
            {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": UUID_B},
        )

    def test_shared_without_uuid_uses_index(self) -> None:
        self.assertEqual(
            cuda_environment([GpuDevice(1, 1), GpuDevice(0, 0)], isolated=False)[
                "CUDA_VISIBLE_DEVICES"
            ],
            "1,0",
        )

    def test_sandboxes_say_whether_they_isolate(self) -> None:
        self.assertTrue(BubblewrapSandbox([]).isolates_devices)
        self.assertFalse(NoSandbox().isolates_devices)


class PoolSpawnTests(SynchronousTestCase):
    """The pool binds each worker's own device nodes and numbers its GPUs from 0."""

    def start(self, isolates: bool) -> tuple[FakeSandbox, list[FakeWorker]]:
        sandbox = FakeSandbox(
            isolates_devices=isolates, env={"CUDA_VISIBLE_DEVICES": "from-the-front-end"}
        )
        spawner = FakeSpawner(arch="sm_90a")
        pool = WorkerPool(
            pool_config(device="gpu", gpus=(0, 1), max_requests_per_worker=0),
            MemoryReactorClock(),
            None,
            sandbox,
            lambda f, *a, **k: maybeDeferred(f, *a, **k),
            Path("/nonexistent-kcoral-root"),
        )
        pool.maker.spawn_worker = spawner
        pool.maker.gpu_devices = {0: FOUND[0], 1: FOUND[1]}
        self.successResultOf(Deferred.fromCoroutine(pool.start()))
        return sandbox, spawner.spawned

    def test_sandboxed_workers_see_their_gpu_as_zero(self) -> None:
        sandbox, workers = self.start(isolates=True)
        # GPU 0 is node 1 and GPU 1 node 0 on this (fake) machine.
        self.assertEqual(sandbox.nodes, [["1"], ["0"]])
        self.assertEqual([w.gpus for w in workers], [(0,), (1,)])
        self.assertEqual([w.env["CUDA_VISIBLE_DEVICES"] for w in workers], ["0", "0"])
        self.assertEqual({w.env["CUDA_DEVICE_ORDER"] for w in workers}, {"PCI_BUS_ID"})

    def test_unsandboxed_workers_get_uuids(self) -> None:
        _, workers = self.start(isolates=False)
        self.assertEqual([w.env["CUDA_VISIBLE_DEVICES"] for w in workers], [UUID_A, UUID_B])
