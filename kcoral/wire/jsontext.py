# -*- test-case-name: tests.unit.test_wire_errors -*-
"""
The one JSON text encoding of the wire package.

Response bodies, channel headers and error bodies all use it, so what the
server writes is what the strict 0.1.1 client accepts.
"""

from __future__ import annotations

import json
from typing import Any


def json_dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON that the strict 0.1.1 client accepts (no NaN)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode(
        "utf-8"
    )
