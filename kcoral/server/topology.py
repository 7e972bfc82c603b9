# -*- test-case-name: tests.unit.test_topology,tests.unit.test_service -*-
"""
The front-end topology of one server process, decided in one place.

A server runs as one process (C{--front-ends 1}, the default) or as
several front-end processes behind one port (L{kcoral.server.frontends}).
Which of them a process is, is not an option: it is wiring, the internal
L{FrontEnd} value, which the first front end hands to the others it starts
(L{kcoral.server.frontend_main}) and which no one else sets.  From it and
the whole server's L{ServerConfig}, L{Topology} decides everything that
differs between the three roles:

  - C{alone}: the whole configuration, its own L{LeaseArbiter}, no extra
    children;
  - C{first} of several: its share of the seats and caps, the arbiter
    behind the lease broker, and children that start, restart and stop the
    other front ends (L{FrontEndsService}) and report its health to them;
  - C{other}: its share, a L{RemoteArbiter} connected to the first's broker
    before anything else starts, and health reports.

Only the first of several front ends (or the one alone) speaks for the
server: to systemd, and with a lame duck at a graceful stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from twisted.application import service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from kcoral.config import ServerConfig
from kcoral.server.children import AsyncService
from kcoral.server.frontends import REPORT_INTERVAL, BrokerConnection, FrontEndsService
from kcoral.server.leases.broker import RemoteArbiter
from kcoral.server.leases.lease import LeaseArbiter

if TYPE_CHECKING:
    from kcoral.server.http.app import KcoralAPI

__all__ = ["SPLIT_CAPS", "FrontEnd", "HealthReports", "Topology", "share_of"]

#: Caps that are the server's whole, split between its front ends.
SPLIT_CAPS = (
    "cache_capacity_bytes",
    "max_bytes_in_flight",
    "max_bytes_per_client",
    "max_connections",
    "max_connections_per_client",
    "max_queued_requests",
)


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative integer, got {value!r}")


def _to_optional_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen(kw_only=True)
class FrontEnd:
    """
    Which of the server's front-end processes this one is: wiring that the
    first front end passes to the others, never an option.

    @ivar index: C{0} for the first front end (or the only one); the first
        numbers the others from C{1}.
    @ivar broker: the Unix socket of the first front end's lease broker,
        for the others; C{None} in the first.
    """

    index: int = attrs.field(default=0, validator=_non_negative)
    broker: Path | None = attrs.field(default=None, converter=_to_optional_path)

    def __attrs_post_init__(self) -> None:
        if (self.index == 0) != (self.broker is None):
            raise ValueError("a front end other than the first needs the broker, the first none")

    @property
    def first(self) -> bool:
        """Whether this is the first front end (or the only one)."""
        return self.index == 0


def share_of(config: ServerConfig, index: int) -> ServerConfig:
    """
    Front end C{index}'s configuration: its part of the caps (rounded up;
    C{0}, no cap, stays) and its log directory (C{<log dir>/front-end-<n>}
    for the others).  Its seats and spares are chosen by index
    (L{ServerConfig.seats}, L{ServerConfig.spares_of}).
    """
    caps = {}
    for name in SPLIT_CAPS:
        whole = getattr(config, name)
        caps[name] = whole if not whole else max(1, -(-whole // config.front_ends))
    log_dir = config.log_dir
    if log_dir is not None and index:
        log_dir = log_dir / f"front-end-{index}"
    return attrs.evolve(config, log_dir=log_dir, **caps)


@attrs.frozen
class Topology:
    """
    This process's place among the server's front ends, and what follows
    from it.

    @ivar whole: the whole server's configuration.
    @ivar front_end: which front end this process is.
    """

    whole: ServerConfig
    front_end: FrontEnd = attrs.field(factory=FrontEnd)

    def __attrs_post_init__(self) -> None:
        if self.front_end.index >= self.whole.front_ends:
            raise ValueError(
                f"front end {self.front_end.index} does not exist: the server has "
                f"{self.whole.front_ends}"
            )

    @property
    def several(self) -> bool:
        """Whether the server runs more than one front end."""
        return self.whole.front_ends > 1

    @property
    def role(self) -> str:
        """C{"alone"}, C{"first"} (of several) or C{"other"}."""
        if not self.several:
            return "alone"
        return "first" if self.front_end.first else "other"

    @property
    def speaks_for_the_server(self) -> bool:
        """
        Whether this process tells systemd about the server and runs its
        lame duck: the one alone, or the first of several (whose C{/health}
        the others follow).
        """
        return self.front_end.first

    @property
    def config(self) -> ServerConfig:
        """This process's configuration: the whole one, or its share of it."""
        if not self.several:
            return self.whole
        return share_of(self.whole, self.front_end.index)

    def leases(self, gpus: Sequence[int], reactor: IReactorTime) -> LeaseArbiter | RemoteArbiter:
        """The arbiter here, or the first front end's through its broker."""
        if self.role == "other":
            return RemoteArbiter(tuple(gpus), reactor)
        return LeaseArbiter(tuple(gpus), reactor)

    def before_logs(
        self, reactor: Any, leases: LeaseArbiter | RemoteArbiter
    ) -> list[service.Service]:
        """
        Children that start before the logs: in a front end other than the
        first, its connection to the broker.
        """
        if not isinstance(leases, RemoteArbiter):
            return []
        assert self.front_end.broker is not None
        return [_named(_BrokerConnectionService(reactor, leases, self.front_end.broker), "broker")]

    def after_http(
        self,
        reactor: Any,
        api: KcoralAPI,
        leases: LeaseArbiter | RemoteArbiter,
        endpoints: Sequence[str],
    ) -> list[service.Service]:
        """
        Children that start after the port listens (and stop before it
        closes), wiring C{api}'s view of the other front ends: in the first,
        the other front ends' processes; in every one of several, the
        health reports.
        """
        if not self.several:
            return []
        children: list[service.Service] = []
        report: Callable[[int, dict[str, Any]], None]
        if isinstance(leases, LeaseArbiter):
            front_ends = FrontEndsService(reactor, self.whole, endpoints, leases)
            grace = self.whole.worker_termination_grace_seconds * 2 + 10
            children.append(_named(_FrontEndsChild(front_ends, grace), "front-ends"))
            broker = front_ends.broker
            api.peer_health = lambda: broker.reports
            report = broker.report
        else:
            remote = leases
            api.peer_health = lambda: remote.peer_reports
            report = remote.report
        reports = HealthReports(reactor, api, self.front_end.index, report)
        children.append(_named(reports, "health-reports"))
        return children


def _named(child: service.Service, name: str) -> service.Service:
    child.setName(name)
    return child


class _BrokerConnectionService(AsyncService):
    """A front end other than the first connects to the lease broker before anything else."""

    def __init__(self, reactor: Any, leases: RemoteArbiter, broker: Path) -> None:
        self._connection = BrokerConnection(reactor, leases, broker)

    async def start(self) -> None:
        await self._connection.start()

    async def stop(self) -> None:
        self._connection.stop()


#: The most packed metrics a front end's report carries (bytes).
METRICS_REPORT_LIMIT = 32_000


class HealthReports(AsyncService):
    """Every second, this front end's own /health figures go to the others."""

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        api: KcoralAPI,
        index: int,
        report: Callable[[int, dict[str, Any]], None],
    ) -> None:
        self._api = api
        self._index = index
        self._report = report
        self._too_large_said = False
        self._loop = LoopingCall(self._send)
        self._loop.clock = reactor

    def send_now(self) -> None:
        """Report at once (the lame duck has begun: the others must say so too)."""
        try:
            self._send()
        except Exception:
            self.log.failure("a health report failed")

    def _send(self) -> None:
        health = self._api.local_health()
        if self._api.metrics is not None:
            from kcoral.server.observe.metrics import METRICS_REPORT_KEY, pack_families

            packed = pack_families(self._api.metrics.families())
            if len(packed) <= METRICS_REPORT_LIMIT:
                health[METRICS_REPORT_KEY] = packed
            elif not self._too_large_said:
                # An AMP value holds 64 KiB: the health figures must still go.
                self._too_large_said = True
                self.log.warn(
                    "this front end's metrics ({size} bytes packed) are too large to "
                    "report: the others' /metrics leave them out",
                    size=len(packed),
                )
        self._report(self._index, health)

    async def start(self) -> None:
        self._loop.start(REPORT_INTERVAL, now=True).addErrback(
            lambda failure: self.log.failure("health reports stopped", failure)
        )

    async def stop(self) -> None:
        if self._loop.running:
            self._loop.stop()


class _FrontEndsChild(AsyncService):
    """The first front end starts the others once it listens, and stops them first."""

    def __init__(self, front_ends: FrontEndsService, grace: float) -> None:
        self.front_ends = front_ends
        self._grace = grace

    async def start(self) -> None:
        self.front_ends.start()

    async def stop(self) -> None:
        await self.front_ends.stop(self._grace)
