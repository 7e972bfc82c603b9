"""
Every L{ISandbox} the server can be given, real or fake, provides the whole
interface: the pool calls its members directly (issue 35), so a provider
missing one would fail there, not here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable

from twisted.trial.unittest import SynchronousTestCase
from zope.interface.verify import verifyClass, verifyObject

import kcoral.server.sandbox
from kcoral.server.sandbox.bubblewrap import BubblewrapSandbox
from kcoral.server.sandbox.interface import ISandbox
from kcoral.server.sandbox.nosandbox import NoSandbox
from kcoral.testing import fakes
from kcoral.testing.fakes import FakeSandbox
from tests.unit.test_compiles import _Seats

#: One instance of every sandbox, by the name of its class.
PROVIDERS: dict[str, Callable[[], object]] = {
    "BubblewrapSandbox": lambda: BubblewrapSandbox([]),
    "NoSandbox": NoSandbox,
    "FakeSandbox": FakeSandbox,
    "FakeSandbox(isolates_devices)": lambda: FakeSandbox(isolates_devices=True),
    "_Seats": _Seats,
}


def _declared_providers() -> set[str]:
    """The classes of the sandbox package and of L{kcoral.testing.fakes} that declare L{ISandbox}."""
    modules = [fakes]
    for info in pkgutil.iter_modules(kcoral.server.sandbox.__path__):
        modules.append(importlib.import_module(f"kcoral.server.sandbox.{info.name}"))
    return {
        name
        for module in modules
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and ISandbox.implementedBy(value)
    }


class SandboxContractTests(SynchronousTestCase):
    """L{verifyObject} on each provider of L{ISandbox}."""

    def test_every_provider(self) -> None:
        """Each real and fake sandbox provides every member of L{ISandbox}."""
        for name, make in PROVIDERS.items():
            with self.subTest(name):
                sandbox = make()
                self.assertTrue(verifyObject(ISandbox, sandbox))
                self.assertTrue(verifyClass(ISandbox, type(sandbox)))

    def test_every_declared_provider_is_checked(self) -> None:
        """No class in the sandbox package or the fakes declares L{ISandbox} unchecked here."""
        checked = {name.split("(")[0] for name in PROVIDERS}
        self.assertEqual(_declared_providers() - checked, set())

    def test_sizes(self) -> None:
        """Only bubblewrap has private tmpfs sizes; the others capture into the workspace."""
        sandbox = BubblewrapSandbox([], capture_bytes=1 << 20, workspace_bytes=1 << 30)
        self.assertEqual((sandbox.capture_bytes, sandbox.workspace_bytes), (1 << 20, 1 << 30))
        for other in (NoSandbox(), FakeSandbox()):
            self.assertEqual((other.capture_bytes, other.workspace_bytes), (None, None))
