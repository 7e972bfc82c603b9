# -*- test-case-name: tests.unit.test_packaging -*-
"""
setup.cfg declares what the code needs, no more, and ships every package;
the deployment files in contrib/ agree with the command line they drive.

Imports are read from the source (nothing is imported), so the check runs
without the GPU extra.
"""

from __future__ import annotations

import ast
import configparser
import re
import shlex
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.cli import tap

ROOT = Path(__file__).resolve().parents[2]

#: Import name -> distribution, where they differ.
DISTRIBUTION_OF = {
    "zope": "zope.interface",
    "pycuda": "pycuda",
    "cupti": "cupti-python",
    "tvm_ffi": "apache-tvm-ffi",
    "prometheus_client": "prometheus-client",
    "nats": "nats-py",
    "pynvml": "nvidia-ml-py",
}

#: Imported only when present, never required: the worker hands tensors to
#: torch or cupy when the user's environment has them (docs/gpu.md).
OPTIONAL_IMPORTS = frozenset({"torch", "cupy"})

#: Declared but never imported, on purpose.
NOT_IMPORTED = {
    # Ships the nvcc binary the compile backend runs (kcoral.compilers.nvcc).
    "nvidia-cuda-nvcc": "a binary, found on disk",
}

#: Extras that hold what the code imports; test/nvcc hold tools and binaries.
RUNTIME_EXTRAS = ("server", "gpu", "client")


def _setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def _requirements(text: str) -> set[str]:
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    return {canonicalize_name(Requirement(line).name) for line in lines if line}


def declared_requirements() -> set[str]:
    """Distributions in install_requires and the runtime extras."""
    cfg = _setup_cfg()
    names = _requirements(cfg["options"]["install_requires"])
    extras = cfg["options.extras_require"]
    for extra in RUNTIME_EXTRAS:
        names |= _requirements(extras.get(extra, ""))
    return names


def imported_distributions(package: Path = ROOT / "kcoral") -> dict[str, set[str]]:
    """Third-party distribution -> files of C{package} that import it."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "kcoral" or top in OPTIONAL_IMPORTS:
                    continue
                name = canonicalize_name(DISTRIBUTION_OF.get(top, top))
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


class DependencyTests(SynchronousTestCase):
    def test_every_import_is_declared(self) -> None:
        """A third-party module imported under kcoral/ is a declared requirement."""
        undeclared = {
            name: sorted(files)
            for name, files in imported_distributions().items()
            if name not in declared_requirements()
        }
        self.assertEqual(undeclared, {})

    def test_every_requirement_is_imported(self) -> None:
        """A declared runtime requirement is imported somewhere under kcoral/."""
        exempt = {canonicalize_name(n) for n in NOT_IMPORTED}
        unused = declared_requirements() - set(imported_distributions()) - exempt
        self.assertEqual(sorted(unused), [])

    def test_server_extra_gives_every_endpoint(self) -> None:
        """
        C{pip install 'kcoral-server[server]'} covers everything the server
        and its CPU workers import; only GPU workers need the C{gpu} extra.
        """
        cfg = _setup_cfg()
        server = _requirements(cfg["options"]["install_requires"]) | _requirements(
            cfg["options.extras_require"]["server"]
        )
        gpu = _requirements(cfg["options.extras_require"]["gpu"])
        missing = {
            name: sorted(files)
            for name, files in imported_distributions().items()
            if name not in server and name not in gpu
        }
        self.assertEqual(missing, {})
        gpu_users = {f for name in gpu for f in imported_distributions().get(name, ())}
        self.assertTrue(
            all(f.startswith(("kcoral/worker/", "kcoral/compilers/")) for f in gpu_users),
            gpu_users,
        )

    def test_nvcc_wheel_is_an_extra_with_a_pinned_range(self) -> None:
        """
        The nvcc wheel (~400 MB) is only in the C{nvcc} extra, with both an
        upper and a lower bound.
        """
        extras = _setup_cfg()["options.extras_require"]
        for name, text in extras.items():
            if name != "nvcc":
                self.assertNotIn("nvidia-cuda-nvcc", text, name)
        (line,) = [x.strip() for x in extras["nvcc"].splitlines() if x.strip()]
        requirement = Requirement(line)
        self.assertEqual(requirement.name, "nvidia-cuda-nvcc")
        operators = {spec.operator for spec in requirement.specifier}
        self.assertIn("<", operators)
        self.assertIn(">=", operators)

    def test_every_package_is_listed(self) -> None:
        """
        Each directory under kcoral/ with an C{__init__.py} is in setup.cfg's
        C{packages}, so the wheel cannot silently lose one.
        """
        listed = set(_setup_cfg()["options"]["packages"].split())
        on_disk = {
            ".".join(init.parent.relative_to(ROOT).parts)
            for init in (ROOT / "kcoral").rglob("__init__.py")
        }
        self.assertEqual(sorted(on_disk - listed), [])
        self.assertIn("twisted.plugins", listed)
        self.assertIn("kcoral.contrib", listed)


def _unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]} (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key, value))
    return sections


def _seconds(value: str) -> float:
    units = {"s": 1, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+)\s*(min|h|s)?", value):
        total += int(number) * units[unit or "s"]
    return total


class SystemdUnitTests(SynchronousTestCase):
    UNITS = {
        "gpu": ROOT / "contrib" / "systemd" / "kcoral-gpu.service",
        "cpu": ROOT / "contrib" / "systemd" / "kcoral-cpu.service",
    }

    def test_exec_start_is_a_valid_command_line(self) -> None:
        """
        ExecStart= runs C{kcoral server} with flags the server accepts, for
        the node kind the unit is named after.
        """
        for device, path in self.UNITS.items():
            service = dict(_unit(path)["Service"])
            argv = shlex.split(service["ExecStart"])
            self.assertEqual(Path(argv[0]).name, "kcoral")
            self.assertEqual(argv[1], "server")
            env = {
                k: v
                for k, _, v in (
                    value.partition("=")
                    for key, value in _unit(path)["Service"]
                    if key == "Environment"
                )
            }
            options = tap.Options(environ=env)
            options.parseOptions(argv[2:])
            self.assertEqual(options.config.device, device)
            self.assertTrue(set(env) >= {"KCORAL_SERVER_PORT", "KCORAL_LOG_DIR"})
            self.assertTrue(set(env) - {"XDG_CACHE_HOME"} <= set(tap.ENV_VARS.values()))

    def test_restart_and_limits(self) -> None:
        """
        A failure restarts the node; a stop does not.  File limits are
        raised, and a stop waits longer than the longest execution budget.
        """
        budget = tap.Options(environ={})
        budget.parseOptions([])
        for path in self.UNITS.values():
            sections = _unit(path)
            service = dict(sections["Service"])
            self.assertEqual(service["Restart"], "on-failure")
            # Readiness over $NOTIFY_SOCKET (kcoral.server.observe.sdnotify), from the server only.
            self.assertEqual(service["Type"], "notify")
            self.assertEqual(service["NotifyAccess"], "main")
            self.assertGreaterEqual(int(service["LimitNOFILE"]), 65536)
            self.assertEqual(service["KillMode"], "mixed")
            self.assertGreater(
                _seconds(service["TimeoutStopSec"]), budget.config.max_timeout_seconds
            )
            self.assertIn("StartLimitBurst", dict(sections["Unit"]))
            self.assertEqual(dict(sections["Install"])["WantedBy"], "multi-user.target")


class HAProxyConfigTests(SynchronousTestCase):
    CONFIG = ROOT / "contrib" / "haproxy" / "kcoral.cfg"

    def test_every_server_has_an_affinity_rule(self) -> None:
        """
        Each backend pins a request naming one of its servers in
        X-KCoral-Node to that server, for every server it has.
        """
        text = self.CONFIG.read_text()
        backends = re.split(r"^backend ", text, flags=re.M)[1:]
        self.assertEqual(sorted(b.split()[0] for b in backends), ["kcoral_cpu", "kcoral_gpu"])
        for backend in backends:
            servers = re.findall(r"^\s+server (\S+) ", backend, re.M)
            pinned = re.findall(
                r"^\s+use-server (\S+) if \{ req.hdr\(X-KCoral-Node\) -m str (\S+) \}",
                backend,
                re.M,
            )
            self.assertTrue(servers)
            self.assertEqual(sorted(servers), sorted(a for a, b in pinned))
            self.assertTrue(all(a == b for a, b in pinned))
            self.assertIn("balance leastconn", backend)
            self.assertIn("stick on req.hdr(X-KCoral-Affinity)", backend)
            self.assertIn("http-check send meth GET uri /health", backend)
            self.assertIn("http-response set-header X-KCoral-Node %[srv_name]", backend)

    def test_lame_duck_outlasts_the_checks(self) -> None:
        """
        The shipped units and .tac files give a stopping node a lame duck
        longer than HAProxy takes to mark it down (C{inter} x C{fall}), and
        HAProxy retries a 503 (a request kcoral did not run) elsewhere.
        """
        text = self.CONFIG.read_text()
        default = re.search(r"^\s+default-server (.*)$", text, re.M)
        assert default is not None
        words = default.group(1).split()
        inter = _seconds(words[words.index("inter") + 1])
        fall = int(words[words.index("fall") + 1])
        retry_on = re.search(r"^\s+retry-on (.*)$", text, re.M)
        assert retry_on is not None
        self.assertIn("503", retry_on.group(1).split())
        for path in SystemdUnitTests.UNITS.values():
            argv = shlex.split(dict(_unit(path)["Service"])["ExecStart"])
            options = tap.Options(environ={})
            options.parseOptions(argv[2:])
            self.assertGreater(options.config.lame_duck_seconds, inter * fall)
        for kind in ("cpu", "gpu"):
            tac = (ROOT / "contrib" / f"kcoral-{kind}.tac").read_text()
            seconds = re.search(r"lame_duck_seconds=([\d.]+)", tac)
            assert seconds is not None
            self.assertGreater(float(seconds.group(1)), inter * fall)
