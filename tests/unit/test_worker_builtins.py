"""
The builtin vocabulary: one table (L{kcoral.wire.program.BUILTINS}) names
every builtin and its C{cpu_only} flag; the worker tables follow it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import kcoral.builtins
from kcoral.errors import ExecutionError
from kcoral.wire.program import BUILTIN_NAMES, BUILTINS, GPU_ONLY_BUILTINS
from kcoral.worker.builtins import cpu_builtins, registered
from kcoral.worker.gpu_builtins import GPU_BUILTINS


def test_names_come_from_the_table() -> None:
    """The parser's names are the table's names."""
    assert frozenset(BUILTINS) == BUILTIN_NAMES
    assert GPU_ONLY_BUILTINS <= BUILTIN_NAMES


def test_cpu_table_follows_the_table() -> None:
    """A CPU worker registers every builtin but the GPU-only ones, with the table's flags."""
    table = cpu_builtins()
    assert set(table) == set(BUILTINS) - GPU_ONLY_BUILTINS
    assert {name: cpu_only for name, (_, cpu_only) in table.items()} == {
        name: BUILTINS[name] for name in table
    }


def test_gpu_table_follows_the_table() -> None:
    """The GPU table's flags are the table's; every GPU-only builtin is in it."""
    assert GPU_ONLY_BUILTINS <= set(GPU_BUILTINS)
    for name, (_, cpu_only) in GPU_BUILTINS.items():
        assert cpu_only is BUILTINS[name], name


def test_registered_takes_flags_from_the_table() -> None:
    """registered() pairs each implementation with its name's flag."""

    def compile_cuda() -> None:
        return None

    assert registered({"builtin.compile_cuda": compile_cuda}) == {
        "builtin.compile_cuda": (compile_cuda, True)
    }


def test_importable_helpers_name_table_builtins() -> None:
    """Every helper uploaded code imports from kcoral.builtins is a table builtin."""
    helpers = [n for n in kcoral.builtins.__all__ if n[0].islower()]
    assert helpers
    for name in helpers:
        assert f"builtin.{name}" in BUILTINS, name


def test_gpu_builtins_do_not_import_the_backend() -> None:
    """
    The GPU builtins and the tensor helpers import no L{kcoral.worker.gpu}:
    the backend depends on them, never the other way round.
    """
    code = (
        "import sys\n"
        "import kcoral.worker.gpu_builtins, kcoral.worker.tensors\n"
        "print('kcoral.worker.gpu' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "False"


def test_one_current_backend() -> None:
    """use_backend sets the runtime's backend, which the GPU builtins read."""
    from kcoral.worker import gpu_builtins, runtime

    class FakeGpu:
        name = "gpu"

    saved = runtime.current_backend()
    try:
        fake = FakeGpu()
        gpu_builtins.use_backend(fake)
        assert runtime.current_backend() is fake
        assert gpu_builtins.current_backend() is fake
        runtime.use_backend(None)
        with pytest.raises(ExecutionError) as e:
            gpu_builtins.current_backend()
        assert e.value.kind == "unavailable"
    finally:
        runtime.use_backend(saved)
