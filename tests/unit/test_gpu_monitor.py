"""
The GPU monitor's decisions (kcoral.server.leases.monitor), on a fake NVML
(L{FakeGpuSampler}), a fake process table and L{task.Clock}: who may hold a
GPU context, what is killed, which measurements are flagged and why.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyClass, verifyObject

from kcoral.measurement import add_monitor_reasons
from kcoral.server.leases.lease import EXCLUSIVE, MAINTENANCE, LeaseArbiter
from kcoral.server.leases.monitor import (
    EXCUSE_SECONDS,
    GpuMonitor,
    GpuMonitorService,
    ProcFs,
    classify,
    main_pid,
)
from kcoral.server.leases.nvml import IGpuSampler, NvmlSampler, SamplerUnavailable
from kcoral.server.observe.metrics import Metrics
from kcoral.testing.fakes import FakeGpuSampler, FakeProcessTable, MonitoredWorker

SERVER = 100


def at_once(f: Any, *args: Any) -> Deferred[Any]:
    return maybeDeferred(f, *args)


def spawned(table: FakeProcessTable, root: int, ns: int) -> int:
    """A bubblewrap-spawned worker at C{root}: bwrap -> bwrap (init) -> python; its pid."""
    table.add(root, SERVER, "bwrap", ns=1)
    table.add(root + 1, root, "bwrap", ns=ns)
    table.add(root + 2, root + 1, "python3", ns=ns)
    return root + 2


def forked(table: FakeProcessTable, root: int, ns: int) -> int:
    """A template-forked worker: kcoral-sandbox -> kcoral-init, kcoral-worker; its pid."""
    table.add(50, SERVER, "kcoral-template", ns=1) if 50 not in table.table else None
    table.add(root, 50, "kcoral-sandbox", ns=1)
    table.add(root + 1, root, "kcoral-init", ns=ns)
    table.add(root + 2, root, "kcoral-worker", ns=ns)
    return root + 2


class Setup:
    def __init__(self, gpus: tuple[int, ...] = (0,)) -> None:
        self.clock = Clock()
        self.clock.advance(1000.0)
        self.sampler = FakeGpuSampler(self.clock, names={g: "NVIDIA H200" for g in gpus})
        self.table = FakeProcessTable()
        self.table.add(SERVER, 1, "twistd")
        self.leases = LeaseArbiter(gpus, self.clock)
        self.monitor = GpuMonitor(
            self.sampler,
            self.leases,
            self.clock,
            at_once,
            processes=self.table,
            server_pid=SERVER,
            kill=self.table.kill,
        )

    def worker(self, root: int, seat: str, how: Any = spawned) -> tuple[MonitoredWorker, int]:
        main = how(self.table, root, ns=root)
        return MonitoredWorker(root, seat=seat), main

    def hold(self, worker: MonitoredWorker, label: str, mode: str = EXCLUSIVE) -> None:
        self.leases.acquire(worker, (0,), label, mode)
        worker.request_id = label

    def judge(self, worker: MonitoredWorker, start: float, stop: float) -> Any:
        return self.successResultOf(self.monitor.judge(worker, (0,), start, stop))

    def successResultOf(self, d: Deferred[Any]) -> Any:
        results: list[Any] = []
        d.addBoth(results.append)
        assert results, "not fired"
        return results[0]


class SamplerTests(SynchronousTestCase):
    def test_interfaces(self) -> None:
        """The fake and NVML samplers provide IGpuSampler."""
        verifyObject(IGpuSampler, FakeGpuSampler(Clock()))
        verifyClass(IGpuSampler, NvmlSampler)

    def test_fake_usage_since(self) -> None:
        """A reading returns only the utilization samples newer than asked, as NVML does."""
        clock = Clock()
        sampler = FakeGpuSampler(clock)
        sampler.use(0, 7, at=1.0)
        sampler.use(0, 7, at=2.0)
        self.assertEqual([u.at for u in sampler.sample(0, 1.0).usage], [2.0])

    def test_fake_unavailable(self) -> None:
        sampler = FakeGpuSampler(Clock(), broken=True)
        self.assertRaises(SamplerUnavailable, sampler.sample, 0, 0.0)


class WhoIsWhoTests(SynchronousTestCase):
    def test_main_of_spawned_worker(self) -> None:
        """A spawned worker's own process is the python under bubblewrap's two processes."""
        table = FakeProcessTable()
        main = spawned(table, 200, ns=9)
        table.add(300, main, "python3", ns=9)  # something its program started
        self.assertEqual(main_pid(200, table), main)

    def test_main_of_forked_worker(self) -> None:
        """A forked worker's pid is its kcoral-sandbox; its own process is kcoral-worker."""
        table = FakeProcessTable()
        main = forked(table, 200, ns=9)
        self.assertEqual(main_pid(200, table), main)

    def test_main_is_oldest_whatever_the_names(self) -> None:
        """A child named like a sandbox process or the worker cannot pass for the worker."""
        table = FakeProcessTable()
        main = forked(table, 200, ns=9)
        table.add(400, main, "kcoral-worker", ns=9)
        self.assertEqual(main_pid(200, table), main)

    def _roles(self, how: Any) -> tuple[FakeProcessTable, MonitoredWorker, int, dict[int, Any]]:
        table = FakeProcessTable()
        table.add(SERVER, 1, "twistd")
        worker = MonitoredWorker(200)
        main = how(table, 200, ns=9)
        return table, worker, main, {200: worker}

    def test_child_double_fork_and_exec(self) -> None:
        """A child, a double-forked orphan and an exec'd binary all belong to the worker."""
        for how in (spawned, forked):
            table, worker, main, roots = self._roles(how)
            mains = {main: worker}
            table.add(301, main, "python3", ns=9)  # child
            init = 201  # both sandboxes' init: where orphans go
            table.add(302, init, "python3", ns=9)  # double fork, re-parented
            table.add(303, main, "gemm-binary", ns=9)  # exec'd binary
            self.assertEqual(classify(main, mains, roots, table, SERVER).kind, "main")
            for pid in (301, 302, 303):
                role = classify(pid, mains, roots, table, SERVER)
                self.assertEqual((role.kind, role.worker), ("descendant", worker), (how, pid))

    def test_orphan_found_by_namespace(self) -> None:
        """A process in a worker's PID namespace but outside its tree is still its."""
        table, worker, main, roots = self._roles(forked)
        table.add(310, 1, "python3", ns=9)
        role = classify(310, {main: worker}, roots, table, SERVER)
        self.assertEqual((role.kind, role.worker), ("descendant", worker))

    def test_foreign_and_servers_own(self) -> None:
        """Not under the server: foreign; under it but no worker's: the server's own."""
        table, worker, main, roots = self._roles(spawned)
        table.add(500, 1, "python3")
        table.add(501, SERVER, "nvidia-smi")
        self.assertEqual(classify(500, {main: worker}, roots, table, SERVER).kind, "foreign")
        role = classify(501, {main: worker}, roots, table, SERVER)
        self.assertEqual((role.kind, role.worker), ("descendant", None))

    def test_procfs_reads_this_process(self) -> None:
        """The real table reads this process's parent, name and namespace."""
        import os

        procfs = ProcFs()
        self.assertEqual(procfs.parent_of(os.getpid()), os.getppid())
        self.assertIsNotNone(procfs.name_of(os.getpid()))
        self.assertIsNotNone(procfs.started_at(os.getpid()))
        self.assertIsNotNone(procfs.pid_namespace(os.getpid()))
        self.assertIsNone(procfs.parent_of(2**22 + 12345))


class ExclusivityTests(SynchronousTestCase):
    def test_descendant_with_context_killed(self) -> None:
        """
        A process the program started that holds a GPU context is killed at
        once with its own children, the worker's request fails naming it,
        and the log names worker and request; the worker's own context stays.
        """
        s = Setup()
        victim, victim_main = s.worker(200, "gpu0/w0")
        attacker, attacker_main = s.worker(400, "gpu0/w1")
        s.hold(attacker, "warmup:gpu0/w1", MAINTENANCE)
        s.leases.release(attacker)
        attacker.request_id = "req-attacker"
        s.table.add(450, attacker_main, "python3", ns=400)
        s.table.add(451, 450, "python3", ns=400)
        s.sampler.processes[0] = (victim_main, attacker_main, 450)
        s.hold(victim, "req-victim")
        with capturedLogs() as events:
            s.successResultOf(s.monitor.poll())
        self.assertEqual(s.table.killed, [450, 451])
        self.assertEqual(len(attacker.violations), 1)
        self.assertIn("process 450 (python3), started by the program", attacker.violations[0])
        self.assertEqual(victim.violations, [])
        killed = [e for e in events if e.get("kcoral_event") == "gpu_descendant_killed"]
        self.assertEqual(len(killed), 1)
        self.assertEqual(killed[0]["worker_id"], "gpu0/w1")
        self.assertEqual(killed[0]["request_id"], "req-attacker")
        # Listed again before it is reaped: not killed or reported twice.
        s.table.add(450, attacker_main, "python3", ns=400)
        s.table.table[450] = (attacker_main, "python3", -1, 400)
        s.monitor._killed.add((450, -1))
        s.successResultOf(s.monitor.poll())
        self.assertEqual(len(attacker.violations), 1)

    def test_foreign_process_never_killed(self) -> None:
        """A process that is not the server's is reported, not killed."""
        s = Setup()
        victim, main = s.worker(200, "gpu0/w0")
        s.table.add(900, 1, "python3")
        s.sampler.processes[0] = (main, 900)
        s.hold(victim, "req-victim")
        s.successResultOf(s.monitor.poll())
        self.assertEqual(s.table.killed, [])


class InterferenceTests(SynchronousTestCase):
    def test_idle_run_not_flagged(self) -> None:
        """Only the holder's own use: no reason; the summary says what was read."""
        s = Setup()
        worker, main = s.worker(200, "gpu0/w0")
        s.hold(worker, "req-1")
        start = s.clock.seconds()
        for _ in range(3):
            s.clock.advance(0.2)
            s.sampler.use(0, main, sm=90)
            s.successResultOf(s.monitor.poll())
        reasons, summary = s.judge(worker, start, s.clock.seconds())
        self.assertEqual(reasons, [])
        self.assertEqual(summary["samples"], 4)  # and the one judge() reads
        self.assertEqual(summary["sm_clock_mhz"]["min"], 1980)
        self.assertEqual(summary["other_processes"], [])
        self.assertEqual(summary["throttle_reasons"], [])

    def test_other_worker_flagged_and_logged(self) -> None:
        """
        Another worker's process using the GPU during a hold flags the
        holder's measurement naming it, and is logged once per hold.
        """
        s = Setup()
        victim, victim_main = s.worker(200, "gpu0/w0")
        other, other_main = s.worker(400, "gpu0/w1")
        s.hold(other, "warmup:gpu0/w1", MAINTENANCE)
        s.leases.release(other)
        other.request_id = "req-other"
        s.clock.advance(5.0)
        s.hold(victim, "req-victim")
        start = s.clock.seconds()
        with capturedLogs() as events:
            for _ in range(3):
                s.clock.advance(0.2)
                s.sampler.use(0, victim_main, sm=50)
                s.sampler.use(0, other_main, sm=40)
                s.successResultOf(s.monitor.poll())
        reasons, summary = s.judge(victim, start, s.clock.seconds())
        self.assertEqual([code for code, _ in reasons], ["interference"])
        self.assertIn("worker gpu0/w1 running request req-other", reasons[0][1])
        self.assertIn("3 utilization samples", reasons[0][1])
        self.assertEqual(summary["other_processes"], [other_main])
        logged = [e for e in events if e.get("kcoral_event") == "gpu_interference"]
        self.assertEqual(len(logged), 1)
        self.assertEqual(logged[0]["worker_id"], "gpu0/w0")
        self.assertEqual(logged[0]["request_id"], "req-victim")
        self.assertEqual(logged[0]["offender_worker_id"], "gpu0/w1")
        self.assertEqual(logged[0]["offender_request_id"], "req-other")
        self.assertEqual(s.table.killed, [])

    def test_previous_holder_excused(self) -> None:
        """The last holder's sample just after its release is not interference."""
        s = Setup()
        first, first_main = s.worker(200, "gpu0/w0")
        second, _ = s.worker(400, "gpu0/w1")
        s.hold(first, "req-1")
        s.clock.advance(1.0)
        s.leases.release(first)
        s.hold(second, "req-2")
        start = s.clock.seconds()
        s.sampler.use(0, first_main, at=start + EXCUSE_SECONDS / 2)
        s.clock.advance(EXCUSE_SECONDS * 2)
        reasons, _ = s.judge(second, start, s.clock.seconds())
        self.assertEqual(reasons, [])
        # ... but not long after it.
        s.sampler.use(0, first_main)
        s.clock.advance(0.1)
        reasons, _ = s.judge(second, start, s.clock.seconds())
        self.assertEqual([code for code, _ in reasons], ["interference"])

    def test_use_outside_window_ignored(self) -> None:
        """Foreign use before the timed loop or after it does not flag it."""
        s = Setup()
        worker, _ = s.worker(200, "gpu0/w0")
        s.table.add(900, 1, "python3")
        s.hold(worker, "req-1")
        s.sampler.use(0, 900)
        s.clock.advance(1.0)
        start = s.clock.seconds()
        s.clock.advance(1.0)
        stop = s.clock.seconds()
        s.clock.advance(0.5)
        s.sampler.use(0, 900)
        reasons, _ = s.judge(worker, start, stop)
        self.assertEqual(reasons, [])

    def test_zero_use_ignored(self) -> None:
        """A process with a context that did nothing (an idle worker) is not interference."""
        s = Setup()
        worker, _ = s.worker(200, "gpu0/w0")
        s.table.add(900, 1, "python3")
        s.hold(worker, "req-1")
        start = s.clock.seconds()
        s.sampler.use(0, 900, sm=0, mem=0)
        s.clock.advance(0.5)
        self.assertEqual(s.judge(worker, start, s.clock.seconds())[0], [])

    def test_throttling_flagged(self) -> None:
        """A power cap during the loop flags it; GPU idle alone does not."""
        s = Setup()
        worker, _ = s.worker(200, "gpu0/w0")
        s.hold(worker, "req-1")
        start = s.clock.seconds()
        s.sampler.throttle = 0x1
        s.clock.advance(0.2)
        s.successResultOf(s.monitor.poll())
        self.assertEqual(s.judge(worker, start, s.clock.seconds())[0], [])
        s.sampler.throttle = 0x4 | 0x1
        s.sampler.sm_clock_mhz = 1500
        with capturedLogs() as events:
            s.clock.advance(0.2)
            s.successResultOf(s.monitor.poll())
            s.successResultOf(s.monitor.poll())
        reasons, summary = s.judge(worker, start, s.clock.seconds())
        self.assertEqual([code for code, _ in reasons], ["throttled"])
        self.assertIn("sw_power_cap", reasons[0][1])
        self.assertEqual(summary["throttle_reasons"], ["sw_power_cap"])
        self.assertEqual(summary["sm_clock_mhz"]["min"], 1500)
        logged = [e for e in events if e.get("kcoral_event") == "gpu_throttled"]
        self.assertEqual(len(logged), 1)
        self.assertEqual(logged[0]["reasons"], ["sw_power_cap"])

    def test_unreadable_gpu(self) -> None:
        """NVML failing is logged once; a measurement is judged on what there is."""
        s = Setup()
        worker, _ = s.worker(200, "gpu0/w0")
        s.hold(worker, "req-1")
        s.sampler.broken = True
        with capturedLogs() as events:
            s.successResultOf(s.monitor.poll())
            s.successResultOf(s.monitor.poll())
        self.assertEqual(len([e for e in events if e.get("log_failure")]), 1)
        reasons, summary = s.judge(worker, 0.0, s.clock.seconds())
        self.assertEqual((reasons, summary["samples"]), ([], 0))
        self.flushLoggedErrors(SamplerUnavailable)

    def test_loop_on_clock(self) -> None:
        """start() reads every interval on the clock; stop() ends it."""
        s = Setup()
        s.monitor.start()
        s.clock.advance(s.monitor.interval)
        s.clock.advance(s.monitor.interval)
        self.assertEqual(s.sampler.reads, 3)
        s.monitor.stop()
        s.clock.advance(1.0)
        self.assertEqual(s.sampler.reads, 3)


class ResultTests(SynchronousTestCase):
    def test_reasons_join_validity(self) -> None:
        """The monitor's reasons join the measurement's own; the summary goes under "gpu"."""
        result: dict[str, Any] = {"validity": {"ok": False, "reasons": ["envelope: x"]}}
        add_monitor_reasons(result, [("interference", "y")], {"samples": 2})
        self.assertEqual(
            result["validity"], {"ok": False, "reasons": ["envelope: x", "interference: y"]}
        )
        self.assertEqual(result["gpu"], {"samples": 2})
        clean: dict[str, Any] = {"validity": {"ok": True, "reasons": []}}
        add_monitor_reasons(clean, [], {"samples": 1})
        self.assertEqual(clean["validity"], {"ok": True, "reasons": []})

    def test_metrics_count(self) -> None:
        """/metrics counts interference, throttling and killed descendants by GPU."""
        metrics = Metrics()
        metrics({"kcoral_event": "gpu_interference", "gpu_id": 0})
        metrics({"kcoral_event": "gpu_throttled", "gpu_id": 0})
        metrics({"kcoral_event": "gpu_descendant_killed", "gpu_id": 1})
        text = metrics.render()[0].decode()
        self.assertIn('kcoral_gpu_interference_total{gpu="0"} 1.0', text)
        self.assertIn('kcoral_gpu_throttled_total{gpu="0"} 1.0', text)
        self.assertIn('kcoral_gpu_descendants_killed_total{gpu="1"} 1.0', text)


class ServiceTests(SynchronousTestCase):
    def test_started_with_peaks(self) -> None:
        """Once NVML reads every GPU, the leases get the monitor, with each GPU's peaks."""
        s = Setup()
        service = GpuMonitorService(s.leases, s.clock, at_once, sampler=s.sampler)
        with capturedLogs() as events:
            service.startService()
        self.assertIs(s.leases.monitor, service.monitor)
        peak = service.monitor.peak_of((0,))
        assert peak is not None
        self.assertEqual(peak.name, "NVIDIA H200")
        started = [e for e in events if e.get("kcoral_event") == "gpu_monitor_started"]
        self.assertAlmostEqual(started[0]["bandwidth_nvml"][0] / 1e12, 4.81, places=2)
        service.stopService()
        self.assertIsNone(s.leases.monitor)

    def test_unknown_device_uses_nvml_bandwidth(self) -> None:
        s = Setup()
        s.sampler.names[0] = "Some GPU"
        service = GpuMonitorService(s.leases, s.clock, at_once, sampler=s.sampler)
        service.startService()
        peak = service.monitor.peak_of((0,))
        assert peak is not None
        self.assertEqual((peak.name, peak.flops), ("Some GPU", {}))
        service.stopService()

    def test_unavailable(self) -> None:
        """No NVML: logged, and nothing is judged."""
        s = Setup()
        s.sampler.broken = True
        service = GpuMonitorService(s.leases, s.clock, at_once, sampler=s.sampler)
        with capturedLogs() as events:
            service.startService()
        self.assertIsNone(s.leases.monitor)
        self.assertEqual(
            [e["kcoral_event"] for e in events if e.get("kcoral_event")],
            ["gpu_monitor_unavailable"],
        )
        service.stopService()


class WiringTests(SynchronousTestCase):
    def test_service_runs_the_monitor_on_gpu_servers(self) -> None:
        """A GPU server alone runs the monitor (unless the interval is 0); a CPU server does not."""
        from twisted.internet.testing import MemoryReactorClock

        from kcoral.config import ServerConfig
        from kcoral.server.service import KCoralService

        def children(**kw: Any) -> list[str]:
            config = ServerConfig(log_dir=None, disk_cache_dir=None, **kw)
            return [s.name for s in KCoralService(config, None, reactor=MemoryReactorClock())]

        self.assertIn("gpu-monitor", children(device="gpu", gpus=(0,)))
        self.assertNotIn("gpu-monitor", children(device="gpu", gpus=(0,), gpu_monitor_interval=0))
        self.assertNotIn("gpu-monitor", children(device="cpu"))
