"""
The KCoral protocol as pure functions and values: program validation,
multipart bodies, value encoding, error vocabularies, the control channel's
messages and the rendering of a response.

Layer rule: the bottom layer.  No Twisted, Klein or treq, no CUDA library,
and nothing from C{kcoral.server}, C{kcoral.worker}, C{kcoral.client} or
C{kcoral.compilers}: the server, the worker and the client all build on it
(tests/unit/test_layers.py checks every module's imports).
"""
