"""
kcoral: a Twisted server that compiles, runs and times GPU programs.

Public names are imported lazily, so a worker that imports C{kcoral.errors}
or C{kcoral.builtins} never loads Twisted, Klein or the client.

Layers (DESIGN.md), imports running downward only, each package's
docstring stating its rule and tests/unit/test_layers.py checking them:
entry points (C{kcoral.server}, C{kcoral.worker}, C{kcoral.client},
C{kcoral.testing}) build on C{kcoral.wire}, C{kcoral.compilers} and
C{kcoral.config}.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ServerConfig": "kcoral.config",
    "create_app": "kcoral.server.service",
    "create_site": "kcoral.server.service",
    "KCoralService": "kcoral.server.service",
    "ExecutionError": "kcoral.errors",
    # The client API of kcoral 0.1.1, plus the async client.
    "AsyncClient": "kcoral.client.async_client",
    "Client": "kcoral.client.blocking",
    "Program": "kcoral.client.program",
    "Register": "kcoral.client.program",
    "ProgramResult": "kcoral.client.results",
    "ReturnedFile": "kcoral.client.files",
    "ReturnedFolder": "kcoral.client.files",
    "KCoralError": "kcoral.client.errors",
    "ProtocolError": "kcoral.client.errors",
    "TransportError": "kcoral.client.errors",
    "InstructionError": "kcoral.client.errors",
    "RemoteExecutionError": "kcoral.client.errors",
    "ResponseTooLarge": "kcoral.client.errors",
    "RemoteFunction": "kcoral.client.remote",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kcoral' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
