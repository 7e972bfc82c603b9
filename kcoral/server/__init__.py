"""
The reactor process: the HTTP API, the service tree, the worker pool, GPU
leases, caches, logs and the sandbox.

Layer rule: Twisted, Klein and psutil, never CUDA (no PyCUDA, CuPy or
torch) and nothing from C{kcoral.worker}, which runs only in the worker
processes it spawns; it builds on C{kcoral.wire} and C{kcoral.config}
(tests/unit/test_layers.py checks every module's imports).
"""
