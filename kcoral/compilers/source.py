# -*- test-case-name: tests.unit.test_compilers -*-
"""
Source preparation shared by every CUDA C compile path.

A kernel is looked up in a module image by its plain name, so the server
gives non-template C{__global__} functions C{extern "C"} linkage before any
backend compiles them (C{builtin.compile_cuda} on GPU nodes and
C{builtin.compile_cuda_binary} on CPU nodes alike).
"""

from __future__ import annotations

import re


def add_extern_c(source: str) -> str:
    """
    Give each non-template C{__global__} function C{extern "C"} linkage so
    it can be looked up by its plain name (sources that say C{extern "C"}
    themselves are left alone).
    """
    if 'extern "C"' in source:
        return source
    out = []
    last = 0
    for match in re.finditer(r"__global__", source):
        before = source[last : match.start()]
        tail = source[: match.start()].rstrip()
        out.append(before)
        if not tail.endswith(">"):  # template<...> __global__
            out.append('extern "C" ')
        out.append("__global__")
        last = match.end()
    out.append(source[last:])
    return "".join(out)
