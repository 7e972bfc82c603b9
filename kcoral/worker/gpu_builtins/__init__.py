# -*- test-case-name: tests.unit.test_gpu_builtins_cpu,tests.gpu.test_gpu_backend -*-
"""
GPU builtins: timing, correctness checks, tensor factories and kernel
launch handles, one module each.

These are the callables behind C{builtin.benchmark} (L{timing}),
C{builtin.check_close} and C{builtin.assert_close} (L{closeness}),
C{builtin.randn}, C{builtin.empty} and C{builtin.zeros} (L{factories}),
C{builtin.kernel} (L{launch}) and C{builtin.compile_cuda} (L{compiling}),
and the functions uploaded Python imports from C{kcoral.builtins}.

The device work goes through the worker's current backend, held in one place
(L{kcoral.worker.runtime}); the host-side tensor helpers are in
L{kcoral.worker.tensors}.  None of these modules imports L{kcoral.worker.gpu}.
Everything that needs no device (configuration parsing, iteration counts,
statistics, the closeness test, argument checking) is a plain function and
is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kcoral.compilers.source import add_extern_c
from kcoral.worker.builtins import registered
from kcoral.worker.gpu_builtins.closeness import (
    assert_close,
    check_close,
    compare_arrays,
    mismatch_message,
    parse_tolerances,
)
from kcoral.worker.gpu_builtins.compiling import (
    compile_cuda,
    compile_image,
    kernel_signature,
    parse_compile_cfg,
)
from kcoral.worker.gpu_builtins.factories import empty, host_randn, parse_tensor_spec, randn, zeros
from kcoral.worker.gpu_builtins.launch import (
    ARG_TYPES,
    KernelHandle,
    convert_argument,
    device_pointer,
    launcher,
    normalize_arg_types,
)
from kcoral.worker.gpu_builtins.timing import (
    ESTIMATE_CALLS,
    SPIN_NS,
    STABLE_CV,
    BenchmarkConfig,
    EventTimer,
    benchmark,
    compare,
    iteration_count,
    latency_stats,
    parse_benchmark_cfg,
    plan_counts,
    split_cfg,
)
from kcoral.worker.runtime import current_lease, use_backend
from kcoral.worker.runtime import gpu_backend as current_backend

#: The GPU worker's builtins by wire name (their C{cpu_only} flags come
#: from L{kcoral.wire.program.BUILTINS}, protocol §10.2).
GPU_BUILTINS: dict[str, tuple[Callable[..., Any], bool]] = registered(
    {
        "builtin.benchmark": benchmark,
        "builtin.compare": compare,
        "builtin.check_close": check_close,
        "builtin.assert_close": assert_close,
        "builtin.randn": randn,
        "builtin.empty": empty,
        "builtin.zeros": zeros,
        "builtin.compile_cuda": compile_cuda,
        "builtin.kernel": launcher,
    }
)

__all__ = [
    "ARG_TYPES",
    "ESTIMATE_CALLS",
    "GPU_BUILTINS",
    "SPIN_NS",
    "STABLE_CV",
    "BenchmarkConfig",
    "EventTimer",
    "KernelHandle",
    "add_extern_c",
    "assert_close",
    "benchmark",
    "compare",
    "check_close",
    "compare_arrays",
    "compile_cuda",
    "compile_image",
    "convert_argument",
    "current_backend",
    "current_lease",
    "device_pointer",
    "empty",
    "host_randn",
    "iteration_count",
    "kernel_signature",
    "latency_stats",
    "launcher",
    "mismatch_message",
    "normalize_arg_types",
    "parse_benchmark_cfg",
    "parse_compile_cfg",
    "parse_tensor_spec",
    "parse_tolerances",
    "plan_counts",
    "randn",
    "split_cfg",
    "use_backend",
    "zeros",
]
