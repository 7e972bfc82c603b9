"""
kcoral's test kit, shipped with the package so tests, benchmarks and
examples share it.

  - L{kcoral.testing.fakes}: in-memory fakes of the server's collaborators
    and of a compiler backend, for every unit test.
  - L{kcoral.testing.live_server}: blocking helpers that start a real
    C{kcoral server} and speak the wire protocol to it (integration tests,
    benchmarks, examples).

Layer rule: the top layer beside the entry points; it may import any kcoral
package, and nothing in C{kcoral} outside this package imports it.
"""
