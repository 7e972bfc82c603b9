# -*- test-case-name: tests.unit.test_compilers -*-
"""
L{ICompilerBackend}: how CUDA C becomes a module image or a launchable kernel.

Providers are found with C{twisted.plugin.getPlugins(ICompilerBackend,
kcoral.plugins)}, so a third party adds one by dropping a module into
C{kcoral/plugins/}.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface


class MissingBackend(LookupError):
    """No compiler backend has the requested name."""


class ICompilerBackend(Interface):
    """A compiler of CUDA C source."""

    name = Attribute("Unique name, e.g. C{'nvcc'} or C{'sourcemodule'}.")

    def available() -> tuple[bool, str]:
        """C{(True, '')} when usable here, else C{(False, reason)}."""

    def versions() -> dict[str, str]:
        """Toolchain versions, shown in /health."""

    def compile(source: str, arch: str, options: tuple[str, ...], timeout: float) -> bytes:
        """
        Compile C{source} for C{arch} into a module image.

        @raise kcoral.errors.ExecutionError: C{compile} with diagnostics,
            C{parse} for a bad arch or flag, C{unavailable} without a toolchain.
        """
