# -*- test-case-name: tests.unit.test_logs -*-
"""
Operator-visible logs: the run directory, C{events.jsonl}, the console
mirror and saved programs (server spec section 8).

Every operator-visible event is an ordinary L{twisted.logger} event that
carries C{kcoral_event} (the catalogue's event name) and that event's fields
as keys; emitters pick the level (C{log.info}, C{log.warn}, C{log.error})
and a format string of their own::

    log.info(
        "request {request_id} routed to {worker_id}",
        kcoral_event="request_routed",
        request_id=request_id,
        worker_id=worker_id,
        ...
    )

The observers here select those events:

  - L{JsonEventObserver} writes one compact JSON line per event, normally
    into a size-rotated L{LogFile} (C{events.jsonl}, C{events.jsonl.1}, ...).
  - L{ConsoleObserver} mirrors them on stderr in the spec's
    C{<timestamp> <LEVEL> <event> key=value} format.
  - L{ProgramRecorder} saves the raw program of each accepted request.

L{install_observers} wires all of them from a L{ServerConfig} and returns a
L{LogSetup} that removes them again.  Creating the run directory and opening
files blocks; it happens once, at startup, before the HTTP port is bound.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Protocol

import attrs
from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    LogBeginner,
    LogLevel,
    LogLevelFilterPredicate,
    LogPublisher,
    PredicateResult,
    globalLogPublisher,
    textFileLogObserver,
)
from twisted.python.logfile import BaseLogFile, LogFile
from zope.interface import implementer

from kcoral.server.observe.logwriter import BackgroundWriter

__all__ = [
    "CONSOLE_SKIPPED_KEYS",
    "DEFAULT_MAX_ROTATED_FILES",
    "DEFAULT_ROTATE_LENGTH",
    "EVENT_KEY",
    "ConsoleObserver",
    "JsonEventObserver",
    "LogDirectoryError",
    "LogSettings",
    "LogSetup",
    "ProgramRecorder",
    "RunDirectory",
    "event_fields",
    "event_level_for_finish_reason",
    "event_level_for_retire_reason",
    "format_timestamp",
    "install_observers",
    "twisted_console_observer",
    "is_kcoral_event",
    "level_name",
]

#: The event key that marks an operator-visible event; its value is the
#: catalogue's event name.
EVENT_KEY = "kcoral_event"

#: Default size at which C{events.jsonl} is rotated (64 MiB).
DEFAULT_ROTATE_LENGTH = 64 * 1024 * 1024

#: Default number of rotated files kept (C{events.jsonl.1} ... C{.10}).
DEFAULT_MAX_ROTATED_FILES = 10

#: Fields never shown on the console (they are long or nested).
CONSOLE_SKIPPED_KEYS = frozenset({"traceback", "versions", "config", "ops", "uploads"})

#: Longest console value before it is cut and followed by C{...}.
CONSOLE_VALUE_LIMIT = 120

#: Fields the console shows whole, whatever their length: an error's
#: message ends with its remedy (C{server_start_failed}'s "bubblewrap
#: cannot run (...); fix it, or choose --sandbox auto ...").  Its line
#: breaks become spaces, so the event stays one line.
CONSOLE_WHOLE_KEYS = frozenset({"error"})

#: How much of C{repr(fields)} a reduced record keeps.
UNENCODABLE_LIMIT = 2000

_LEVEL_NAMES: dict[object, str] = {
    LogLevel.debug: "DEBUG",
    LogLevel.info: "INFO",
    LogLevel.warn: "WARNING",
    LogLevel.error: "ERROR",
    LogLevel.critical: "CRITICAL",
}

_FINISH_LEVELS: dict[str, LogLevel] = {
    "completed": LogLevel.info,
    "program_failed": LogLevel.info,
    "timeout": LogLevel.warn,
    "crashed": LogLevel.error,
    "no_worker": LogLevel.warn,
    "rejected": LogLevel.warn,
    "cache_miss": LogLevel.info,
    "server_error": LogLevel.error,
}

_RETIRE_LEVELS: dict[str, LogLevel] = {
    "request_limit": LogLevel.info,
    "poisoned_context": LogLevel.warn,
    "sandbox_cleanup": LogLevel.warn,
    "timeout": LogLevel.warn,
    "crashed": LogLevel.error,
}

_HEADER_KEYS = ("timestamp", "level", "event")

_INFO: LogLevel = LogLevel.info
_WARN: LogLevel = LogLevel.warn

# twisted.python.logfile is untyped.
_LogFile: Any = LogFile


def event_level_for_finish_reason(reason: str) -> LogLevel:
    """
    The level of a C{request_finished} event (spec section 8.4).

    @param reason: the event's C{finish_reason}.
    @return: C{info} for C{completed}, C{program_failed}, C{cache_miss} and
        anything unknown (such as C{invalid_request}); C{warn} for
        C{timeout}, C{no_worker} and C{rejected}; C{error} for C{crashed} and
        C{server_error}.
    """
    return _FINISH_LEVELS.get(reason, _INFO)


def event_level_for_retire_reason(reason: str) -> LogLevel:
    """
    The level of a C{worker_retired} event (spec section 8.4).

    @param reason: the event's C{reason}.
    @return: C{info} for C{request_limit}; C{warn} for C{poisoned_context},
        C{sandbox_cleanup}, C{timeout} and any reason the spec does not
        name; C{error} for C{crashed}.
    """
    return _RETIRE_LEVELS.get(reason, _WARN)


def is_kcoral_event(event: Mapping[str, Any]) -> bool:
    """
    Whether C{event} is an operator-visible event (it carries C{kcoral_event}).
    """
    return event.get(EVENT_KEY) is not None


def level_name(level: object) -> str:
    """
    The record's C{level} text for a L{LogLevel}: C{DEBUG}, C{INFO},
    C{WARNING}, C{ERROR} or C{CRITICAL} (C{INFO} when the event has none).
    """
    if level is None:
        return "INFO"
    name = _LEVEL_NAMES.get(level)
    if name is not None:
        return name
    return str(getattr(level, "name", level)).upper()


def format_timestamp(log_time: float | None) -> str:
    """
    Format a POSIX time as UTC ISO-8601 with milliseconds and C{Z}, e.g.
    C{2026-08-29T18:42:11.019Z}.

    @param log_time: seconds since the epoch (an event's C{log_time});
        C{None} uses the current time.
    """
    if log_time is None:
        log_time = datetime.now(timezone.utc).timestamp()
    # Rounded to the microsecond as datetime.fromtimestamp does, then cut.
    second = math.floor(log_time)
    micros = round((log_time - second) * 1e6)
    if micros >= 1_000_000:
        second, micros = second + 1, 0
    millis = micros // 1000
    cached = _second_prefix
    if cached[0] != second:
        # One strftime a second, not one an event: events come in dozens a request.
        moment = datetime.fromtimestamp(second, timezone.utc)
        cached = (second, moment.strftime("%Y-%m-%dT%H:%M:%S."))
        _set_second_prefix(cached)
    return f"{cached[1]}{millis:03d}Z"


_second_prefix: tuple[float, str] = (math.nan, "")


def _set_second_prefix(value: tuple[float, str]) -> None:
    global _second_prefix
    _second_prefix = value


def _is_legacy_artifact(key: str, value: Any, event: Mapping[str, Any]) -> bool:
    # LegacyLogObserverWrapper (twistd, log.startLogging) edits the event dict
    # in place before later observers see it; leave its additions out.
    if key == "isError":
        return True
    if key == "format":
        return bool(value == "%(log_legacy)s" or "log_format" in event)
    if key == "message":
        return bool(value == ())
    if key == "time":
        return bool(value == event.get("log_time"))
    if key == "system":
        return bool(value == event.get("log_system", "-"))
    if key in ("failure", "why"):
        return "log_failure" in event
    return False


def event_fields(event: Mapping[str, Any]) -> dict[str, Any]:
    """
    The catalogue fields of a kcoral event, in the order they were passed.

    Twisted's own C{log_*} keys, C{kcoral_event} and the keys a legacy
    observer may have added are left out.
    """
    return {
        key: value
        for key, value in event.items()
        if not key.startswith("log_")
        and key != EVENT_KEY
        and not _is_legacy_artifact(key, value, event)
    }


def _below(level: object, minimum: LogLevel) -> bool:
    try:
        return level is not None and bool(level < minimum)
    except TypeError:
        return False


def _json_default(value: object) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)


def _encode(record: Mapping[str, Any]) -> str:
    return json.dumps(
        record,
        ensure_ascii=False,
        allow_nan=False,
        separators=(",", ":"),
        default=_json_default,
    )


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception as e:  # a broken __repr__ must not lose the record
        return f"<unrepresentable {type(value).__name__}: {type(e).__name__}>"


#: Events after which a L{BackgroundWriter}'s lines are written at once:
#: a request's lines are on disk before its answer goes out.
SYNC_EVENTS = frozenset({"request_finished"})


def _sync(stream: object, event: Mapping[str, Any]) -> None:
    """Write C{stream}'s gathered lines now after a request's last event or a warning."""
    sync = getattr(stream, "sync", None)
    if sync is None:
        return
    level = event.get("log_level")
    if event.get(EVENT_KEY) in SYNC_EVENTS or (
        level is not None and not _below(level, LogLevel.warn)
    ):
        sync()


def _is_binary(stream: object) -> bool:
    wrapped = getattr(stream, "wrapped", None)
    if wrapped is not None:
        return _is_binary(wrapped)
    if isinstance(stream, (BaseLogFile, io.RawIOBase, io.BufferedIOBase)):
        return True
    mode = getattr(stream, "mode", None)
    return isinstance(mode, str) and "b" in mode


class _LineObserver:
    """
    What both kcoral observers do with an event: skip it unless it is a
    kcoral event at C{min_level} or above, write its line (L{_line}) in one
    C{write} call, flush, and sync after a request's last event
    (L{SYNC_EVENTS}); anything that goes wrong while writing is ignored:
    logging never fails a request.
    """

    #: A text or binary stream, or a L{BackgroundWriter} in front of one
    #: (each subclass says which it takes).
    stream: Any
    min_level: LogLevel

    def _line(self, event: Mapping[str, Any]) -> str | bytes:
        """The line (with its newline) that C{event} is written as."""
        raise NotImplementedError

    def __call__(self, event: dict[str, Any]) -> None:
        if not is_kcoral_event(event):
            return
        if _below(event.get("log_level"), self.min_level):
            return
        try:
            self.stream.write(self._line(event))
            self.stream.flush()
            _sync(self.stream, event)
        except Exception:
            # Disk full, closed file, ...: never let logging fail the caller.
            pass


@implementer(ILogObserver)
class JsonEventObserver(_LineObserver):
    """
    Write each kcoral event as one compact JSON line (spec section 8.2).

    A record is C{timestamp}, C{level}, C{event}, then the event's fields.
    Paths become strings and other non-JSON objects their C{repr}.  If the
    record still cannot be encoded (NaN, a non-string key, a cycle) a reduced
    record with C{unencodable_fields} is written instead.  Events without
    C{kcoral_event} are ignored, and so is anything that goes wrong while
    writing: logging never fails a request.

    @ivar stream: where lines go; a text or binary file-like object, usually
        a rotating L{LogFile}, or a L{BackgroundWriter} in front of one.
        Each line is written with one C{write} call and flushed (a
        L{BackgroundWriter} gathers them, see L{SYNC_EVENTS}).
    @ivar min_level: events below this level are not written (they may
        still feed C{/metrics}); C{LogLevel.info} unless given.
    """

    def __init__(self, stream: IO[Any] | BaseLogFile, *, min_level: LogLevel = LogLevel.info):
        self.stream = stream
        self.min_level = min_level
        self._binary = _is_binary(stream)

    def record(self, event: Mapping[str, Any]) -> str:
        """
        Render the JSON line (without its newline) for a kcoral event.
        """
        header = {
            "timestamp": format_timestamp(event.get("log_time")),
            "level": level_name(event.get("log_level")),
            "event": event[EVENT_KEY],
        }
        fields = event_fields(event)
        record = dict(header)
        for key, value in fields.items():
            # A field cannot replace the header; keep it under another name.
            record["field_" + key if key in _HEADER_KEYS else key] = value
        try:
            return _encode(record)
        except Exception:
            reduced = dict(header)
            if not isinstance(reduced["event"], str):
                reduced["event"] = _safe_repr(reduced["event"])
            reduced["unencodable_fields"] = _safe_repr(fields)[:UNENCODABLE_LIMIT]
            return _encode(reduced)

    def _line(self, event: Mapping[str, Any]) -> str | bytes:
        line = self.record(event) + "\n"
        return line.encode("utf-8") if self._binary else line


def _console_value(value: Any, whole: bool = False) -> str:
    if isinstance(value, float):
        text = f"{value:.1f}"
    else:
        text = str(value)
    if whole:
        return " ".join(text.splitlines())
    if len(text) > CONSOLE_VALUE_LIMIT:
        text = text[:CONSOLE_VALUE_LIMIT] + "..."
    return text


@implementer(ILogObserver)
class ConsoleObserver(_LineObserver):
    """
    Mirror kcoral events on the console (spec section 8.3)::

        2026-08-29T18:42:11.019Z INFO    pool_ready sandbox=bubblewrap mode=gpu workers=8

    C{traceback}, C{versions}, C{config}, C{ops}, C{uploads} and fields whose
    value is C{None} are skipped; floats print with one decimal; a value
    longer than 120 characters is cut and followed by C{...}, except an
    C{error} (L{CONSOLE_WHOLE_KEYS}), shown whole on one line.  Each line is
    flushed (through a L{BackgroundWriter}, gathered as for the events
    file).  Write errors are ignored.

    @ivar stream: a text stream; the process's original stderr
        (C{sys.__stderr__}) by default, which stays the terminal even when
        a log beginner redirects C{sys.stderr} into the log system.
    """

    def __init__(
        self, stream: IO[str] | None = None, *, min_level: LogLevel = LogLevel.info
    ) -> None:
        if stream is None:
            stream = sys.__stderr__ if sys.__stderr__ is not None else sys.stderr
        self.stream = stream
        self.min_level = min_level

    @staticmethod
    def format(event: Mapping[str, Any]) -> str:
        """
        Render the console line (without its newline) for a kcoral event.
        """
        parts = [
            format_timestamp(event.get("log_time")),
            f"{level_name(event.get('log_level')):<7}",
            str(event[EVENT_KEY]),
        ]
        for key, value in event_fields(event).items():
            if key in CONSOLE_SKIPPED_KEYS or value is None:
                continue
            parts.append(f"{key}={_console_value(value, key in CONSOLE_WHOLE_KEYS)}")
        return " ".join(parts)

    def _line(self, event: Mapping[str, Any]) -> str | bytes:
        return self.format(event) + "\n"


def _not_kcoral(event: Mapping[str, Any]) -> object:
    """A L{PredicateResult}: Twisted's text observer leaves kcoral events to ours."""
    return PredicateResult.no if is_kcoral_event(event) else PredicateResult.maybe


def twisted_console_observer(stream: IO[str], level: LogLevel = LogLevel.warn) -> ILogObserver:
    """
    An observer that shows Twisted's own events (not kcoral events) at
    C{level} or above as text, so tracebacks from C{log.failure} and
    unhandled errors in Deferreds still reach the console.
    """
    predicate = LogLevelFilterPredicate(defaultLogLevel=level)
    text = textFileLogObserver(stream)
    # A plain function is a predicate too (FilteringLogObserver calls it).
    predicates: list[Any] = [_not_kcoral, predicate]
    return FilteringLogObserver(text, predicates)


class LogDirectoryError(OSError):
    """
    The log directory cannot be created; the message names the path that
    failed and why, for the operator reading the console.
    """

    def __init__(self, log_dir: str | os.PathLike[str], cause: OSError) -> None:
        where = os.fspath(log_dir)
        reason = cause.strerror or str(cause)
        if cause.filename is not None and os.fspath(cause.filename) != where:
            reason = f"{reason} ({os.fspath(cause.filename)})"
        super().__init__(cause.errno, f"cannot create the log directory {where}: {reason}")

    def __str__(self) -> str:
        return str(self.strerror)


@attrs.frozen
class RunDirectory:
    """
    The directory of one server run: C{<log_dir>/runs/<UTC start time>/}.

    @ivar path: the run directory (absolute).
    @ivar events_path: C{events.jsonl} inside it (created by the observer).
    @ivar programs_dir: C{programs/} inside it.
    """

    path: Path
    events_path: Path
    programs_dir: Path

    @staticmethod
    def name_for(now: datetime) -> str:
        """
        The run directory name for a start time: C{YYYYMMDDTHHMMSS.ffffffZ}
        in UTC.  A naive C{now} is taken to be UTC already.
        """
        if now.tzinfo is not None:
            now = now.astimezone(timezone.utc)
        return now.strftime("%Y%m%dT%H%M%S.%fZ")

    @classmethod
    def create(
        cls, log_dir: str | os.PathLike[str], now: datetime, *, programs: bool = True
    ) -> RunDirectory:
        """
        Create the run directory.  BLOCKING: call it once, at startup.

        C{log_dir} is C{~}-expanded and made absolute and C{runs/} is created
        as needed.  If the name is taken, C{-1}, C{-2}, ... is appended.

        @param log_dir: the configured log directory.
        @param now: the server's start time.
        @param programs: create C{programs/} as well.
        @raise OSError: when the directory cannot be created.
        """
        base = Path(log_dir).expanduser().absolute()
        runs = base / "runs"
        runs.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = cls.name_for(now)
        suffix = 0
        while True:
            path = runs / (name if suffix == 0 else f"{name}-{suffix}")
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:
                suffix += 1
                continue
            break
        programs_dir = path / "programs"
        if programs:
            programs_dir.mkdir(mode=0o700)
        return cls(path=path, events_path=path / "events.jsonl", programs_dir=programs_dir)


#: Programs saved under one request id at most (C{<id>.json}, C{<id>.2.json},
#: ...); past it, more requests with that id are not saved.
SAVED_PROGRAM_COPIES = 100


@attrs.define
class ProgramRecorder:
    """
    Save the raw C{program} part of each accepted request as
    C{programs/<request_id>.json}.

    @ivar programs_dir: the run's C{programs/} directory.
    """

    programs_dir: Path = attrs.field(converter=Path)

    @staticmethod
    def file_name(request_id: str) -> str | None:
        """
        The file name for C{request_id}, or C{None} when the id could escape
        the directory (a separator, NUL, C{.} or C{..}, empty).
        """
        if not isinstance(request_id, str) or not request_id:
            return None
        if any(c in request_id for c in ("/", "\\", "\0")) or request_id in (".", ".."):
            return None
        return f"{request_id}.json"

    def save(self, request_id: str, program_bytes: bytes) -> str | None:
        """
        Write the program.  BLOCKING: the server calls it in a thread.

        The bytes go to a temporary file that is then linked to its name,
        so a reader never sees half a program, and a saved program is
        never replaced: a request id is the client's to choose, so a client
        that reuses another's (they are on C{/status.json}) gets its program
        saved as C{<request_id>.2.json} (then C{.3}, ...) beside the
        other's.

        @return: the file name (C{<request_id>.json}, or a numbered one) for
            the C{request_accepted} event's C{program} field, or C{None}
            when the id is refused or the write failed.
        """
        name = self.file_name(request_id)
        if name is None:
            return None
        temporary = self.programs_dir / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.programs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Programs are the clients' code: readable by the server's user only.
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(program_bytes)
            for number in range(1, SAVED_PROGRAM_COPIES + 1):
                saved = name if number == 1 else f"{request_id}.{number}.json"
                try:
                    os.link(temporary, self.programs_dir / saved)
                except FileExistsError:
                    continue
                return saved
            return None
        except Exception:
            return None
        finally:
            try:
                temporary.unlink()
            except OSError:
                pass


class LogSettings(Protocol):
    """
    What L{install_observers} reads of a configuration: a server's
    L{ServerConfig}, or the gateway's L{kcoral.gateway.service.GatewayConfig}.
    """

    @property
    def log_dir(self) -> Path | None: ...

    @property
    def log_console(self) -> bool: ...

    @property
    def log_programs(self) -> bool: ...

    @property
    def log_level(self) -> str: ...


@attrs.define
class LogSetup:
    """
    What L{install_observers} installed.

    @ivar run_dir: the run directory, or C{None} without file logging.
    @ivar recorder: saves programs, or C{None} when programs are not saved.
    @ivar observers: every observer added to C{publisher}, in order.
    @ivar publisher: the publisher they were added to.
    @ivar events_file: the rotating C{events.jsonl}, or C{None}.
    """

    run_dir: RunDirectory | None
    recorder: ProgramRecorder | None
    observers: list[ILogObserver]
    publisher: LogPublisher
    events_file: LogFile | None = None
    writers: list[BackgroundWriter] = attrs.Factory(list)
    _closed: bool = False

    def close(self) -> None:
        """
        Remove the observers and close the events file.  Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for observer in self.observers:
            self.publisher.removeObserver(observer)
        for writer in self.writers:
            writer.close()
        if self.events_file is not None:
            try:
                self.events_file.close()
            except Exception:
                pass


def install_observers(
    config: LogSettings,
    *,
    publisher: LogPublisher | None = None,
    log_beginner: LogBeginner | None = None,
    now: datetime | None = None,
    console_stream: IO[str] | None = None,
    rotate_length: int = DEFAULT_ROTATE_LENGTH,
    max_rotated_files: int = DEFAULT_MAX_ROTATED_FILES,
    extra_observers: Iterable[ILogObserver] = (),
    background: bool = False,
) -> LogSetup:
    """
    Create the run directory and add the observers the configuration asks
    for.  BLOCKING (directory creation, opening C{events.jsonl}): call it
    once at startup, before the HTTP port is bound.

      - C{config.log_dir} set: a L{RunDirectory} and a L{JsonEventObserver}
        writing a L{LogFile} rotated at C{rotate_length} bytes, keeping
        C{max_rotated_files} old files; and, when C{config.log_programs}, a
        L{ProgramRecorder}.  C{log_dir=None}: nothing touches the disk.
      - C{config.log_console}: a L{ConsoleObserver} and a text observer for
        Twisted's own events at warning level or above.
      - C{extra_observers} (for instance L{kcoral.server.observe.metrics.Metrics} and
        L{kcoral.server.observe.status.RecentRequests}) are added after those, so
        L{LogSetup.close} removes them too.

    @param config: its L{LogSettings} (a L{kcoral.config.ServerConfig}, or
        the gateway's config): events
        below C{log_level} are neither written nor mirrored.
    @param publisher: where observers are added and later removed;
        L{globalLogPublisher} by default.
    @param log_beginner: when given (a plain process outside twistd), its
        C{beginLoggingTo} is called with the observers, which ends its
        startup buffering and replays buffered events; C{publisher} must then
        be that beginner's publisher.  Under twistd leave it out.
    @param now: the start time naming the run directory; the current UTC
        time by default.
    @param console_stream: the console; the original stderr by default.
    @param rotate_length: size in bytes at which C{events.jsonl} rotates.
    @param max_rotated_files: rotated files kept.
    @param extra_observers: more observers to add and remove with these.
    @param background: write C{events.jsonl} and the console through
        L{BackgroundWriter}s, so the reactor only queues lines (the server
        does; tests that read what was written at once leave it off).
    @raise LogDirectoryError: when the run directory cannot be created.
    """
    if publisher is None:
        publisher = globalLogPublisher
    level = LogLevel.levelWithName(config.log_level)
    observers: list[ILogObserver] = []
    writers: list[BackgroundWriter] = []
    run_dir = None
    recorder = None
    events_file = None
    if config.log_dir is not None:
        try:
            run_dir = RunDirectory.create(
                config.log_dir,
                now if now is not None else datetime.now(timezone.utc),
                programs=bool(config.log_programs),
            )
        except OSError as e:
            raise LogDirectoryError(config.log_dir, e) from e
        events_file = _LogFile(
            run_dir.events_path.name,
            str(run_dir.path),
            rotateLength=rotate_length,
            maxRotatedFiles=max_rotated_files,
            defaultMode=0o600,
        )
        events_stream: Any = events_file
        if background:
            events_stream = BackgroundWriter(events_file, "kcoral-events-writer")
            writers.append(events_stream)
        observers.append(JsonEventObserver(events_stream, min_level=level))
        if config.log_programs:
            recorder = ProgramRecorder(run_dir.programs_dir)
    if config.log_console:
        console = ConsoleObserver(console_stream, min_level=level)
        if background:
            console.stream = BackgroundWriter(console.stream, "kcoral-console-writer")
            writers.append(console.stream)
        observers.append(console)
        # Twisted's own events: warnings and worse, or fewer at a higher level.
        twisted_level = max(level, LogLevel.warn)
        observers.append(twisted_console_observer(console.stream, twisted_level))
    observers.extend(extra_observers)
    if log_beginner is not None:
        log_beginner.beginLoggingTo(observers, redirectStandardIO=False)
    else:
        for observer in observers:
            publisher.addObserver(observer)
    return LogSetup(
        run_dir=run_dir,
        recorder=recorder,
        observers=observers,
        publisher=publisher,
        events_file=events_file,
        writers=writers,
    )
