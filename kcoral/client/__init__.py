"""
kcoral's own clients: L{Program}, the blocking L{Client} (0.1.1 API) and
the treq-based L{AsyncClient}.

Names are imported lazily: C{kcoral.client.errors} and the result types
load neither Twisted nor crochet.

Layer rule: an entry point beside the server; it builds on C{kcoral.wire}
and never imports C{kcoral.server} or C{kcoral.worker}
(tests/unit/test_layers.py checks every module's imports).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "AsyncClient": "kcoral.client.async_client",
    "Attempt": "kcoral.client.async_client",
    "IProgress": "kcoral.client.async_client",
    "Client": "kcoral.client.blocking",
    "Program": "kcoral.client.program",
    "Register": "kcoral.client.program",
    "ProgramResult": "kcoral.client.results",
    "ReturnedFile": "kcoral.client.files",
    "ReturnedFolder": "kcoral.client.files",
    "KCoralError": "kcoral.client.errors",
    "ProtocolError": "kcoral.client.errors",
    "TransportError": "kcoral.client.errors",
    "ResponseTooLarge": "kcoral.client.errors",
    "InstructionError": "kcoral.client.errors",
    "RemoteExecutionError": "kcoral.client.errors",
    "RemoteFunction": "kcoral.client.remote",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kcoral.client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
