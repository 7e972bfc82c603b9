# -*- test-case-name: tests.unit.test_gateway_service -*-
"""
The C{kcoral-gateway} twistd plugin: C{twistd -n kcoral-gateway --nats URL [options]}.

One lazy L{ServiceMaker}: C{kcoral.gateway.tap} is imported only when twistd
runs the subcommand.
"""

from twisted.application.service import ServiceMaker

kcoral_gateway = ServiceMaker(
    "kcoral-gateway",
    "kcoral.gateway.tap",
    "One KCoral URL for a pool of nodes that join over NATS.",
    "kcoral-gateway",
)
