# -*- test-case-name: tests.unit.test_gateway_pool -*-
"""
The gateway's view of its pool: the nodes' presence records as the
C{kcoral-nodes} bucket delivers them, when each was last seen (on the
gateway's own clock, so node clocks never matter), and the decisions made
from them: which compatibility class a job goes to, whether any present
node could ever run it, and the pool's figures for C{/health}.
"""

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet.defer import Deferred, succeed

from kcoral.gateway.jobs import Presence

__all__ = ["NodeState", "PoolView"]


@attrs.define
class NodeState:
    """A node as the gateway last saw it."""

    presence: Presence
    #: Gateway clock seconds of its last presence update.
    seen: float


@attrs.define
class PoolView:
    """
    Present nodes by id.  A node is present while its last update is no
    older than C{presence_timeout}; while the NATS connection is down,
    presence is unknown and nobody is declared gone (L{suspend}); after a
    reconnect every node gets a fresh C{presence_timeout} (L{resume}).
    """

    presence_timeout: float
    nodes: dict[str, NodeState] = attrs.field(factory=dict)
    #: Nodes seen since the gateway started, by id (joined, left).
    joined: int = 0
    left: int = 0
    suspended: bool = False
    #: Whether the presence bucket's contents have been read once: until
    #: then an empty view means "not known yet", not "no node".
    loaded: bool = False
    _loading: list[Deferred[None]] = attrs.field(factory=list, repr=False)

    def mark_loaded(self) -> None:
        """The presence watch delivered every record the bucket held."""
        self.loaded = True
        waiting, self._loading = self._loading, []
        for d in waiting:
            d.callback(None)

    def when_loaded(self) -> Deferred[None]:
        """
        Fires once L{mark_loaded} was called (at once if it was); cancelling
        it only stops this wait.
        """
        if self.loaded:
            return succeed(None)

        def cancel(d: Deferred[None]) -> None:
            if d in self._loading:
                self._loading.remove(d)

        d: Deferred[None] = Deferred(cancel)
        self._loading.append(d)
        return d

    def update(self, presence: Presence, now: float) -> bool:
        """A node's presence record arrived; whether the node is new."""
        new = presence.node not in self.nodes
        self.nodes[presence.node] = NodeState(presence, now)
        if new:
            self.joined += 1
        return new

    def touch(self, node: str | None, now: float) -> None:
        """
        A sign of life from C{node} other than its presence record (it is
        fetching a blob or posting a result): it counts as seen now.
        """
        state = self.nodes.get(node) if node is not None else None
        if state is not None:
            state.seen = max(state.seen, now)

    def remove(self, node: str) -> bool:
        """A node's key was deleted (a node that stops cleanly); whether it was known."""
        if self.nodes.pop(node, None) is None:
            return False
        self.left += 1
        return True

    def expire(self, now: float) -> list[str]:
        """Forget the nodes not seen within the presence timeout; their ids."""
        if self.suspended:
            return []
        gone = [n for n, s in self.nodes.items() if now - s.seen > self.presence_timeout]
        for node in gone:
            self.remove(node)
        return gone

    def suspend(self) -> None:
        """The NATS connection is down: presence is unknown, nobody expires."""
        self.suspended = True

    def resume(self, now: float) -> None:
        """The connection is back: every node known gets a fresh timeout."""
        self.suspended = False
        for state in self.nodes.values():
            state.seen = now

    def present(self, node: str, now: float) -> bool:
        """Whether C{node} counts as present at C{now}."""
        state = self.nodes.get(node)
        if state is None:
            return False
        return self.suspended or now - state.seen <= self.presence_timeout

    def _live(self, now: float) -> list[Presence]:
        return [s.presence for n, s in self.nodes.items() if self.present(n, now)]

    def can_run(self, compat: str, gpus: int, now: float) -> bool:
        """Whether a present node of class C{compat} could ever run a job needing C{gpus} GPUs."""
        return any(p.compat == compat and p.can_take(gpus) for p in self._live(now))

    def choose(self, gpus: int, now: float, prefer: str | None = None) -> str | None:
        """
        The compatibility class a job needing C{gpus} GPUs goes to, or
        C{None} when no present node could ever run it: the preferred
        node's class when it can take the job, else the class with the most
        free seats among nodes that can (then the most seats, then the
        smallest key, so the choice is deterministic).
        """
        live = [p for p in self._live(now) if p.can_take(gpus)]
        if not live:
            return None
        if prefer is not None:
            for p in live:
                if p.node == prefer:
                    return p.compat
        free: dict[str, tuple[int, int]] = {}
        for p in live:
            f, s = free.get(p.compat, (0, 0))
            free[p.compat] = (f + p.free, s + p.seats)
        return min(free, key=lambda c: (-free[c][0], -free[c][1], c))

    def classes(self, now: float) -> set[tuple[str, int]]:
        """Every (compat, gpus) pair some present node pulls from."""
        return {(p.compat, g) for p in self._live(now) for g in range(p.gpus + 1)}

    def summary(self, now: float) -> dict[str, Any]:
        """The pool's figures for C{/health} and C{/status}."""
        live = self._live(now)
        return {
            "nodes": len(live),
            "seats": sum(p.seats for p in live),
            "free_seats": sum(min(p.free, p.seats) for p in live),
            "gpus": sum(p.gpus for p in live),
            "presence": "unknown" if self.suspended else "live",
        }

    def node_list(self, now: float) -> list[dict[str, Any]]:
        """Each present node's record, with how long ago the gateway saw it."""
        return [
            {
                "node": p.node,
                "compat": p.compat,
                "target": dict(p.target),
                "gpus": p.gpus,
                "seats": p.seats,
                "free": p.free,
                "seen_seconds_ago": round(now - self.nodes[p.node].seen, 3),
            }
            for p in sorted(self._live(now), key=lambda p: p.node)
        ]
