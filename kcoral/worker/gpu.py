# -*- test-case-name: tests.gpu.test_gpu_backend,tests.unit.test_gpu_builtins_cpu -*-
"""
L{GpuBackend}: the PyCUDA device backend of a GPU worker.

PyCUDA owns contexts, device memory and transfers.  The backend retains the
device's I{primary} context and makes it current, so torch or cupy imported
by uploaded code use the same context and can share allocations with it.

What uploaded Python receives for a tensor depends on C{tensor_api}:

 - C{"pycuda"}: a C{pycuda.gpuarray.GPUArray};
 - C{"torch"}: a C{torch.Tensor} that aliases a PyCUDA allocation (the
   allocation lives as long as the tensor);
 - C{"auto"}: C{"torch"} when torch can be imported, else C{"pycuda"}.

This module imports neither PyCUDA nor torch at import time, so it can be
imported on machines without a GPU; its host-side tensor helpers are in
L{kcoral.worker.tensors}, the builtins in L{kcoral.worker.gpu_builtins}.
"""

from __future__ import annotations

import contextlib
import gc
import math
import mmap
import os
import platform
import re
import subprocess
import sys
from typing import Any

import numpy as np
from zope.interface import implementer

from kcoral.compilers.nvcc import find_nvcc
from kcoral.errors import ExecutionError
from kcoral.ipc import shared
from kcoral.wire.program import DTYPES
from kcoral.wire.values import numpy_dtype
from kcoral.worker.gpu_builtins import GPU_BUILTINS
from kcoral.worker.interfaces import IDeviceBackend
from kcoral.worker.tensors import (
    dtype_name,
    element_type_name,
    is_cupy_array,
    is_gpuarray,
    is_torch_tensor,
    numpy_parts,
    to_host,
    torch_parts,
)

#: Uploads at least this large are copied from page-locked memory: the
#: read-only mapping of the blob's sealed buffer is registered with the
#: driver for the copy (bench/gpu_tensor_path.py on the H200, 64 MiB:
#: 6.7 ms registered, registration included, against 12.5 ms pageable).
REGISTER_HOST_BYTES = 4 << 20

#: C{cuMemHostRegister} flag: the device only reads the memory.
CU_MEMHOSTREGISTER_READ_ONLY = 0x08

_libcuda: Any = None


def _driver_library() -> Any:
    """libcuda through ctypes, for the calls PyCUDA does not offer on any buffer."""
    global _libcuda
    if _libcuda is None:
        import ctypes

        library = ctypes.CDLL("libcuda.so.1")
        library.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        library.cuMemHostRegister_v2.restype = ctypes.c_int
        library.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        library.cuMemHostUnregister.restype = ctypes.c_int
        _libcuda = library
    return _libcuda


def _copy_htod(drv: Any, destination: Any, view: memoryview) -> None:
    """
    Copy C{view} to the device.  A large mapping of a shared buffer (an
    C{mmap}, page-aligned and only this upload's) is page-locked for the
    copy, then unlocked; if the driver refuses, the copy is pageable.
    """
    pointer = None
    if view.nbytes >= REGISTER_HOST_BYTES and isinstance(view.obj, mmap.mmap):
        try:
            library = _driver_library()
            pointer = int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])
            if library.cuMemHostRegister_v2(pointer, view.nbytes, CU_MEMHOSTREGISTER_READ_ONLY):
                pointer = None
        except Exception:  # no libcuda symbol, say: the pageable copy works
            pointer = None
    try:
        drv.memcpy_htod(destination, view)
    finally:
        if pointer is not None:
            _driver_library().cuMemHostUnregister(pointer)


#: C{cuMemHostRegister} flags for a returned tensor's buffer: the device
#: writes it (no C{READ_ONLY}); 0 is the driver's default.
CU_MEMHOSTREGISTER_DEFAULT = 0

#: Why page-locking a result buffer was refused, once per worker: set on the
#: first refusal (later large returns copy pageable without trying again)
#: and handed to the worker's log once by L{GpuBackend.take_notices}.
_dtoh_refused: str | None = None
_notices: list[str] = []


def dtoh_refused() -> str | None:
    """Why page-locking a result buffer was refused in this process, if it was."""
    return _dtoh_refused


def _refuse_dtoh(reason: str) -> None:
    global _dtoh_refused
    if _dtoh_refused is None:
        _dtoh_refused = reason
        _notices.append(
            "returned tensors are copied to pageable memory from now on: "
            f"page-locking a result buffer failed ({reason})"
        )


def copy_dtoh_shared(drv: Any, source: int, nbytes: int) -> shared.SharedBuffer | None:
    """
    C{nbytes} of device memory at C{source} copied into a new sealed buffer
    (L{kcoral.ipc.shared.fill}) whose writable mapping is page-locked for
    the copy, then unlocked: the result's one host copy, at pinned-memory
    speed, and the buffer is what the parent streams the response from.

    @return: C{None} when the mapping cannot be page-locked (logged once
        per worker; the caller copies as before).
    @raise Exception: the copy itself failed (the caller's copy would too).
    """
    if _dtoh_refused is not None or not shared.available():
        return None
    refused = False

    def copy(view: memoryview) -> None:
        nonlocal refused
        host = np.frombuffer(view, dtype=np.uint8)
        pointer = int(host.__array_interface__["data"][0])
        try:
            library = _driver_library()
            status = library.cuMemHostRegister_v2(pointer, nbytes, CU_MEMHOSTREGISTER_DEFAULT)
        except Exception as e:  # no libcuda symbol, say
            status, error = -1, f"{type(e).__name__}: {e}"
        else:
            error = f"cuMemHostRegister returned {status}"
        if status:
            refused = True
            _refuse_dtoh(error)
            return
        try:
            drv.memcpy_dtoh(host, source)
        finally:
            library.cuMemHostUnregister(pointer)
            del host

    try:
        buffer = shared.fill(nbytes, copy, "kcoral-result")
    except OSError as e:  # no memfd or no memory for one: the host copy may still fit
        _refuse_dtoh(f"{type(e).__name__}: {e}")
        return None
    if refused:
        buffer.close()
        return None
    return buffer


#: How a large returned device tensor reaches its shared buffer, from the
#: server's environment (bench/gpu_tensor_path.py measures each way):
#: C{staging} (the default) copies into a page-locked buffer the worker
#: keeps (grown to the largest return so far, at most L{STAGING_MAX_BYTES};
#: larger returns are registered), from which the part collector writes
#: the part's new buffer after the lease is given back, hashing beside the
#: C{write}; C{registered} page-locks the new buffer's own mapping for the
#: copy; C{pageable} copies through a host array as smaller tensors do.
#: Staging is the default because every result needs fresh shared-memory
#: pages, and those cost much less filled by C{write} than faulted in
#: through a mapping: on the dev machine, 64 MiB, 43 ms for a C{write} of
#: them against 75 ms for a populated mapping alone; on the H200 the
#: pageable copy into a mapping was the slower one too (54 against 46 ms).
DTOH_COPY_ENV = "KCORAL_DTOH_COPY"
DTOH_COPIES = ("staging", "registered", "pageable")

#: The largest page-locked staging buffer a worker keeps.
STAGING_MAX_BYTES = 64 << 20


def _dtoh_copy() -> str:
    how = os.environ.get(DTOH_COPY_ENV, DTOH_COPIES[0])
    return how if how in DTOH_COPIES else DTOH_COPIES[0]


class Staging:
    """
    A worker's page-locked staging buffer for returned tensors.

    Each large tensor of a return gets its own region of it (the regions
    follow each other; past L{STAGING_MAX_BYTES} in all, C{copy} declines
    and the caller registers instead); the engine's encoder copies every
    region into its part after the lease is given back, and L{release}
    then makes the whole buffer free for the next return.
    """

    def __init__(self) -> None:
        self.buffer: Any = None
        self.used = 0

    def copy(self, drv: Any, source: int, nbytes: int) -> memoryview | None:
        """
        C{nbytes} at C{source} copied into the next region: a view of it,
        valid until L{release}.  C{None} when the return's regions would
        pass L{STAGING_MAX_BYTES}, or no page-locked memory can be had
        (logged once; the caller copies another way).
        """
        if _dtoh_refused is not None or self.used + nbytes > STAGING_MAX_BYTES:
            return None
        end = self.used + nbytes
        if self.buffer is None or self.buffer.nbytes < end:
            # Regions handed out keep the old buffer alive through their views.
            try:
                self.buffer = drv.pagelocked_empty(end, np.uint8)
            except Exception as e:
                _refuse_dtoh(f"pagelocked_empty: {type(e).__name__}: {e}")
                return None
        host = self.buffer[self.used : end]
        drv.memcpy_dtoh(host, source)
        self.used = end
        return memoryview(host).cast("B")

    def release(self) -> None:
        """The regions handed out are copied (or dropped): reuse the buffer."""
        self.used = 0


def _device_source(value: Any, torch: Any, ordinal: int) -> tuple[int, int] | None:
    """
    C{(device pointer, bytes)} of a C-contiguous GPUArray, or of a
    contiguous CUDA torch tensor on the backend's device C{ordinal} (its
    work finished first); C{None} for anything else (copied the general way).
    """
    if is_gpuarray(value):
        if value.flags.c_contiguous and value.size:
            return int(value.gpudata), int(value.nbytes)
        return None
    if torch is not None and is_torch_tensor(value):
        if (
            value.is_cuda
            and value.is_contiguous()
            and value.numel()
            and value.get_device() == ordinal
        ):
            torch.cuda.synchronize()
            return int(value.data_ptr()), int(value.numel() * value.element_size())
    return None


#: Values of C{--tensor-api}.
TENSOR_APIS = ("auto", "torch", "pycuda")

#: Integer dtype of the same item size, used to move raw bits through APIs
#: (torch's CUDA array interface, DLPack) that lack bfloat16 or float8.
_STORAGE = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int16),
    4: np.dtype(np.int32),
    8: np.dtype(np.int64),
}
_TORCH_STORAGE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _pycuda_error_types() -> tuple[type[BaseException], ...]:
    drv = sys.modules.get("pycuda.driver")
    return (drv.Error,) if drv is not None else ()


@implementer(IDeviceBackend)
class GpuBackend:
    """
    One GPU, through PyCUDA and the device's primary context.

    @ivar ordinal: the CUDA device ordinal (logical, after
        C{CUDA_VISIBLE_DEVICES}).
    @ivar tensor_api: C{"torch"} or C{"pycuda"} after resolving C{"auto"}.
    """

    name = "gpu"
    uses_lease = True

    def __init__(self, ordinal: int = 0, tensor_api: str = "auto") -> None:
        if tensor_api not in TENSOR_APIS:
            raise ValueError(f"tensor_api must be one of {TENSOR_APIS}, got {tensor_api!r}")
        import pycuda.driver as drv

        drv.init()
        self.ordinal = ordinal
        self._drv = drv
        self.device = drv.Device(ordinal)
        self.context = self.device.retain_primary_context()
        self.context.push()
        # A multi-GPU worker (options.gpu_count) sees more devices: create
        # their primary contexts now as well, while it warms up under the
        # lease, so a program's first use of cuda:1 (torch adopts the same
        # primary context) does not create one while it holds every GPU.
        self.other_contexts = [
            drv.Device(i).retain_primary_context()
            for i in range(drv.Device.count())
            if i != ordinal
        ]
        self._closed = False
        major, minor = self.device.compute_capability()
        self._arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
        self._torch: Any = None
        if tensor_api in ("auto", "torch"):
            try:
                import torch
            except ImportError:
                if tensor_api == "torch":
                    raise
            else:
                self._torch = torch
                # Create torch's CUDA state now (it adopts the primary
                # context we made current) so no request pays for it.
                torch.cuda.init()
        self.tensor_api = "torch" if self._torch is not None else "pycuda"
        self._l2_flush: Any = None
        self._spin: Any = _UNSET
        self._dtoh_copy = _dtoh_copy()
        self._staging = Staging()

    # -- facts -------------------------------------------------------------

    def target(self) -> dict[str, str]:
        return {"arch": self._arch}

    @property
    def arch(self) -> str:
        """The compilation target, e.g. C{"sm_90a"}."""
        return self._arch

    def device_name(self) -> str:
        """The device's marketing name, e.g. C{"NVIDIA H200"}."""
        return str(self.device.name())

    def l2_cache_size(self) -> int:
        """The device's L2 cache size in bytes (64 MiB when the driver won't say)."""
        attribute = getattr(self._drv.device_attribute, "L2_CACHE_SIZE", None)
        size = int(self.device.get_attribute(attribute)) if attribute is not None else 0
        return size if size > 0 else 64 << 20

    def versions(self) -> dict[str, str]:
        import pycuda

        drv = self._drv
        out = {
            "cuda_driver": _cuda_version(drv.get_driver_version()),
            "cuda_runtime": ".".join(str(p) for p in drv.get_version()[:2]),
            "pycuda": str(pycuda.VERSION_TEXT),
            "numpy": np.__version__,
            "python": platform.python_version(),
        }
        nvidia = _nvidia_driver_version()
        if nvidia:
            out["driver"] = nvidia
        torch = self._torch or sys.modules.get("torch")
        if torch is not None:
            out["torch"] = str(torch.__version__)
        nvcc = nvcc_version()
        if nvcc:
            out["nvcc"] = nvcc
        return out

    # -- tensors -----------------------------------------------------------

    def allocate(self, dtype: str, shape: tuple[int, ...]) -> Any:
        """A new uninitialized C{GPUArray} of C{dtype}/C{shape}."""
        from pycuda import gpuarray

        return gpuarray.GPUArray(shape, numpy_dtype(dtype))

    def upload_tensor(self, data: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
        try:
            np_dtype = numpy_dtype(dtype)
        except ValueError:
            raise ExecutionError("runtime", f"unsupported tensor dtype {dtype!r}") from None
        shape = tuple(int(d) for d in shape)
        expected = math.prod(shape) * np_dtype.itemsize
        view = memoryview(data).cast("B")
        if view.nbytes != expected:
            raise ExecutionError(
                "runtime",
                f"tensor data is {view.nbytes} bytes, {dtype} {list(shape)} needs {expected}",
            )
        array = self.allocate(dtype, shape)
        if expected:
            _copy_htod(self._drv, array.gpudata, view)
        return self.wrap(array)

    def wrap(self, array: Any) -> Any:
        """What uploaded code receives for the C{GPUArray} C{array}."""
        if self.tensor_api == "torch":
            return self.as_torch(array)
        return array

    def as_torch(self, array: Any) -> Any:
        """
        A torch tensor aliasing C{array}'s memory.  torch keeps the exporting
        object (which references C{array}) alive as long as the tensor.
        """
        torch = self._torch
        if torch is None:
            import torch as torch_module

            torch = self._torch = torch_module
        name = dtype_name(array.dtype)
        device = f"cuda:{self.ordinal}"
        torch_dtype = getattr(torch, name)
        if array.size == 0:
            return torch.empty(array.shape, dtype=torch_dtype, device=device)
        from pycuda import gpuarray

        itemsize = array.dtype.itemsize
        # The interface's typestr of bfloat16/float8 is an opaque '<V2'/'|V1',
        # so export the bits as a same-size integer and reinterpret in torch.
        raw = gpuarray.GPUArray(
            array.shape,
            _STORAGE[itemsize],
            gpudata=array.gpudata,
            strides=array.strides,
            base=array,
        )
        tensor = torch.as_tensor(raw, device=device)
        if _TORCH_STORAGE[itemsize] != name:
            tensor = tensor.view(torch_dtype)
        return tensor

    def tensor_parts(
        self, value: Any
    ) -> tuple[str, tuple[int, ...], bytes | memoryview | shared.SharedBuffer] | None:
        """
        C{(dtype, shape, bytes)} of a GPUArray, torch tensor (CUDA or CPU),
        cupy array, other C{__cuda_array_interface__} exporter or numpy
        array; C{None} for anything else.

        For an element type outside the twelve, the data is not copied and
        C{(name, shape, b"")} is returned: the engine's encoder then fails
        the return with C{serialization} "cannot return tensor dtype X".

        A contiguous device tensor of L{REGISTER_HOST_BYTES} or more is
        copied at pinned-memory speed (L{DTOH_COPY_ENV}): into a region of
        the worker's page-locked staging buffer, and the bytes are a view of
        it, valid until L{returned} (the part collector copies it into the
        part's shared buffer, hashing beside the copy, off the lease); or
        into a new sealed shared buffer whose mapping is page-locked for the
        copy, and the bytes are that buffer (hashed later, off the lease,
        and kept as the part).
        """
        if is_torch_tensor(value):
            dtype, shape = value.dtype, tuple(value.shape)
        elif isinstance(value, np.ndarray) or is_gpuarray(value) or is_cupy_array(value):
            dtype, shape = value.dtype, tuple(value.shape)
        else:
            cai = getattr(value, "__cuda_array_interface__", None)
            if not isinstance(cai, dict):
                return None
            dtype, shape = np.dtype(cai["typestr"]), tuple(cai["shape"])
        name = element_type_name(dtype)
        if name not in DTYPES:
            return name, tuple(int(d) for d in shape), b""
        shape = tuple(int(d) for d in shape)
        source = _device_source(value, self._torch, self.ordinal)
        if (
            source is not None
            and source[1] >= REGISTER_HOST_BYTES
            and self._dtoh_copy != "pageable"
        ):
            if self._dtoh_copy == "staging":
                staged = self._staging.copy(self._drv, *source)
                if staged is not None:
                    return name, shape, staged
            buffer = copy_dtoh_shared(self._drv, *source)
            if buffer is not None:
                return name, shape, buffer
        if is_torch_tensor(value):
            return torch_parts(value)
        host = to_host(value)
        assert host is not None
        return numpy_parts(host)

    def returned(self) -> None:
        """
        A return instruction's parts are made: the staging regions its
        tensors were copied into (L{tensor_parts}) may be reused.
        """
        self._staging.release()

    def take_notices(self) -> list[str]:
        """Messages for the worker's log (written between programs, not captured)."""
        notices = list(_notices)
        del _notices[:]
        return notices

    def cpu_only_watch(self) -> Any:
        """
        Watch for CUDA use during a C{cpu_only} run: the driver itself through
        CUPTI (L{kcoral.worker.cuptiwatch}) when cupti-python works here, and
        always PyCUDA's and torch's Python entry points
        (L{kcoral.worker.gpuwatch}), which stop a call before it is made.
        """
        from kcoral.worker.cuptiwatch import driver_watch
        from kcoral.worker.gpuwatch import cpu_only_watch

        watch = driver_watch()
        if watch is None:
            return cpu_only_watch()
        stack = contextlib.ExitStack()
        stack.enter_context(watch.watching())
        stack.enter_context(cpu_only_watch())
        return stack

    def lazy_lease(self, acquire: Any, *, subscribe: bool = True) -> Any:
        """
        A context manager that runs a block off the lease and calls
        C{acquire} at its first device-touching driver call (CUPTI,
        L{kcoral.worker.cuptiwatch.DriverWatch.leasing}); C{None} when the
        driver cannot be watched here, and the lease must be taken up front.

        @param subscribe: whether to subscribe to CUPTI now if this process
            has not yet; without it only an existing subscription is used.
        """
        from kcoral.worker.cuptiwatch import driver_watch, existing_driver_watch

        watch = driver_watch() if subscribe else existing_driver_watch()
        return None if watch is None else watch.leasing(acquire)

    def builtins(self) -> dict[str, tuple[Any, bool]]:
        """The GPU builtin table, C{name -> (callable, cpu_only)}."""
        return dict(GPU_BUILTINS)

    # -- libraries ---------------------------------------------------------

    def load_library(self, data: bytes) -> LibraryHandle:
        try:
            module = self._drv.module_from_buffer(bytes(data))
        except _pycuda_error_types() as e:
            raise ExecutionError(
                "compile", f"cannot load the uploaded library: {type(e).__name__}: {e}"
            ) from e
        return LibraryHandle(module)

    # -- lifecycle ---------------------------------------------------------

    def drain(self) -> None:
        self._drv.Context.synchronize()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def cleanup(self) -> str | None:
        # The driver API reports launch-configuration errors when the launch
        # is made; what is left to find here are asynchronous faults, which
        # are sticky in CUDA: the context cannot be used again.
        try:
            self._drv.Context.synchronize()
        except _pycuda_error_types() as e:
            raise RuntimeError(f"CUDA context is poisoned: {type(e).__name__}: {e}") from e
        return None

    def reset(self) -> None:
        self._staging.release()
        # The program's young garbage (its tensors among it) before the
        # cache is emptied; the full collection, which costs milliseconds
        # with torch imported, runs after the answer (Engine.settle).
        gc.collect(1)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self._drv.Context.synchronize()

    def l2_flush_buffer(self) -> Any:
        """
        A device allocation twice the L2 size, made once and kept, that
        L{kcoral.worker.gpu_builtins.timing.benchmark} zeroes before each call.
        """
        if self._l2_flush is None:
            size = max(2 * self.l2_cache_size(), 4)
            size -= size % 4
            self._l2_flush = (self._drv.mem_alloc(size), size)
        return self._l2_flush

    def spin_function(self) -> Any:
        """
        A one-thread kernel C{spin(u64 ns)} that busy-waits on the GPU's
        global timer, JIT-loaded from PTX once; C{None} if it cannot load.
        L{kcoral.worker.gpu_builtins.timing.benchmark} runs it before each call when
        the L2 flush is off, so the host is ahead of the GPU when a call's
        start event executes.
        """
        if self._spin is _UNSET:
            try:
                module = self._drv.module_from_buffer(_SPIN_PTX)
                self._spin = (module, module.get_function("kcoral_spin"))
            except _pycuda_error_types():
                self._spin = None
        return None if self._spin is None else self._spin[1]

    def destroy_context(self) -> bool:
        """
        Destroy this process's CUDA contexts now (a retiring worker, under
        its GPUs' maintenance lease; docs/architecture.md, "The GPU lease"):
        pop ours, then reset every device's primary context through the
        driver API, which destroys it whoever else (torch) retained it.
        Returns C{False} when the driver call is not available or fails:
        the contexts then go when the process exits.  Nothing may use CUDA
        afterwards; the worker leaves with C{os._exit}.
        """
        import ctypes

        try:
            # Not close(): its garbage collection (so PyCUDA's objects die
            # before the context) is moot when the process leaves with
            # os._exit next, and this runs on the GPU's lease.
            self._closed = True
            self._drv.Context.synchronize()
            self._drv.Context.pop()
            # Already loaded by PyCUDA: dlopen hands back the same library
            # (no search, no helper process, nothing the sandbox forbids).
            libcuda = ctypes.CDLL("libcuda.so.1")
            reset = libcuda.cuDevicePrimaryCtxReset_v2
            reset.argtypes = [ctypes.c_int]
            reset.restype = ctypes.c_int
            for ordinal in range(self._drv.Device.count()):
                if reset(ordinal) != 0:
                    return False
        except Exception:
            return False
        return True

    def close(self) -> None:
        """Synchronize and pop the primary context (at worker exit)."""
        if self._closed:
            return
        self._closed = True
        self._l2_flush = None
        self._staging.buffer = None  # page-locked memory freed before its context
        gc.collect()
        try:
            self._drv.Context.synchronize()
        finally:
            self._drv.Context.pop()


def prepare_gpu_backend(tensor_api: str = "auto", **_: Any) -> None:
    """
    Import what a GPU backend needs without touching the device, so a new
    worker does this slow part before it asks for the GPU lease and holds
    the lease only to create its context.
    """
    import pycuda.driver

    import_gpu_modules(tensor_api)
    pycuda.driver.init()  # loads the driver; creates no context


def import_gpu_modules(tensor_api: str = "auto") -> None:
    """
    Import PyCUDA (and torch, for C{tensor_api} C{torch} or C{auto} when
    it is installed) without initialising CUDA: what the worker template
    (L{kcoral.worker.template}) does once, so that every worker it forks
    starts with them imported.  CUDA does not survive a fork once
    initialised, so nothing here may call C{cuInit}.
    """
    import pycuda.compiler  # noqa: F401
    import pycuda.driver  # noqa: F401
    import pycuda.gpuarray  # noqa: F401

    if tensor_api in ("auto", "torch"):
        try:
            import torch  # noqa: F401
        except ImportError:
            if tensor_api == "torch":
                raise


def make_gpu_backend(gpu_ordinal: int = 0, tensor_api: str = "auto", **_: Any) -> GpuBackend:
    """The factory for C{kcoral.worker.devices.register_backend("gpu", ...)}."""
    return GpuBackend(ordinal=gpu_ordinal, tensor_api=tensor_api)


class LibraryHandle:
    """
    An uploaded module image loaded with C{module_from_buffer}.

    @ivar module: the C{pycuda.driver.Module}.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self._functions: dict[str, LibraryFunction] = {}

    def get_function(self, name: str) -> LibraryFunction:
        """
        The kernel C{name}.

        @raise ExecutionError: C{compile} when the image exports no such kernel.
        """
        if name not in self._functions:
            try:
                function = self.module.get_function(name)
            except _pycuda_error_types():
                raise ExecutionError(
                    "compile", f"the uploaded library exports no function {name!r}"
                ) from None
            self._functions[name] = LibraryFunction(self, name, function)
        return self._functions[name]

    def __repr__(self) -> str:
        return f"<LibraryHandle with {len(self._functions)} function(s) looked up>"


class LibraryFunction:
    """
    A kernel of an uploaded library.  Calling it is PyCUDA's C{Function}
    call (C{f(*args, block=(x, y, z), grid=(x, y), shared=0)}); for a handle
    with fixed geometry and argument types see
    L{kcoral.worker.gpu_builtins.launch.launcher}.
    """

    def __init__(self, library: LibraryHandle, name: str, function: Any) -> None:
        self.library = library
        self.name = name
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<LibraryFunction {self.name}>"


_UNSET = object()

#: PTX of L{GpuBackend.spin_function}: wait until C{%globaltimer} has
#: advanced by the C{ns} parameter.
_SPIN_PTX = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry kcoral_spin(.param .u64 ns)
{
    .reg .pred %p;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd1, %rd1, %rd2;
WAIT:
    mov.u64 %rd3, %globaltimer;
    setp.lt.u64 %p, %rd3, %rd1;
    @%p bra WAIT;
    ret;
}
"""


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{(number % 1000) // 10}"


def _nvidia_driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            text = f.read()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", text)
    return match.group(1) if match else None


def nvcc_version() -> str | None:
    """C{"13.0.48"} from C{nvcc --version}, or C{None}."""
    nvcc, _ = find_nvcc()
    if nvcc is None:
        return None
    try:
        out = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None
