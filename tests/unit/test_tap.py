"""
Tests for L{kcoral.server.cli.tap}, the C{kcoral} twistd plugin and
C{contrib/kcoral.tac}.
"""

from __future__ import annotations

import importlib
import re
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import attrs
from twisted.application.service import IService, IServiceCollection, IServiceMaker
from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactor
from twisted.plugin import getPlugins
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyObject

from kcoral.config import ServerConfig, default_cache_capacity, default_disk_cache_dir
from kcoral.server.cli import tap

ROOT = Path(__file__).resolve().parents[2]
TACS = (ROOT / "contrib" / "kcoral-gpu.tac", ROOT / "contrib" / "kcoral-cpu.tac")

#: A fixed environment with no KCORAL_* variables.
BARE_ENV = {"HOME": "/home/op"}


def parse(args: list[str], environ: dict[str, str] | None = None) -> tap.Options:
    """
    Parse C{args} with an environment that defaults to L{BARE_ENV}.
    """
    options = tap.Options(environ=BARE_ENV if environ is None else environ)
    options.parseOptions(args)
    return options


class DefaultsTests(SynchronousTestCase):
    """
    Parsing no flags gives the command line's defaults.
    """

    def test_config(self) -> None:
        """
        The config differs from C{ServerConfig()} only where the command line
        has its own default: C{log_dir="logs"}, and the disk cache directory
        computed from the given environment.
        """
        options = parse([])
        self.assertEqual(
            options.config,
            ServerConfig(log_dir=Path("logs"), disk_cache_dir=Path("/home/op/.cache/kcoral/files")),
        )

    def test_endpoint(self) -> None:
        """
        The HTTP port defaults to 127.0.0.1:8000.
        """
        self.assertEqual(parse([]).endpoint, "tcp:port=8000:interface=127.0.0.1:backlog=1024")


class FlagTests(SynchronousTestCase):
    """
    Every flag reaches its L{ServerConfig} field, with its type.
    """

    def test_every_flag(self) -> None:
        """
        Each value flag sets its field, coerced to the field's type.
        """
        options = parse(
            [
                "--host=0.0.0.0",
                "--port=8001",
                "--device=gpu",
                "--gpus=1, 2,,3",
                "--num-workers=4",
                "--workers-per-gpu=2",
                "--max-requests-per-worker=0",
                "--worker-termination-grace-seconds=1.5",
                "--worker-wait-timeout-seconds=30",
                "--default-timeout-seconds=60",
                "--max-timeout-seconds=120",
                "--max-request-bytes=1000",
                "--max-response-bytes=2000",
                "--output-limit-bytes=300",
                "--max-output-limit-bytes=400",
                "--cache-capacity-bytes=5000",
                "--disk-cache-dir=/srv/cache",
                "--disk-cache-capacity-mbytes=7",
                "--log-dir=/var/log/kcoral",
                "--no-log-console",
                "--no-log-programs",
                "--sandbox=bubblewrap",
                "--sandbox-readonly-path=/opt/a",
                "--sandbox-readonly-path",
                "/opt/b",
                "--tensor-api=pycuda",
            ]
        )
        self.assertEqual(
            options.config,
            ServerConfig(
                gpus=(1, 2, 3),
                log_dir=Path("/var/log/kcoral"),
                log_console=False,
                log_programs=False,
                cache_capacity_bytes=5000,
                disk_cache_dir=Path("/srv/cache"),
                disk_cache_capacity_mbytes=7,
                default_timeout_seconds=60.0,
                max_timeout_seconds=120.0,
                worker_wait_timeout_seconds=30.0,
                workers_per_gpu=2,
                max_requests_per_worker=0,
                sandbox="bubblewrap",
                sandbox_readonly_paths=(Path("/opt/a"), Path("/opt/b")),
                worker_termination_grace_seconds=1.5,
                max_request_bytes=1000,
                max_response_bytes=2000,
                output_limit_bytes=300,
                max_output_limit_bytes=400,
                device="gpu",
                num_workers=4,
                tensor_api="pycuda",
            ),
        )
        self.assertEqual(options.endpoint, "tcp:port=8001:interface=0.0.0.0:backlog=1024")
        self.assertEqual(options["port"], 8001)

    def test_cpu_mode(self) -> None:
        """
        C{--device cpu} with C{--num-workers} and C{--sandbox none}.
        """
        config = parse(["--device", "cpu", "--num-workers", "16", "--sandbox", "none"]).config
        self.assertEqual((config.device, config.num_workers, config.sandbox), ("cpu", 16, "none"))

    def test_cpu_mode_ignores_empty_gpus(self) -> None:
        """
        With C{--device cpu} an empty C{--gpus} is accepted.
        """
        self.assertEqual(parse(["--device", "cpu", "--gpus", ","]).config.gpus, ())

    def test_empty_log_dir(self) -> None:
        """
        C{--log-dir ''} disables file logging.
        """
        self.assertIsNone(parse(["--log-dir", ""]).config.log_dir)

    def test_empty_disk_cache_dir(self) -> None:
        """
        C{--disk-cache-dir ''} disables the disk cache.
        """
        self.assertIsNone(parse(["--disk-cache-dir="]).config.disk_cache_dir)

    def test_disk_cache_dir_xdg(self) -> None:
        """
        The disk cache default follows C{XDG_CACHE_HOME} of the given
        environment.
        """
        config = parse([], {"XDG_CACHE_HOME": "/xdg", "HOME": "/h"}).config
        self.assertEqual(config.disk_cache_dir, Path("/xdg/kcoral/files"))

    def test_ipv6_endpoint(self) -> None:
        """
        An IPv6 host has its colons escaped in the endpoint description,
        which strports parses back to the same interface.
        """
        options = parse(["--host", "::1", "--port", "9000"])
        self.assertEqual(options.endpoint, r"tcp:port=9000:interface=\:\:1:backlog=1024")
        reactor = MemoryReactor()
        serverFromString(reactor, options.endpoint).listen(Factory())
        port, _, _, interface = reactor.tcpServers[0]
        self.assertEqual((port, interface), (9000, "::1"))

    def test_no_abbreviations(self) -> None:
        """
        Long options must be spelled out, as in the reference command line.
        """
        with self.assertRaises(usage.UsageError) as cm:
            parse(["--workers", "2"])
        self.assertEqual(str(cm.exception), "option --workers not recognized")

    def test_abbreviation_check_skips_values(self) -> None:
        """
        A value that looks like an option is not mistaken for one.
        """
        self.assertEqual(parse(["--log-dir", "--odd"]).config.log_dir, Path("--odd"))


class EnvironmentTests(SynchronousTestCase):
    """
    Flag > environment variable > built-in default, for each variable.
    """

    def check(self, var: str, env_value: str, flag: list[str], attribute: Any) -> None:
        """
        The default, the environment value and the flag each win in turn.
        """
        default = attribute(parse([]))
        from_env = attribute(parse([], {**BARE_ENV, var: env_value}))
        from_flag = attribute(parse(flag, {**BARE_ENV, var: env_value}))
        self.assertNotEqual(default, from_env)
        self.assertNotEqual(from_env, from_flag)
        self.assertNotEqual(default, from_flag)
        return None

    def test_host(self) -> None:
        """
        C{KCORAL_SERVER_HOST} sets the interface unless C{--host} is given.
        """
        self.check("KCORAL_SERVER_HOST", "0.0.0.0", ["--host", "10.0.0.1"], lambda o: o.endpoint)
        self.assertEqual(
            parse([], {"KCORAL_SERVER_HOST": "0.0.0.0"}).endpoint,
            "tcp:port=8000:interface=0.0.0.0:backlog=1024",
        )

    def test_port(self) -> None:
        """
        C{KCORAL_SERVER_PORT} sets the port unless C{--port} is given.
        """
        self.check("KCORAL_SERVER_PORT", "9000", ["--port", "9001"], lambda o: o["port"])
        self.assertEqual(parse([], {"KCORAL_SERVER_PORT": "9000"})["port"], 9000)

    def test_device(self) -> None:
        """
        C{KCORAL_SERVER_DEVICE} sets the device unless C{--device} is given.
        """
        self.assertEqual(parse([]).config.device, "gpu")
        self.assertEqual(parse([], {"KCORAL_SERVER_DEVICE": "cpu"}).config.device, "cpu")
        self.assertEqual(
            parse(["--device", "gpu"], {"KCORAL_SERVER_DEVICE": "cpu"}).config.device, "gpu"
        )

    def test_gpus(self) -> None:
        """
        C{KCORAL_SERVER_GPUS} sets the GPUs unless C{--gpus} is given.
        """
        self.check("KCORAL_SERVER_GPUS", "1,2", ["--gpus", "3"], lambda o: o.config.gpus)
        self.assertEqual(parse([], {"KCORAL_SERVER_GPUS": "1,2"}).config.gpus, (1, 2))

    def test_log_dir(self) -> None:
        """
        C{KCORAL_LOG_DIR} sets the log directory unless C{--log-dir} is given.
        """
        self.check(
            "KCORAL_LOG_DIR", "/var/log/k", ["--log-dir", "here"], lambda o: o.config.log_dir
        )

    def test_empty_log_dir_env(self) -> None:
        """
        C{KCORAL_LOG_DIR=""} disables file logging; a flag still wins.
        """
        self.assertIsNone(parse([], {"KCORAL_LOG_DIR": ""}).config.log_dir)
        self.assertEqual(
            parse(["--log-dir", "x"], {"KCORAL_LOG_DIR": ""}).config.log_dir, Path("x")
        )

    def test_empty_means_unset(self) -> None:
        """
        Other empty variables are treated as unset.
        """
        options = parse(
            [],
            {
                "KCORAL_SERVER_HOST": "",
                "KCORAL_SERVER_PORT": "",
                "KCORAL_SERVER_DEVICE": "",
                "KCORAL_SERVER_GPUS": "",
            },
        )
        self.assertEqual(options.endpoint, "tcp:port=8000:interface=127.0.0.1:backlog=1024")
        self.assertEqual((options.config.device, options.config.gpus), ("gpu", (0,)))

    def test_env_read_at_construction(self) -> None:
        """
        The environment is read when the options are built, not when parsed.
        """
        env = {"KCORAL_SERVER_PORT": "9000"}
        options = tap.Options(environ=env)
        env["KCORAL_SERVER_PORT"] = "9999"
        options.parseOptions([])
        self.assertEqual(options["port"], 9000)

    def test_bad_port_env(self) -> None:
        """
        A non-numeric C{KCORAL_SERVER_PORT} is a usage error naming it; a
        flag overrides it.
        """
        with self.assertRaises(usage.UsageError) as cm:
            parse([], {"KCORAL_SERVER_PORT": "http"})
        self.assertEqual(str(cm.exception), "KCORAL_SERVER_PORT must be an integer, got 'http'")
        self.assertEqual(parse(["--port", "1"], {"KCORAL_SERVER_PORT": "http"})["port"], 1)

    def test_spare_workers(self) -> None:
        """
        C{--spare-workers-per-gpu} and C{KCORAL_SPARE_WORKERS_PER_GPU} set
        the spares; unset, the config's mode default applies; a flag wins.
        """
        self.assertIsNone(parse([], {}).config.spare_workers_per_gpu)
        env = {"KCORAL_SPARE_WORKERS_PER_GPU": "2"}
        self.assertEqual(parse([], env).config.spare_workers_per_gpu, 2)
        flag = ["--spare-workers-per-gpu", "0"]
        self.assertEqual(parse(flag, env).config.spare_workers_per_gpu, 0)
        with self.assertRaises(usage.UsageError) as cm:
            parse([], {"KCORAL_SPARE_WORKERS_PER_GPU": "many"})
        self.assertIn("KCORAL_SPARE_WORKERS_PER_GPU must be an integer", str(cm.exception))

    def test_cuda_connections(self) -> None:
        """
        C{--cuda-connections} (default auto) and C{KCORAL_CUDA_CONNECTIONS}
        set each GPU context's work queues; a flag wins; C{auto} in either
        is the default; out of 1-32 is a usage error naming the flag.
        """
        self.assertIsNone(parse([], {}).config.cuda_connections)
        env = {"KCORAL_CUDA_CONNECTIONS": "8"}
        self.assertEqual(parse([], env).config.cuda_connections, 8)
        self.assertEqual(parse(["--cuda-connections", "1"], env).config.cuda_connections, 1)
        self.assertIsNone(parse(["--cuda-connections", "auto"], env).config.cuda_connections)
        self.assertIsNone(parse([], {"KCORAL_CUDA_CONNECTIONS": "AUTO"}).config.cuda_connections)
        with self.assertRaises(usage.UsageError) as cm:
            parse([], {"KCORAL_CUDA_CONNECTIONS": "all"})
        self.assertIn("KCORAL_CUDA_CONNECTIONS must be an integer", str(cm.exception))
        with self.assertRaises(usage.UsageError) as cm:
            parse(["--cuda-connections", "many"], {})
        self.assertIn("--cuda-connections must be an integer or 'auto'", str(cm.exception))
        with self.assertRaises(usage.UsageError) as cm:
            parse(["--cuda-connections", "0"], {})
        self.assertIn("--cuda-connections", str(cm.exception))

    def test_bad_device_env(self) -> None:
        """
        An unknown C{KCORAL_SERVER_DEVICE} is rejected like the flag.
        """
        with self.assertRaises(usage.UsageError) as cm:
            parse([], {"KCORAL_SERVER_DEVICE": "foo"})
        self.assertEqual(str(cm.exception), "--device must be 'cpu' or 'gpu', got 'foo'")

    def test_help_shows_env_default(self) -> None:
        """
        C{--help} shows the default the environment supplies.
        """
        text = tap.Options(environ={"KCORAL_SERVER_PORT": "9000"}).getUsage(width=1000)
        self.assertIn("[default: 9000]", _help_line(text, "port"))


class ValidationTests(SynchronousTestCase):
    """
    Bad values are L{usage.UsageError}s with the reference messages.
    """

    def assertUsageError(self, args: list[str], message: str) -> None:
        """
        Parsing C{args} fails with exactly C{message}.
        """
        with self.assertRaises(usage.UsageError) as cm:
            parse(args)
        self.assertEqual(str(cm.exception), message)

    def test_reference_messages(self) -> None:
        """
        Each check of the reference command line has its message.
        """
        cases = [
            (["--gpus", ","], "--gpus needs at least one GPU id"),
            (["--gpus", " "], "--gpus needs at least one GPU id"),
            (["--num-workers", "0"], "--num-workers must be at least 1"),
            (["--workers-per-gpu", "0"], "--workers-per-gpu must be at least 1"),
            (["--port", "0"], "--port must be between 1 and 65535"),
            (["--port", "65536"], "--port must be between 1 and 65535"),
            (["--max-requests-per-worker", "-1"], "--max-requests-per-worker must be non-negative"),
            (
                ["--disk-cache-capacity-mbytes", "-1"],
                "--disk-cache-capacity-mbytes must be non-negative",
            ),
            (
                ["--sandbox", "none", "--sandbox-readonly-path", "/opt/x"],
                "--sandbox-readonly-path requires --sandbox bubblewrap",
            ),
        ]
        for args, message in cases:
            self.assertUsageError(args, message)

    def test_checks_apply_in_every_mode(self) -> None:
        """
        C{--workers-per-gpu 0} fails even with C{--device cpu}.
        """
        self.assertUsageError(
            ["--device", "cpu", "--workers-per-gpu", "0"], "--workers-per-gpu must be at least 1"
        )

    def test_type_errors(self) -> None:
        """
        Integer and number flags reject other text, naming the flag.
        """
        self.assertUsageError(["--port", "http"], "--port must be an integer, got 'http'")
        self.assertUsageError(
            ["--max-timeout-seconds", "soon"], "--max-timeout-seconds must be a number, got 'soon'"
        )
        self.assertUsageError(
            ["--max-timeout-seconds", "inf"],
            "--max-timeout-seconds must be a finite number, got 'inf'",
        )
        self.assertUsageError(
            ["--gpus", "0,x"], "--gpus must be a comma-separated list of integers, got '0,x'"
        )

    def test_choices(self) -> None:
        """
        C{--device}, C{--sandbox} and C{--tensor-api} accept only their
        choices.
        """
        self.assertUsageError(["--device", "tpu"], "--device must be 'cpu' or 'gpu', got 'tpu'")
        self.assertUsageError(
            ["--sandbox", "docker"],
            "--sandbox must be 'none', 'bubblewrap' or 'auto', got 'docker'",
        )
        self.assertUsageError(
            ["--tensor-api", "jax"], "--tensor-api must be one of auto, torch, pycuda, got 'jax'"
        )

    def test_config_errors_name_flags(self) -> None:
        """
        A L{ServerConfig} L{ValueError} becomes a usage error naming flags.
        """
        self.assertUsageError(
            ["--cache-capacity-bytes", "-1"], "--cache-capacity-bytes must be non-negative, got -1"
        )
        self.assertUsageError(
            ["--default-timeout-seconds", "1000"],
            "--default-timeout-seconds must not exceed --max-timeout-seconds, got 1000.0 > 900.0",
        )
        self.assertUsageError(
            ["--max-timeout-seconds", "0", "--default-timeout-seconds", "0"],
            "--default-timeout-seconds must be positive, got 0.0",
        )
        self.assertUsageError(["--gpus", "0,-1"], "--gpus must not contain negative ids, got -1")
        self.assertUsageError(
            ["--gpus", "0,0"], "--gpus must not repeat a GPU id, got 0 more than once"
        )

    def test_empty_values(self) -> None:
        """
        An empty host or read-only path is refused.
        """
        self.assertUsageError(["--host", ""], "--host must not be empty")
        self.assertUsageError(
            ["--sandbox-readonly-path", ""], "--sandbox-readonly-path needs a non-empty path"
        )


def _help_line(text: str, name: str) -> str:
    """
    The line of unwrapped C{--help} text describing C{--name}.
    """
    for line in text.splitlines():
        if re.match(rf"\s+--{re.escape(name)}=?\s", line):
            return line
    raise AssertionError(f"--{name} not in help:\n{text}")


class HelpTests(SynchronousTestCase):
    """
    C{--help} documents every option with its default.
    """

    def test_every_option_with_default(self) -> None:
        """
        Each option's help line shows its built-in default.
        """
        text = tap.Options(environ=BARE_ENV).getUsage(width=1000)
        cache = default_disk_cache_dir(BARE_ENV)
        expected = {
            "host": "127.0.0.1",
            "port": "8000",
            "device": "gpu",
            "gpus": "0",
            "num-workers": "1",
            "workers-per-gpu": "8",
            "max-requests-per-worker": "1",
            "worker-termination-grace-seconds": "5.0",
            "worker-wait-timeout-seconds": "1800.0",
            "default-timeout-seconds": "300.0",
            "max-timeout-seconds": "900.0",
            "max-request-bytes": "268435456",
            "max-response-bytes": "268435456",
            "output-limit-bytes": "1048576",
            "max-output-limit-bytes": "16777216",
            "cache-capacity-bytes": str(default_cache_capacity()),
            "disk-cache-dir": str(cache),
            "disk-cache-capacity-mbytes": "16384",
            "log-dir": "logs",
            "no-log-console": "mirroring on",
            "no-log-programs": "programs saved",
            "sandbox": "bubblewrap",
            "sandbox-readonly-path": "none",
            "tensor-api": "auto",
        }
        for name, default in expected.items():
            self.assertIn(f"[default: {default}]", _help_line(text, name), name)

    def test_env_vars_named(self) -> None:
        """
        The help names each environment variable.
        """
        text = " ".join(str(tap.Options(environ=BARE_ENV)).split())
        for var in tap.ENV_VARS.values():
            self.assertIn(var, text)


class MakeServiceTests(SynchronousTestCase):
    """
    L{tap.makeService} hands the config and endpoint to
    L{kcoral.server.service.makeService}.
    """

    def test_delegates(self) -> None:
        """
        The root service is whatever C{kcoral.server.service.makeService}
        returns for the parsed config and endpoint.
        """
        calls: list[tuple[Any, ...]] = []
        sentinel = object()

        def fake_make_service(config: ServerConfig, endpoint: str, *, reactor: Any = None) -> Any:
            calls.append((config, endpoint, reactor))
            return sentinel

        fake = types.ModuleType("kcoral.server.service")
        fake.makeService = fake_make_service  # type: ignore[attr-defined]
        saved = sys.modules.get("kcoral.server.service")
        sys.modules["kcoral.server.service"] = fake

        def restore() -> None:
            if saved is None:
                sys.modules.pop("kcoral.server.service", None)
            else:
                sys.modules["kcoral.server.service"] = saved

        self.addCleanup(restore)

        options = parse(["--port", "8123", "--device", "cpu"])
        self.assertIs(tap.makeService(options), sentinel)
        self.assertIs(tap.makeService(options, console_mirror=True), sentinel)
        endpoint = ("tcp:port=8123:interface=127.0.0.1:backlog=1024",)
        # Under plain twistd, twistd's own observer prints every event: no
        # mirror, so nothing prints twice.  `kcoral server` asks for it.
        self.assertEqual(
            calls,
            [
                (attrs.evolve(options.config, log_console=False), endpoint, None),
                (options.config, endpoint, None),
            ],
        )
        self.assertTrue(options.config.log_console)


class BoundaryFlagTests(SynchronousTestCase):
    """
    The network boundary's flags (issue 18): endpoints, backlog, tokens,
    deadlines and the connection cap.
    """

    def test_listen_repeatable(self) -> None:
        """C{--listen} replaces --host/--port; TCP and SSL ports get the backlog."""
        options = parse(
            [
                "--listen",
                "tcp:8000:interface=127.0.0.2",
                "--listen=unix:/run/kcoral.sock",
                "--listen",
                "ssl:8443:privateKey=k.pem:certKey=c.pem:backlog=7",
                "--listen-backlog",
                "2048",
            ]
        )
        self.assertEqual(
            options.endpoints,
            (
                "tcp:8000:interface=127.0.0.2:backlog=2048",
                "unix:/run/kcoral.sock:mode=600",
                "ssl:8443:privateKey=k.pem:certKey=c.pem:backlog=7",
            ),
        )
        self.assertEqual(options.endpoint, options.endpoints[0])

    def test_unix_owner_only(self) -> None:
        """
        A UNIX socket without C{mode=} is its owner's only (0600, not
        Twisted's 0666); a mode given is kept (issue 32).
        """
        options = parse(["--listen", "unix:/run/a.sock", "--listen", "unix:/run/b.sock:mode=660"])
        self.assertEqual(
            options.endpoints, ("unix:/run/a.sock:mode=600", "unix:/run/b.sock:mode=660")
        )
        reactor = MemoryReactor()
        serverFromString(reactor, options.endpoints[0]).listen(Factory())
        self.assertEqual(reactor.unixServers[0][3], 0o600)

    def test_listen_empty_rejected(self) -> None:
        """An empty endpoint description is a usage error."""
        self.assertRaises(usage.UsageError, parse, ["--listen", ""])

    def test_backlog_at_least_one(self) -> None:
        """A zero backlog is a usage error."""
        self.assertRaises(usage.UsageError, parse, ["--listen-backlog", "0"])

    def test_limits(self) -> None:
        """Deadlines, the connection cap and --public-metrics reach the config."""
        config = parse(
            [
                "--header-timeout-seconds=5",
                "--body-timeout-seconds=60",
                "--max-connections=10",
                "--public-metrics",
            ]
        ).config
        self.assertEqual(
            (
                config.header_timeout_seconds,
                config.body_timeout_seconds,
                config.max_connections,
                config.public_metrics,
            ),
            (5.0, 60.0, 10, True),
        )

    def test_token_file_checked(self) -> None:
        """A token file is read while parsing, so a bad one is a usage error."""
        directory = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, directory)
        good = directory / "good"
        good.write_text("alice 0123456789abcdef0123\n")
        config = parse(["--auth-token-file", str(good)]).config
        self.assertEqual(config.auth_token_file, good)
        bad = directory / "bad"
        bad.write_text("alice short\n")
        error = self.assertRaises(usage.UsageError, parse, ["--auth-token-file", str(bad)])
        self.assertIn("shorter than 16", str(error))
        missing = str(directory / "missing")
        self.assertRaises(usage.UsageError, parse, ["--auth-token-file", missing])


class PluginTests(SynchronousTestCase):
    """
    The C{kcoral} twistd plugin.
    """

    def find(self) -> Any:
        """
        The C{kcoral} L{IServiceMaker} plugin.
        """
        found = [p for p in getPlugins(IServiceMaker) if p.tapname == "kcoral"]
        self.assertEqual(len(found), 1)
        return found[0]

    def test_found(self) -> None:
        """
        C{getPlugins(IServiceMaker)} finds one C{kcoral} plugin, which
        provides L{IServiceMaker}.
        """
        plugin = self.find()
        self.assertTrue(verifyObject(IServiceMaker, plugin))
        self.assertTrue(plugin.description)

    def test_options(self) -> None:
        """
        The plugin's options are L{tap.Options} and its module, imported
        only when used, is L{kcoral.server.cli.tap}.
        """
        plugin = self.find()
        self.assertIs(plugin.options, tap.Options)
        self.assertEqual(plugin.module, "kcoral.server.cli.tap")

    def test_lazy(self) -> None:
        """
        Importing the plugin module imports neither the tap module nor the
        reactor.
        """
        import twisted.plugins.kcoral_plugin as module

        saved = {
            name: sys.modules.pop(name)
            for name in ["kcoral.server.cli.tap", "twisted.internet.reactor"]
            if name in sys.modules
        }
        self.addCleanup(sys.modules.update, saved)
        importlib.reload(module)
        self.assertNotIn("kcoral.server.cli.tap", sys.modules)
        self.assertNotIn("twisted.internet.reactor", sys.modules)

    def test_twistd_rejects_bad_input(self) -> None:
        """
        twistd's own parser runs the plugin's checks.
        """
        from twisted.scripts.twistd import ServerOptions

        with self.assertRaises(usage.UsageError) as cm:
            ServerOptions().parseOptions(["kcoral", "--port", "0"])
        self.assertEqual(str(cm.exception), "--port must be between 1 and 65535")

    def test_twistd_parses(self) -> None:
        """
        C{twistd kcoral [options]} leaves the config on the subcommand's
        options.
        """
        from twisted.scripts.twistd import ServerOptions

        config = ServerOptions()
        config.parseOptions(["--nodaemon", "kcoral", "--device", "cpu", "--num-workers", "3"])
        self.assertEqual(config.subCommand, "kcoral")
        self.assertEqual(config.subOptions.config.num_workers, 3)


class TacTests(SynchronousTestCase):
    """
    C{contrib/kcoral-gpu.tac} and C{contrib/kcoral-cpu.tac} build applications.
    """

    def setUp(self) -> None:
        """
        Skip when C{kcoral.server.service} does not exist yet.
        """
        try:
            importlib.import_module("kcoral.server.service")
        except ImportError as e:
            self.skipTest(f"kcoral.server.service cannot be imported yet: {e}")

    def test_load(self) -> None:
        """
        twistd's loader finds an application holding the root service, of
        the device kind the file is named after.
        """
        from twisted.application.service import loadApplication

        for tac, device in zip(TACS, ("gpu", "cpu"), strict=True):
            application = loadApplication(str(tac), "python")
            services = list(IServiceCollection(application))
            self.assertEqual(len(services), 1)
            self.assertTrue(IService.providedBy(services[0]))
            self.assertFalse(services[0].running)
            self.assertEqual(services[0].config.device, device)
