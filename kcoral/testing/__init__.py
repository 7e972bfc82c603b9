"""
kcoral's test kit, shipped with the package so tests, benchmarks and
examples share it.

  - L{kcoral.testing.fakes}: in-memory fakes of the server's collaborators
    and of a compiler backend, for every unit test.
  - L{kcoral.testing.descriptors}: what a process's descriptors point at
    (memfds apart from the rest), for leak checks.
  - L{kcoral.testing.live_server}: blocking helpers that start a real
    C{kcoral server} and speak the wire protocol to it (integration tests,
    benchmarks, examples).
  - L{kcoral.testing.nats}: a real C{nats-server} on loopback with the
    pool's users and subject permissions (gateway and node-join tests).

Layer rule: the top layer beside the entry points; it may import any kcoral
package, and nothing in C{kcoral} outside this package imports it.
"""

# Code written before the test kit was split (tests on other branches) still
# imports the live-server helpers from here; new code names the module.
from kcoral.testing.live_server import (  # noqa: E402
    Response,
    ServerProcess,
    free_port,
    multipart_body,
    post_program,
    request,
    sha256,
)

__all__ = [
    "Response",
    "ServerProcess",
    "free_port",
    "multipart_body",
    "post_program",
    "request",
    "sha256",
]
