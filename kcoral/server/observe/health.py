# -*- test-case-name: tests.unit.test_health -*-
"""
The whole server's C{/health} with several front ends (C{--front-ends N},
L{kcoral.server.frontends}): L{merge_health} adds the other front ends'
last reports to the answering front end's own figures.  A pure function of
dicts, so the HTTP app can use it without knowing how front ends are run.
"""

from __future__ import annotations

from typing import Any

_LOAD = ("request_capacity", "requests_in_progress", "requests_waiting")


def merge_health(
    own: dict[str, Any], peers: dict[int, dict[str, Any]], index: int
) -> dict[str, Any]:
    """
    The whole server's /health from this front end's own figures and the
    others' last reports: the load, the active and queued requests and each
    GPU's ready spares summed, every front end's workers and spares listed
    (each marked with its C{front_end}), the lease figures this process's
    (they are the broker's, the same everywhere), and under C{front_end}
    which reports are in (C{reporting}; each at most C{REPORT_INTERVAL} old,
    L{kcoral.server.frontends}).
    """
    others = {i: h for i, h in sorted(peers.items()) if i != index}
    merged = dict(own)
    merged["load"] = {key: sum(h["load"][key] for h in [own, *others.values()]) for key in _LOAD}
    for key in ("active_requests", "queue_length"):
        merged[key] = sum(h[key] for h in [own, *others.values()])
    for key in ("workers", "spares"):
        merged[key] = [
            {**entry, "front_end": i}
            for i, h in sorted([(index, own), *others.items()])
            for entry in h[key]
        ]
    ready: dict[int, int] = {}
    for h in [own, *others.values()]:
        for gpu in h["gpus"]:
            ready[gpu["gpu_id"]] = ready.get(gpu["gpu_id"], 0) + gpu["spares_ready"]
    merged["gpus"] = [{**gpu, "spares_ready": ready[gpu["gpu_id"]]} for gpu in own["gpus"]]
    merged["front_end"] = {
        **own["front_end"],
        "reporting": sorted({index, *others}),
    }
    return merged
