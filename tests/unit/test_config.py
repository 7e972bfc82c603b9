"""
Tests for L{kcoral.config}.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import (
    DEFAULT_SPARE_WORKERS_PER_GPU,
    ServerConfig,
    default_cache_capacity,
    default_disk_cache_dir,
)


class DefaultsTests(SynchronousTestCase):
    """
    L{ServerConfig} has the reference server's Python defaults.
    """

    def test_defaults(self) -> None:
        """
        Every field defaults to the value listed for the reference server,
        plus C{tensor_api="auto"} and the log level and retention defaults.
        """
        config = ServerConfig(disk_cache_dir=None)
        expected = {
            "gpus": (0,),
            "log_dir": None,
            "log_console": True,
            "log_programs": True,
            "cache_capacity_bytes": default_cache_capacity(),
            "disk_cache_dir": None,
            "disk_cache_capacity_mbytes": 16384,
            "default_timeout_seconds": 300.0,
            "max_timeout_seconds": 900.0,
            "worker_wait_timeout_seconds": 1800.0,
            "workers_per_gpu": 8,
            "max_requests_per_worker": 1,
            "spare_workers_per_gpu": None,
            "cuda_connections": None,
            "reuse_scope": "address",
            "sandbox": "bubblewrap",
            "sandbox_readonly_paths": (),
            "worker_termination_grace_seconds": 5.0,
            "gpu_monitor_interval": 0.2,
            "max_request_bytes": 256 * 1024**2,
            "max_response_bytes": 256 * 1024**2,
            "output_limit_bytes": 1024**2,
            "max_output_limit_bytes": 16 * 1024**2,
            "output_space_bytes": 64 * 1024**2,
            "device": "gpu",
            "num_workers": 1,
            "tensor_api": "auto",
            "worker_start": "fork",
            "log_level": "info",
            "log_retention_days": 30.0,
            "log_retention_mbytes": 10240,
            "auth_token_file": None,
            "public_metrics": False,
            "header_timeout_seconds": 30.0,
            "body_timeout_seconds": 300.0,
            "max_connections": 4096,
            "finish_abandoned": False,
            "max_queued_requests": 1024,
            "max_bytes_in_flight": 2 * 1024**3,
            "max_channel_bytes": 512 * 1024**2,
            "workspace_bytes": 1024**3,
            "max_bytes_per_client": 512 * 1024**2,
            "body_stall_seconds": 30.0,
            "max_connections_per_client": 1024,
            "first_header_timeout_seconds": 10.0,
            "front_ends": 1,
            "lame_duck_seconds": 0.0,
            "join_url": None,
            "join_node_id": None,
            "join_credentials": None,
        }
        self.assertEqual(attrs.asdict(config, recurse=False), expected)

    def test_no_router_fields(self) -> None:
        """
        Router mode is out of scope: no C{router_endpoint}, C{node_id} or
        C{node_token} field exists.
        """
        names = {a.name for a in attrs.fields(ServerConfig)}
        self.assertFalse(names & {"router_endpoint", "node_id", "node_token"})

    def test_frozen_keyword_only(self) -> None:
        """
        The config is immutable and built with keywords only; C{attrs.evolve}
        makes a changed copy.
        """
        config = ServerConfig()
        self.assertRaises(attrs.exceptions.FrozenInstanceError, setattr, config, "device", "cpu")
        self.assertRaises(TypeError, ServerConfig, (0,))
        self.assertEqual(attrs.evolve(config, device="cpu").device, "cpu")

    def test_disk_cache_dir_default(self) -> None:
        """
        The default disk cache directory follows the XDG rule for the
        current environment.
        """
        self.assertEqual(ServerConfig().disk_cache_dir, default_disk_cache_dir())


class ConversionTests(SynchronousTestCase):
    """
    L{ServerConfig} normalises the types of its fields.
    """

    def test_gpus_tuple(self) -> None:
        """
        C{gpus} given as a list is stored as a tuple.
        """
        self.assertEqual(ServerConfig(gpus=[2, 3]).gpus, (2, 3))

    def test_paths(self) -> None:
        """
        Path fields given as strings become L{Path}s; read-only paths become
        a tuple of L{Path}s.
        """
        config = ServerConfig(
            log_dir="logs", disk_cache_dir="/var/cache/x", sandbox_readonly_paths=["/opt/a", "/b"]
        )
        self.assertEqual(config.log_dir, Path("logs"))
        self.assertEqual(config.disk_cache_dir, Path("/var/cache/x"))
        self.assertEqual(config.sandbox_readonly_paths, (Path("/opt/a"), Path("/b")))

    def test_timeouts_float(self) -> None:
        """
        Integer timeouts are stored as floats.
        """
        config = ServerConfig(default_timeout_seconds=10, max_timeout_seconds=20)
        self.assertEqual(config.default_timeout_seconds, 10.0)
        self.assertIsInstance(config.max_timeout_seconds, float)


class ValidationTests(SynchronousTestCase):
    """
    An invalid L{ServerConfig} raises L{ValueError} naming the field.
    """

    def assertInvalid(self, message: str, **kwargs: object) -> None:
        """
        Constructing with C{kwargs} fails with C{message}.
        """
        with self.assertRaises(ValueError) as cm:
            ServerConfig(**kwargs)  # type: ignore[arg-type]
        self.assertEqual(str(cm.exception), message)

    def test_negative_sizes(self) -> None:
        """
        Every byte size and capacity must be non-negative.
        """
        for name in [
            "cache_capacity_bytes",
            "disk_cache_capacity_mbytes",
            "max_request_bytes",
            "max_response_bytes",
            "output_limit_bytes",
            "max_output_limit_bytes",
            "max_requests_per_worker",
        ]:
            self.assertInvalid(f"{name} must be non-negative, got -1", **{name: -1})

    def test_zero_sizes_allowed(self) -> None:
        """
        Zero disables the disk cache and makes workers reusable.
        """
        config = ServerConfig(disk_cache_capacity_mbytes=0, max_requests_per_worker=0)
        self.assertEqual(config.disk_cache_capacity_mbytes, 0)

    def test_worker_counts(self) -> None:
        """
        C{num_workers} and C{workers_per_gpu} must be at least 1.
        """
        self.assertInvalid("num_workers must be at least 1, got 0", num_workers=0)
        self.assertInvalid("workers_per_gpu must be at least 1, got 0", workers_per_gpu=0)

    def test_integer_types(self) -> None:
        """
        Integer fields reject other types, including booleans.
        """
        self.assertInvalid("num_workers must be an integer, got '2'", num_workers="2")
        self.assertInvalid("workers_per_gpu must be an integer, got True", workers_per_gpu=True)

    def test_empty_gpus_gpu_mode(self) -> None:
        """
        GPU mode needs at least one GPU; CPU mode ignores C{gpus}.
        """
        self.assertInvalid("gpus must name at least one GPU in GPU mode", gpus=[])
        self.assertEqual(ServerConfig(device="cpu", gpus=()).gpus, ())

    def test_negative_gpu(self) -> None:
        """
        GPU ids are non-negative integers.
        """
        self.assertInvalid("gpus must not contain negative ids, got -1", gpus=[0, -1])
        self.assertInvalid("gpus must contain integers, got '1'", gpus=["1"])

    def test_repeated_gpus(self) -> None:
        """
        GPU mode rejects a GPU id given twice (issue 17, item 9): each id
        owns its seats and their directories.  CPU mode ignores C{gpus}.
        """
        self.assertInvalid("gpus must not repeat a GPU id, got 0 more than once", gpus=[0, 0])
        self.assertInvalid(
            "gpus must not repeat a GPU id, got 1, 3 more than once", gpus=[3, 1, 2, 1, 3]
        )
        self.assertEqual(ServerConfig(device="cpu", gpus=[0, 0]).gpus, (0, 0))

    def test_default_exceeds_max_timeout(self) -> None:
        """
        The default execution budget may not exceed the maximum.
        """
        self.assertInvalid(
            "default_timeout_seconds must not exceed max_timeout_seconds, got 901.0 > 900.0",
            default_timeout_seconds=901,
        )

    def test_non_positive_timeouts(self) -> None:
        """
        Execution budgets must be positive; the worker wait and the grace
        period may be zero but not negative.
        """
        self.assertInvalid(
            "default_timeout_seconds must be positive, got 0.0", default_timeout_seconds=0
        )
        self.assertInvalid("max_timeout_seconds must be positive, got -1.0", max_timeout_seconds=-1)
        self.assertInvalid(
            "worker_wait_timeout_seconds must be non-negative, got -1.0",
            worker_wait_timeout_seconds=-1,
        )
        self.assertInvalid(
            "worker_termination_grace_seconds must be non-negative, got -0.5",
            worker_termination_grace_seconds=-0.5,
        )
        self.assertEqual(ServerConfig(worker_wait_timeout_seconds=0).worker_wait_timeout_seconds, 0)

    def test_timeout_type(self) -> None:
        """
        Timeouts must be numbers.
        """
        self.assertInvalid(
            "max_timeout_seconds must be a number, got '900'", max_timeout_seconds="900"
        )

    def test_unknown_device(self) -> None:
        """
        The device is C{cpu} or C{gpu}.
        """
        self.assertInvalid("device must be 'cpu' or 'gpu', got 'tpu'", device="tpu")

    def test_unknown_sandbox(self) -> None:
        """
        The sandbox is C{none}, C{bubblewrap} or C{auto}.
        """
        self.assertInvalid(
            "sandbox must be one of 'none', 'bubblewrap', 'auto', got 'docker'", sandbox="docker"
        )

    def test_unknown_tensor_api(self) -> None:
        """
        The tensor API is C{auto}, C{torch} or C{pycuda}.
        """
        self.assertInvalid(
            "tensor_api must be one of 'auto', 'torch', 'pycuda', got 'jax'", tensor_api="jax"
        )

    def test_readonly_paths_need_bubblewrap(self) -> None:
        """
        Extra read-only paths only make sense inside the bubblewrap sandbox.
        """
        self.assertInvalid(
            "sandbox_readonly_paths requires sandbox='bubblewrap'",
            sandbox="none",
            sandbox_readonly_paths=["/opt/x"],
        )

    def test_booleans(self) -> None:
        """
        The logging switches are booleans.
        """
        self.assertInvalid("log_console must be True or False, got 'no'", log_console="no")
        self.assertInvalid("log_programs must be True or False, got 1", log_programs=1)


class XdgRuleTests(SynchronousTestCase):
    """
    L{default_disk_cache_dir} applies the XDG cache rule.
    """

    def test_absolute(self) -> None:
        """
        An absolute C{XDG_CACHE_HOME} is used.
        """
        self.assertEqual(
            default_disk_cache_dir({"XDG_CACHE_HOME": "/xdg", "HOME": "/home/u"}),
            Path("/xdg/kcoral/files"),
        )

    def test_relative(self) -> None:
        """
        A relative C{XDG_CACHE_HOME} is ignored in favour of C{~/.cache}.
        """
        self.assertEqual(
            default_disk_cache_dir({"XDG_CACHE_HOME": "rel/cache", "HOME": "/home/u"}),
            Path("/home/u/.cache/kcoral/files"),
        )

    def test_empty(self) -> None:
        """
        An empty or missing C{XDG_CACHE_HOME} means C{~/.cache}.
        """
        for env in [{"XDG_CACHE_HOME": "", "HOME": "/home/u"}, {"HOME": "/home/u"}]:
            self.assertEqual(default_disk_cache_dir(env), Path("/home/u/.cache/kcoral/files"))

    def test_absolute_result(self) -> None:
        """
        The result is absolute and has C{~} expanded, even when C{HOME} is
        unset.
        """
        result = default_disk_cache_dir({})
        self.assertTrue(result.is_absolute())
        self.assertNotIn("~", str(result))

    def test_default_reads_os_environ(self) -> None:
        """
        Without an argument the process environment is read, at call time.
        """
        old = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = "/somewhere"
        try:
            self.assertEqual(default_disk_cache_dir(), Path("/somewhere/kcoral/files"))
            self.assertEqual(ServerConfig().disk_cache_dir, Path("/somewhere/kcoral/files"))
        finally:
            if old is None:
                del os.environ["XDG_CACHE_HOME"]
            else:
                os.environ["XDG_CACHE_HOME"] = old


class HelperTests(SynchronousTestCase):
    """
    L{ServerConfig}'s derived values.
    """

    def test_cpu_mode(self) -> None:
        """
        C{cpu_mode} is true only for the CPU device.
        """
        self.assertTrue(ServerConfig(device="cpu").cpu_mode)
        self.assertFalse(ServerConfig().cpu_mode)

    def test_distinct_gpus(self) -> None:
        """
        C{distinct_gpus} keeps the first occurrence of each id, in order, and
        is empty in CPU mode.
        """
        self.assertEqual(ServerConfig(gpus=[3, 1, 0]).distinct_gpus, (3, 1, 0))
        self.assertEqual(ServerConfig(device="cpu", gpus=[1]).distinct_gpus, ())

    def test_worker_ids_gpu(self) -> None:
        """
        GPU seats are C{gpu<id>/w<index>}, GPU by GPU in C{gpus} order.
        """
        config = ServerConfig(gpus=[1, 0], workers_per_gpu=2)
        self.assertEqual(config.worker_ids(), ["gpu1/w0", "gpu1/w1", "gpu0/w0", "gpu0/w1"])

    def test_worker_ids_cpu(self) -> None:
        """
        CPU seats are C{cpu/w<index>}; C{workers_per_gpu} does not apply.
        """
        config = ServerConfig(device="cpu", num_workers=3, workers_per_gpu=8)
        self.assertEqual(config.worker_ids(), ["cpu/w0", "cpu/w1", "cpu/w2"])

    def test_as_log_dict(self) -> None:
        """
        C{as_log_dict} has every field, with paths as strings and tuples as
        lists.
        """
        config = ServerConfig(
            log_dir=Path("logs"), disk_cache_dir="/c", sandbox_readonly_paths=["/opt/a"]
        )
        record = config.as_log_dict()
        self.assertEqual(set(record), {a.name for a in attrs.fields(ServerConfig)})
        self.assertEqual(record["log_dir"], "logs")
        self.assertEqual(record["disk_cache_dir"], "/c")
        self.assertEqual(record["sandbox_readonly_paths"], ["/opt/a"])
        self.assertEqual(record["gpus"], [0])
        self.assertIsNone(ServerConfig(disk_cache_dir=None).as_log_dict()["disk_cache_dir"])


class SparesTests(SynchronousTestCase):
    """C{spare_workers_per_gpu}: by default some per GPU, none in CPU mode."""

    def test_defaults_by_mode(self) -> None:
        self.assertEqual(ServerConfig(device="gpu").spares_per_group, DEFAULT_SPARE_WORKERS_PER_GPU)
        self.assertEqual(ServerConfig(device="cpu").spares_per_group, 0)
        reuse = ServerConfig(device="gpu", max_requests_per_worker=0)
        self.assertEqual(reuse.spares_per_group, 0)
        limited = ServerConfig(device="gpu", max_requests_per_worker=100)
        self.assertEqual(limited.spares_per_group, DEFAULT_SPARE_WORKERS_PER_GPU)

    def test_explicit(self) -> None:
        self.assertEqual(ServerConfig(device="cpu", spare_workers_per_gpu=2).spares_per_group, 2)
        self.assertEqual(ServerConfig(spare_workers_per_gpu=0).spares_per_group, 0)

    def test_invalid(self) -> None:
        self.assertRaises(ValueError, ServerConfig, spare_workers_per_gpu=-1)


class DefaultCacheCapacityTests(SynchronousTestCase):
    """The memory cache defaults to a share of the machine's RAM (issue 18), not 16 GiB."""

    def test_an_eighth_of_ram(self) -> None:
        import psutil

        self.assertEqual(default_cache_capacity(), psutil.virtual_memory().total // 8)
        self.assertEqual(ServerConfig().cache_capacity_bytes, default_cache_capacity())


class CudaConnectionsTests(SynchronousTestCase):
    """C{cuda_connections}: what CUDA accepts, 1 to 32."""

    def test_auto_follows_the_worker_lifetime(self) -> None:
        """
        Unset, fresh workers get 2 queues (their contexts are made and
        destroyed per request), reused ones CUDA's 8; a set number wins.
        """
        self.assertEqual(ServerConfig().work_queues, 2)
        self.assertEqual(ServerConfig(max_requests_per_worker=0).work_queues, 8)
        self.assertEqual(ServerConfig(max_requests_per_worker=5).work_queues, 8)
        self.assertEqual(ServerConfig(cuda_connections=4).work_queues, 4)
        self.assertEqual(ServerConfig(cuda_connections=1, max_requests_per_worker=0).work_queues, 1)

    def test_range(self) -> None:
        self.assertIsNone(ServerConfig(cuda_connections=None).cuda_connections)
        self.assertEqual(ServerConfig(cuda_connections=1).cuda_connections, 1)
        self.assertEqual(ServerConfig(cuda_connections=32).cuda_connections, 32)
        for bad in (0, 33, -1, True, "4", 2.0):
            with self.assertRaises(ValueError):
                ServerConfig(cuda_connections=bad)  # type: ignore[arg-type]


class FrontEndsTests(SynchronousTestCase):
    """Several front ends: every N-th seat and spare is each one's; the rules."""

    def test_seats_are_split(self) -> None:
        """Front end i has every N-th seat from index i."""
        gpu = ServerConfig(gpus=(0, 1), workers_per_gpu=5, front_ends=2)
        self.assertEqual(gpu.worker_ids(1), ["gpu0/w1", "gpu0/w3", "gpu1/w1", "gpu1/w3"])
        cpu = ServerConfig(device="cpu", num_workers=3, front_ends=2)
        self.assertEqual(cpu.worker_ids(), ["cpu/w0", "cpu/w2"])
        self.assertEqual(cpu.worker_ids(0), cpu.worker_ids())

    def test_spares_are_split(self) -> None:
        """Front end i keeps every N-th spare from index i."""
        config = ServerConfig(spare_workers_per_gpu=3, front_ends=2)
        self.assertEqual((config.spares_of(0), config.spares_of(1)), (2, 1))
        self.assertEqual(config.spares_per_group, config.spares_of(0))
        fresh = ServerConfig(front_ends=2)
        self.assertEqual(fresh.spares_of(1), 2)

    def test_no_wiring_fields(self) -> None:
        """Which front end a process is is wiring, not configuration."""
        names = {a.name for a in attrs.fields(ServerConfig)}
        self.assertFalse(names & {"front_end_index", "lease_broker"})

    def test_rules(self) -> None:
        """Every front end needs a seat."""
        with self.assertRaisesRegex(ValueError, "each front end needs a seat"):
            ServerConfig(device="cpu", num_workers=1, front_ends=2)
