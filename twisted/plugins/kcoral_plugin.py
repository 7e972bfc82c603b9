# -*- test-case-name: tests.unit.test_tap -*-
"""
The C{kcoral} twistd plugin: C{twistd -n kcoral [options]}.

Kept to one lazy L{ServiceMaker}: C{kcoral.server.cli.tap} is imported only when
twistd runs the C{kcoral} subcommand, so listing plugins stays cheap.
"""

from twisted.application.service import ServiceMaker

kcoral = ServiceMaker(
    "kcoral",
    "kcoral.server.cli.tap",
    "A KCoral-compatible server that compiles, runs and times GPU programs.",
    "kcoral",
)
