# -*- test-case-name: tests.unit.test_compilers -*-
"""
L{ICompilerBackend}: how CUDA C becomes a module image or a launchable kernel.

Providers are found with C{twisted.plugin.getPlugins(ICompilerBackend,
kcoral.plugins)}, so a third party adds one by dropping a module into
C{kcoral/plugins/} (or into a C{kcoral/plugins} directory, without
C{__init__.py}, anywhere else on C{sys.path}).

This module must stay cheap to import: only C{zope.interface}.
"""

from __future__ import annotations

from zope.interface import Attribute, Interface

#: L{ICompilerBackend.kind} of a backend whose C{compile} produces a module
#: image (cubin/fatbin) meant to be shipped and loaded elsewhere, later.
KIND_BINARY = "binary"

#: L{ICompilerBackend.kind} of a backend that runs where the GPU is and whose
#: image is meant to be loaded right away into the current context.
KIND_LOADABLE = "loadable"

KINDS = (KIND_BINARY, KIND_LOADABLE)


class MissingBackend(LookupError):
    """No compiler backend has the requested name."""


class DuplicateBackend(ValueError):
    """Two discovered compiler backends have the same C{name}."""


class ICompilerBackend(Interface):
    """
    A compiler of CUDA C source into a CUDA module image.

    Implementations must be usable from several threads at once: C{compile}
    keeps its scratch files private to the call.
    """

    name = Attribute(
        "Unique C{str} name, e.g. C{'nvcc'} or C{'sourcemodule'}; the key used by "
        "L{kcoral.compilers.get_backend} and part of the compile-cache key."
    )

    kind = Attribute(
        "C{'binary'} (source -> module image bytes for a named arch, no GPU needed, "
        "e.g. nvcc) or C{'loadable'} (compiles where the GPU is, for loading into "
        "the current context, e.g. PyCUDA SourceModule)."
    )

    def available() -> tuple[bool, str]:
        """
        Whether the backend can compile here.

        @return: C{(True, '')} when usable, else C{(False, reason)} where
            C{reason} is a human-readable sentence naming what is missing.
            Never raises.
        """

    def versions() -> dict[str, str]:
        """
        Toolchain versions, shown in /health and part of the compile-cache key.

        @return: a mapping such as C{{'nvcc': '13.0.88'}}; empty when the
            toolchain is unavailable. Never raises.
        """

    def compile(source: str, arch: str, options: tuple[str, ...], timeout: float) -> bytes:
        """
        Compile C{source} for C{arch} into a module image.

        @param source: CUDA C++ source text.
        @param arch: target architecture, C{sm_NN[a|f]} or C{compute_NN[a|f]}.
        @param options: extra compiler flags, one argument per element.
        @param timeout: wall-clock limit in seconds for the whole compilation.

        @return: the module image bytes (for nvcc a cubin for exactly C{arch}),
            loadable with C{cuModuleLoadData}.

        @raise kcoral.errors.ExecutionError: kind C{compile} with the
            compiler's diagnostics (or on timeout), C{parse} for a bad arch or
            a disallowed flag, C{unavailable} without a toolchain.
        """


class ICommandLineBackend(Interface):
    """
    Optional, beside L{ICompilerBackend}: a backend whose compile is one
    command line that reads a source file and writes the image to a file.
    The server runs such a compile for its shared cache directly in a
    sandbox of its own, with no Python there (L{kcoral.server.workers.compiles}):
    the outcome is the command's exit status and the file it wrote.
    """

    def command(
        source_path: str, output_path: str, arch: str, options: tuple[str, ...], tmpdir: str
    ) -> tuple[list[str], dict[str, str]]:
        """
        The command that compiles C{source_path} for C{arch} into
        C{output_path}, and its whole environment (C{TMPDIR} at C{tmpdir}).
        C{compile} must run exactly this command.

        @return: C{(argv, env)}; C{argv[0]} an absolute path.
        @raise kcoral.errors.ExecutionError: C{parse} for a bad arch or a
            disallowed flag, C{unavailable} without a toolchain.
        """
