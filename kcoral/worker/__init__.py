"""
The worker process: a blocking loop that runs one program at a time on its
device, talking to the server over the control channel.

Layer rule: no reactor (nothing from C{twisted.internet}), no Klein or
treq, and nothing from C{kcoral.server} or C{kcoral.client}; it builds on
C{kcoral.wire}, C{kcoral.compilers} and C{kcoral.errors}, with CUDA
libraries on GPU nodes (tests/unit/test_layers.py checks every module's
imports).
"""
