# -*- test-case-name: tests.unit.test_retention -*-
"""
Retention for the log directory: old run directories and saved programs.

Every server start adds a run directory under C{<log_dir>/runs/} (events
and saved programs, see L{kcoral.server.observe.logs}), and a busy server saves one
program per request, so without pruning the log directory only grows.
L{prune} applies an age bound and a total size bound: whole run
directories first, oldest first, then the current run's saved programs.
The current run's events file is never touched (it rotates by size).

L{RetentionService} runs L{prune} in the server's I/O thread pool once when
it starts and then every hour, and logs a C{logs_pruned} event when it
deleted something.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from twisted.application.internet import TimerService
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from kcoral.server.workers.reactor import RunBlocking

if TYPE_CHECKING:
    from kcoral.config import ServerConfig

__all__ = ["PruneResult", "RetentionPolicy", "RetentionService", "prune"]

_MIB = 1024 * 1024
_DAY = 86400.0

#: How often the service prunes, in seconds.
INTERVAL_SECONDS = 3600.0


@attrs.frozen
class RetentionPolicy:
    """
    @ivar max_age_seconds: delete what was last written longer ago; C{0}
        keeps everything by age.
    @ivar max_bytes: delete the oldest while the total is larger; C{0} sets
        no size bound.
    """

    max_age_seconds: float = 30 * _DAY
    max_bytes: int = 10240 * _MIB

    @classmethod
    def from_config(cls, config: ServerConfig) -> RetentionPolicy:
        """The policy of a L{kcoral.config.ServerConfig}."""
        return cls(
            max_age_seconds=config.log_retention_days * _DAY,
            max_bytes=config.log_retention_mbytes * _MIB,
        )

    @property
    def enabled(self) -> bool:
        return self.max_age_seconds > 0 or self.max_bytes > 0


@attrs.frozen
class PruneResult:
    """
    @ivar runs: run directories deleted.
    @ivar programs: saved programs of the current run deleted.
    @ivar freed_bytes: bytes those held.
    @ivar kept_bytes: bytes left under C{runs/}.
    """

    runs: tuple[str, ...] = ()
    programs: int = 0
    freed_bytes: int = 0
    kept_bytes: int = 0


@attrs.define
class _Entry:
    path: Path
    size: int
    mtime: float


def _files(root: Path) -> Iterable[os.stat_result]:
    for directory, _dirs, names in os.walk(root):
        for name in names:
            try:
                yield os.lstat(os.path.join(directory, name))
            except OSError:
                continue


def _measure(path: Path) -> _Entry:
    size = 0
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    for info in _files(path):
        size += info.st_size
        mtime = max(mtime, info.st_mtime)
    return _Entry(path, size, mtime)


def _programs(current: Path) -> list[_Entry]:
    programs = current / "programs"
    entries = []
    try:
        names = sorted(os.listdir(programs))
    except OSError:
        return []
    for name in names:
        if name.startswith("."):
            continue  # a program being written (".<id>.json.tmp")
        try:
            info = (programs / name).stat()
        except OSError:
            continue
        entries.append(_Entry(programs / name, info.st_size, info.st_mtime))
    return sorted(entries, key=lambda e: (e.mtime, e.path.name))


def prune(runs_dir: Path, current: Path | None, policy: RetentionPolicy, now: float) -> PruneResult:
    """
    Apply C{policy} to C{runs_dir}.  BLOCKING: walks and deletes files.

    Run directories other than C{current} go first: those last written
    before C{now - max_age_seconds}, then the oldest (by name, which is the
    start time) while everything under C{runs_dir} is larger than
    C{max_bytes}.  Then saved programs of C{current}, by the same two rules.
    Files that vanish meanwhile are skipped.

    @param runs_dir: C{<log_dir>/runs}.
    @param current: this server's run directory, never deleted itself.
    @param now: the current time (seconds since the epoch).
    """
    if not policy.enabled:
        return PruneResult()
    try:
        names = sorted(os.listdir(runs_dir))
    except OSError:
        return PruneResult()
    current_resolved = current.resolve() if current is not None else None
    others: list[_Entry] = []
    current_entry: _Entry | None = None
    for name in names:
        path = runs_dir / name
        if not path.is_dir() or path.is_symlink():
            continue
        entry = _measure(path)
        if current_resolved is not None and path.resolve() == current_resolved:
            current_entry = entry
        else:
            others.append(entry)
    total = sum(e.size for e in others) + (current_entry.size if current_entry else 0)
    cutoff = now - policy.max_age_seconds
    deleted: list[str] = []
    freed = 0

    def too_old(entry: _Entry) -> bool:
        return policy.max_age_seconds > 0 and entry.mtime < cutoff

    def too_big() -> bool:
        return policy.max_bytes > 0 and total > policy.max_bytes

    for entry in others:
        if too_old(entry) or too_big():
            shutil.rmtree(entry.path, ignore_errors=True)
            deleted.append(entry.path.name)
            freed += entry.size
            total -= entry.size
    programs = 0
    if current_entry is not None:
        for entry in _programs(current_entry.path):
            if not (too_old(entry) or too_big()):
                continue
            try:
                entry.path.unlink()
            except OSError:
                continue
            programs += 1
            freed += entry.size
            total -= entry.size
    return PruneResult(tuple(deleted), programs, freed, max(total, 0))


class RetentionService(TimerService):
    """
    Prune the log directory now and every L{INTERVAL_SECONDS}.

    @ivar last: the last L{PruneResult}, or C{None} before the first.
    """

    log = Logger()

    def __init__(
        self,
        runs_dir: Path,
        current: Path | None,
        policy: RetentionPolicy,
        run_blocking: RunBlocking,
        clock: IReactorTime,
        interval: float = INTERVAL_SECONDS,
    ) -> None:
        super().__init__(interval, self._tick)
        self.setName("retention")
        self.clock = clock
        self._clock = clock
        self._runs_dir = runs_dir
        self._current = current
        self._policy = policy
        self._run_blocking = run_blocking
        self.last: PruneResult | None = None

    def _tick(self) -> Deferred[None]:
        d = self._run_blocking(
            prune, self._runs_dir, self._current, self._policy, self._clock.seconds()
        )
        return d.addCallbacks(self._pruned, self._failed)

    def _pruned(self, result: PruneResult) -> None:
        self.last = result
        if result.runs or result.programs:
            self.log.info(
                "pruned {count} run(s) and {programs} saved program(s), {freed_bytes} bytes",
                kcoral_event="logs_pruned",
                count=len(result.runs),
                runs=list(result.runs),
                programs=result.programs,
                freed_bytes=result.freed_bytes,
                kept_bytes=result.kept_bytes,
            )

    def _failed(self, failure: Failure) -> None:
        # Keep the timer going: the next hour may succeed.
        self.log.failure("pruning the log directory failed", failure)
