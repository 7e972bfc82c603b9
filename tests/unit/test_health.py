"""
Tests for L{kcoral.server.observe.health}: the whole server's /health from
every front end's figures.
"""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.observe.health import merge_health


def _health(index: int, workers: list[str], ready: int, active: int) -> dict[str, Any]:
    return {
        "status": "ok",
        "load": {
            "request_capacity": len(workers),
            "requests_in_progress": active,
            "requests_waiting": 0,
        },
        "active_requests": active,
        "queue_length": 0,
        "workers": [{"worker_id": w} for w in workers],
        "spares": [],
        "gpus": [{"gpu_id": 0, "lease_depth": 1, "holder": "gpu0/w1", "spares_ready": ready}],
        "front_end": {"index": index, "of": 2},
    }


class MergeHealthTests(SynchronousTestCase):
    def test_the_whole_server(self) -> None:
        own = _health(1, ["gpu0/w1", "gpu0/w3"], ready=1, active=1)
        peers = {0: _health(0, ["gpu0/w0", "gpu0/w2"], ready=2, active=0), 1: {"stale": True}}
        merged = merge_health(own, peers, 1)
        self.assertEqual(
            merged["load"],
            {"request_capacity": 4, "requests_in_progress": 1, "requests_waiting": 0},
        )
        self.assertEqual(
            [(w["worker_id"], w["front_end"]) for w in merged["workers"]],
            [("gpu0/w0", 0), ("gpu0/w2", 0), ("gpu0/w1", 1), ("gpu0/w3", 1)],
        )
        # The lease figures are this process's (the broker's); spares are summed.
        self.assertEqual(merged["gpus"][0]["holder"], "gpu0/w1")
        self.assertEqual(merged["gpus"][0]["spares_ready"], 3)
        self.assertEqual(merged["front_end"], {"index": 1, "of": 2, "reporting": [0, 1]})
        self.assertEqual(own["load"]["request_capacity"], 2)  # not changed in place
