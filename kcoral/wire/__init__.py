"""
The KCoral protocol as pure functions and values: program validation,
multipart bodies, value encoding, error vocabularies, the control channel's
messages and framing, and the rendering of a response.

Layer rule: the bottom layer.  No Twisted, Klein or treq, no CUDA library,
and nothing from C{kcoral.server}, C{kcoral.worker}, C{kcoral.client},
C{kcoral.compilers} or C{kcoral.ipc}: the server, the worker and the client
all build on it.  It holds no operating-system resource either (no
C{threading}, C{ctypes}, C{socket}, C{mmap}, C{select}, C{os}, C{tempfile},
C{fcntl}, C{subprocess}): sealed buffers, descriptors, spool files and
threads are L{kcoral.ipc}'s, seen here through protocols
(L{kcoral.wire.parts.SharedPart}, L{kcoral.wire.multipart.BlobWriter},
L{kcoral.wire.values.PartSharer}) and named only for a type checker
(tests/unit/test_layers.py checks every module's imports).
"""
