"""
Tests for L{kcoral.compilers.tvmffi}'s source handling: which functions are
TVM-FFI host functions and what is added around them (issue 17, item 1).
The builds themselves are in C{tests/integration/test_tvmffi_build.py}.
"""

from __future__ import annotations

from kcoral.compilers.tvmffi import export_source, is_host_function

HOST = """
__global__ void add_one_kernel(const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + 1.0f;
}

// the exported function
void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
    int64_t n = x.size(0);
    add_one_kernel<<<(n + 255) / 256, 256>>>(
        static_cast<const float *>(x.data_ptr()), static_cast<float *>(y.data_ptr()), n);
}
"""


def test_host_function_recognised() -> None:
    assert is_host_function(HOST, "add_one")


def test_kernels_and_plain_functions_are_not() -> None:
    assert not is_host_function(HOST, "add_one_kernel")
    assert not is_host_function("void helper(int n) { }", "helper")
    assert not is_host_function(
        "__global__ void k(tvm::ffi::TensorView x) { }", "k"
    )  # a kernel, even with such a parameter
    assert not is_host_function("/* void f(tvm::ffi::TensorView x) { } */", "f")
    assert not is_host_function(HOST, "missing")


def test_export_added_once() -> None:
    text = export_source(HOST, "add_one")
    assert text.startswith("#include <tvm/ffi/container/tensor.h>")
    assert "#line 1\n" in text
    assert text.count("TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one);") == 1
    exported = HOST + "TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one);\n"
    assert export_source(exported, "add_one").count("TVM_FFI_DLL_EXPORT_TYPED_FUNC") == 1
