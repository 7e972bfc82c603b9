# -*- test-case-name: tests.unit.test_examples -*-
"""
examples/remote_compile.py talks to the hosts it is given, not only to
127.0.0.1.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from twisted.trial.unittest import SynchronousTestCase

ROOT = Path(__file__).resolve().parents[2]


def _example() -> ModuleType:
    path = ROOT / "examples" / "remote_compile.py"
    spec = importlib.util.spec_from_file_location("kcoral_example_remote_compile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RemoteCompileAddressTests(SynchronousTestCase):
    def test_host_and_port(self) -> None:
        """The URL's host and port are both used."""
        address = _example()._address
        self.assertEqual(address("http://gpu-7.example:8001"), ("gpu-7.example", 8001))
        self.assertEqual(address("http://10.0.0.5"), ("10.0.0.5", 80))
        self.assertEqual(address("http://[::1]:8000/"), ("::1", 8000))
