"""
Tests for L{kcoral.server.observe.logs}.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import attrs
from twisted.logger import Logger, LogLevel, LogPublisher
from twisted.python.logfile import LogFile
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.observe.logs import (
    ConsoleObserver,
    JsonEventObserver,
    LogDirectoryError,
    ProgramRecorder,
    RunDirectory,
    event_level_for_finish_reason,
    event_level_for_retire_reason,
    format_timestamp,
    install_observers,
)

# 2026-08-29T18:42:11.019512Z
LOG_TIME = datetime(2026, 8, 29, 18, 42, 11, 19512, tzinfo=timezone.utc).timestamp()


def kcoral_event(name: str, level: LogLevel = LogLevel.info, /, **fields: Any) -> dict[str, Any]:
    """
    Build an event the way L{Logger.emit} does: fields first, then Twisted's
    own C{log_*} keys.
    """
    event: dict[str, Any] = dict(fields)
    event["kcoral_event"] = name
    event.update(
        log_format="{kcoral_event}",
        log_level=level,
        log_namespace="kcoral.test",
        log_source=None,
        log_time=LOG_TIME,
    )
    return event


def temp_dir(case: SynchronousTestCase) -> Path:
    """
    A fresh directory removed after the test.
    """
    path = Path(tempfile.mkdtemp(prefix="kcoral-test-logs-"))
    case.addCleanup(shutil.rmtree, path, True)
    return path


class Unrepresentable:
    """
    An object whose C{repr} fails.
    """

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class BrokenStream:
    """
    A stream whose writes fail.
    """

    def write(self, data: object) -> None:
        raise OSError("disk full")

    def flush(self) -> None:
        raise OSError("disk full")


class TimestampTests(SynchronousTestCase):
    """
    Tests for L{format_timestamp}.
    """

    def test_milliseconds_and_z(self) -> None:
        """
        Timestamps are UTC ISO-8601 with milliseconds (truncated) and C{Z}.
        """
        self.assertEqual(format_timestamp(LOG_TIME), "2026-08-29T18:42:11.019Z")

    def test_current_time(self) -> None:
        """
        Without a time, the current time is formatted the same way.
        """
        self.assertRegex(format_timestamp(None), r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class JsonEventObserverTests(SynchronousTestCase):
    """
    Tests for L{JsonEventObserver}.
    """

    def lines(self, *events: dict[str, Any], **kwargs: Any) -> list[str]:
        """
        Feed C{events} to an observer writing to a text buffer and return
        the lines written.
        """
        stream = io.StringIO()
        observer = JsonEventObserver(stream, **kwargs)
        for event in events:
            observer(event)
        text = stream.getvalue()
        self.assertTrue(text == "" or text.endswith("\n"))
        return text.splitlines()

    def test_record_format(self) -> None:
        """
        A record is compact JSON with C{timestamp}, C{level} and C{event}
        first, then the fields in the order they were passed; Twisted's own
        keys and C{kcoral_event} are left out and C{None} becomes C{null}.
        """
        [line] = self.lines(
            kcoral_event("request_received", request_id="r1", client=None, content_length="12")
        )
        self.assertEqual(
            line,
            '{"timestamp":"2026-08-29T18:42:11.019Z","level":"INFO",'
            '"event":"request_received","request_id":"r1","client":null,'
            '"content_length":"12"}',
        )

    def test_level_names(self) -> None:
        """
        Twisted log levels map to C{DEBUG}, C{INFO}, C{WARNING}, C{ERROR} and
        C{CRITICAL}.
        """
        lines = self.lines(
            *(kcoral_event("e", level) for level in LogLevel.iterconstants()),
            min_level=LogLevel.debug,
        )
        self.assertEqual(
            [json.loads(line)["level"] for line in lines],
            ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        )

    def test_min_level(self) -> None:
        """
        Events below C{min_level} (C{info} by default) are not written.
        """
        self.assertEqual(self.lines(kcoral_event("cache_hit", LogLevel.debug)), [])

    def test_only_kcoral_events(self) -> None:
        """
        Events without C{kcoral_event} are ignored.
        """
        plain = kcoral_event("x")
        del plain["kcoral_event"]
        self.assertEqual(self.lines(plain), [])

    def test_through_logger(self) -> None:
        """
        Events emitted with a real L{Logger} are written, with the format
        string's own fields only once.
        """
        stream = io.StringIO()
        publisher = LogPublisher(JsonEventObserver(stream))
        log = Logger(namespace="kcoral.test", observer=publisher)
        log.warn("worker {worker_id} retired", kcoral_event="worker_retired", worker_id="gpu0/w1")
        log.info("not for the file")
        [line] = stream.getvalue().splitlines()
        record = json.loads(line)
        self.assertEqual(list(record), ["timestamp", "level", "event", "worker_id"])
        self.assertEqual(record["level"], "WARNING")
        self.assertEqual(record["worker_id"], "gpu0/w1")

    def test_non_ascii_kept(self) -> None:
        """
        Non-ASCII text is written as UTF-8, not escaped.
        """
        [line] = self.lines(kcoral_event("e", error_message="ошибка ✓"))
        self.assertIn("ошибка ✓", line)

    def test_binary_stream_utf8(self) -> None:
        """
        A binary stream receives UTF-8 bytes.
        """
        stream = io.BytesIO()
        JsonEventObserver(stream)(kcoral_event("e", error_message="é"))
        self.assertIn("é".encode(), stream.getvalue())
        self.assertEqual(json.loads(stream.getvalue())["error_message"], "é")

    def test_repr_fallback(self) -> None:
        """
        Paths become strings and other objects their C{repr}.
        """

        class Thing:
            def __repr__(self) -> str:
                return "<thing>"

        [line] = self.lines(
            kcoral_event("e", run_dir=Path("/var/log/k"), thing=Thing(), data=b"\x00")
        )
        record = json.loads(line)
        self.assertEqual(record["run_dir"], "/var/log/k")
        self.assertEqual(record["thing"], "<thing>")
        self.assertEqual(record["data"], "b'\\x00'")

    def test_unencodable_reduced_record(self) -> None:
        """
        A record that cannot be encoded (NaN is forbidden) becomes the
        reduced record: header plus C{unencodable_fields}, the repr of the
        fields cut to 2000 characters.
        """
        [line] = self.lines(
            kcoral_event("request_finished", LogLevel.error, elapsed_ms=float("nan"), x="y" * 5000)
        )
        self.assertNotIn("NaN", line.split('"unencodable_fields"')[0])
        record = json.loads(line)
        self.assertEqual(list(record), ["timestamp", "level", "event", "unencodable_fields"])
        self.assertEqual(record["level"], "ERROR")
        self.assertEqual(record["event"], "request_finished")
        self.assertTrue(record["unencodable_fields"].startswith("{'elapsed_ms': nan"))
        self.assertEqual(len(record["unencodable_fields"]), 2000)

    def test_unencodable_keys(self) -> None:
        """
        Non-string dictionary keys and a failing C{repr} also give a reduced
        record instead of an exception.
        """
        lines = self.lines(
            kcoral_event("a", ops={("x", 1): 2}),
            kcoral_event("b", ops={("x", 1): Unrepresentable()}),
        )
        self.assertEqual([json.loads(line)["event"] for line in lines], ["a", "b"])
        self.assertIn("unencodable_fields", json.loads(lines[1]))

    def test_header_not_overridden(self) -> None:
        """
        A field named like a header key cannot replace the header.
        """
        [line] = self.lines(kcoral_event("e", level="x"))
        record = json.loads(line)
        self.assertEqual(record["level"], "INFO")
        self.assertEqual(record["field_level"], "x")

    def test_legacy_artifacts_dropped(self) -> None:
        """
        Keys a legacy observer adds in place (C{isError}, C{format}, ...)
        are not written, but a real C{message} field is.
        """
        event = kcoral_event("sandbox_disabled", message="bwrap missing")
        event.update(isError=0, format="%(log_legacy)s", time=LOG_TIME, system="-")
        record = json.loads(self.lines(event)[0])
        self.assertEqual(list(record), ["timestamp", "level", "event", "message"])

    def test_write_errors_swallowed(self) -> None:
        """
        A failing stream does not make the observer raise.
        """
        JsonEventObserver(BrokenStream())(kcoral_event("e"))

    def test_flush_per_line(self) -> None:
        """
        The stream is flushed after every line.
        """
        flushes = []

        class Stream(io.StringIO):
            def flush(self) -> None:
                flushes.append(self.getvalue())

        JsonEventObserver(Stream())(kcoral_event("e"))
        self.assertEqual(len(flushes), 1)
        self.assertTrue(flushes[0].endswith("\n"))

    def test_rotation(self) -> None:
        """
        Writing through a L{LogFile} rotates C{events.jsonl} at the
        configured size and keeps at most C{maxRotatedFiles} old files; every
        file holds whole lines.
        """
        directory = temp_dir(self)
        log_file = LogFile("events.jsonl", str(directory), rotateLength=1000, maxRotatedFiles=2)
        self.addCleanup(log_file.close)
        observer = JsonEventObserver(log_file)
        for i in range(100):
            observer(kcoral_event("request_finished", request_id=f"r{i:03d}", pad="é" * 20))
        names = sorted(p.name for p in directory.iterdir())
        self.assertEqual(names, ["events.jsonl", "events.jsonl.1", "events.jsonl.2"])
        line_length = len(
            JsonEventObserver(io.StringIO())
            .record(kcoral_event("request_finished", request_id="r000", pad="é" * 20))
            .encode()
        )
        for name in names:
            data = (directory / name).read_bytes()
            self.assertLess(len(data), 1000 + line_length + 1)
            for line in data.decode().splitlines():
                json.loads(line)
        last = (directory / "events.jsonl").read_text().splitlines()[-1]
        self.assertEqual(json.loads(last)["request_id"], "r099")


class ConsoleObserverTests(SynchronousTestCase):
    """
    Tests for L{ConsoleObserver}.
    """

    def line(self, event: dict[str, Any]) -> str:
        """
        The console text for C{event}.
        """
        stream = io.StringIO()
        ConsoleObserver(stream)(event)
        return stream.getvalue()

    def test_format(self) -> None:
        """
        C{<timestamp> <LEVEL padded to 7> <event> key=value ...}, values with
        C{str()}.
        """
        self.assertEqual(
            self.line(
                kcoral_event(
                    "pool_ready",
                    sandbox="bubblewrap",
                    mode="gpu",
                    target={"arch": "sm_100a"},
                    versions={"cuda": "12"},
                    workers=8,
                )
            ),
            "2026-08-29T18:42:11.019Z INFO    pool_ready sandbox=bubblewrap mode=gpu "
            "target={'arch': 'sm_100a'} workers=8\n",
        )

    def test_level_padding(self) -> None:
        """
        Levels are left-aligned in 7 characters.
        """
        self.assertIn(" WARNING timeout", self.line(kcoral_event("timeout", LogLevel.warn)))
        self.assertIn(" ERROR   crashed", self.line(kcoral_event("crashed", LogLevel.error)))

    def test_skips(self) -> None:
        """
        C{traceback}, C{versions}, C{config}, C{ops}, C{uploads} and C{None}
        values are not shown.
        """
        line = self.line(
            kcoral_event(
                "e",
                traceback="tb",
                versions={},
                config={},
                ops={},
                uploads={},
                client=None,
                kept=0,
            )
        )
        self.assertEqual(line, "2026-08-29T18:42:11.019Z INFO    e kept=0\n")

    def test_float_and_truncation(self) -> None:
        """
        Floats print with one decimal; values longer than 120 characters are
        cut to 120 and followed by C{...}.
        """
        line = self.line(kcoral_event("e", queue_ms=12.345, output_tail="x" * 200, short="y" * 120))
        self.assertIn(" queue_ms=12.3 ", line)
        self.assertIn(" output_tail=" + "x" * 120 + "... ", line)
        self.assertIn(" short=" + "y" * 120 + "\n", line)

    def test_error_shown_whole(self) -> None:
        """
        An C{error} is never cut (its remedy comes last), and its line
        breaks become spaces: the event stays one line.
        """
        error = "SandboxError: --sandbox bubblewrap: bubblewrap cannot run (" + "e" * 200
        error += "\nbwrap: setting up uid map: Permission denied); fix it, or choose "
        error += "--sandbox auto to fall back to no sandbox"
        line = self.line(kcoral_event("server_start_failed", error=error, other="z" * 200))
        self.assertIn(" error=" + error.replace("\n", " ") + " ", line)
        self.assertIn(" other=" + "z" * 120 + "...\n", line)
        self.assertEqual(line.count("\n"), 1)

    def test_only_kcoral_events(self) -> None:
        """
        Events without C{kcoral_event} are not mirrored.
        """
        event = kcoral_event("e")
        del event["kcoral_event"]
        self.assertEqual(self.line(event), "")

    def test_write_errors_swallowed(self) -> None:
        """
        A failing console does not make the observer raise.
        """
        ConsoleObserver(BrokenStream())(kcoral_event("e"))  # type: ignore[arg-type]


class RunDirectoryTests(SynchronousTestCase):
    """
    Tests for L{RunDirectory}.
    """

    def test_name_and_layout(self) -> None:
        """
        The run directory is C{<log_dir>/runs/YYYYMMDDTHHMMSS.ffffffZ} in
        UTC, with C{programs/} and an C{events.jsonl} path.
        """
        base = temp_dir(self)
        now = datetime(2026, 8, 29, 20, 42, 11, 19012, tzinfo=timezone(timedelta(hours=2)))
        run = RunDirectory.create(base / "logs", now)
        self.assertEqual(run.path, base / "logs" / "runs" / "20260829T184211.019012Z")
        self.assertTrue(run.path.is_dir())
        self.assertTrue(run.programs_dir.is_dir())
        self.assertEqual(run.events_path, run.path / "events.jsonl")

    def test_collision_suffix(self) -> None:
        """
        A taken name gets C{-1}, C{-2}, ...
        """
        base = temp_dir(self)
        now = datetime(2026, 8, 29, 18, 42, 11, 19012)
        names = [RunDirectory.create(base, now).path.name for _ in range(3)]
        self.assertEqual(
            names,
            ["20260829T184211.019012Z", "20260829T184211.019012Z-1", "20260829T184211.019012Z-2"],
        )

    def test_home_expanded_absolute(self) -> None:
        """
        C{~} is expanded and a relative directory made absolute.
        """
        base = temp_dir(self)
        old_home = os.environ.get("HOME")
        os.environ["HOME"] = str(base)
        self.addCleanup(
            lambda: (
                os.environ.__setitem__("HOME", old_home)
                if old_home is not None
                else os.environ.pop("HOME", None)
            )
        )
        run = RunDirectory.create("~/logs", datetime(2026, 1, 1))
        self.assertTrue(run.path.is_absolute())
        self.assertEqual(run.path.parent, base / "logs" / "runs")

        cwd = os.getcwd()
        os.chdir(base)
        self.addCleanup(os.chdir, cwd)
        run = RunDirectory.create("rel", datetime(2026, 1, 1))
        self.assertEqual(run.path.parent.parent, Path(os.getcwd()) / "rel")


class ProgramRecorderTests(SynchronousTestCase):
    """
    Tests for L{ProgramRecorder}.
    """

    def test_save(self) -> None:
        """
        The program's raw bytes are saved as C{<request_id>.json} and the
        file name is returned; no temporary file remains.
        """
        directory = temp_dir(self)
        recorder = ProgramRecorder(directory)
        request_id = "7d3e6f0e-8a43-4b7e-9a55-1f6c1f8f1a2b"
        program = b'{"instructions":[]}'
        self.assertEqual(recorder.save(request_id, program), f"{request_id}.json")
        self.assertEqual((directory / f"{request_id}.json").read_bytes(), program)
        self.assertEqual([p.name for p in directory.iterdir()], [f"{request_id}.json"])

    def test_reused_id_never_overwrites(self) -> None:
        """
        A second program under a request id already saved (another client
        reusing it) is saved beside the first, as C{<id>.2.json}, then
        C{.3}: the first stays as it was (issue 32).
        """
        directory = temp_dir(self)
        recorder = ProgramRecorder(directory)
        request_id = "7d3e6f0e-8a43-4b7e-9a55-1f6c1f8f1a2b"
        self.assertEqual(recorder.save(request_id, b"victim"), f"{request_id}.json")
        self.assertEqual(recorder.save(request_id, b"other"), f"{request_id}.2.json")
        self.assertEqual(recorder.save(request_id, b"third"), f"{request_id}.3.json")
        self.assertEqual((directory / f"{request_id}.json").read_bytes(), b"victim")
        self.assertEqual((directory / f"{request_id}.2.json").read_bytes(), b"other")
        self.assertEqual(len(list(directory.iterdir())), 3)

    def test_refuses_bad_ids(self) -> None:
        """
        Ids that could leave the directory are refused with C{None}.
        """
        directory = temp_dir(self)
        recorder = ProgramRecorder(directory / "programs")
        for bad in ["../x", "a/b", "/abs", "..", ".", "", "a\0b", "a\\b"]:
            self.assertIsNone(recorder.save(bad, b"{}"), bad)
        self.assertFalse((directory / "x.json").exists())
        self.assertEqual(list(directory.rglob("*.json")), [])

    def test_write_failure(self) -> None:
        """
        A failed write returns C{None} instead of raising.
        """
        directory = temp_dir(self)
        blocker = directory / "file"
        blocker.write_bytes(b"")
        self.assertIsNone(ProgramRecorder(blocker / "programs").save("r1", b"{}"))


class LevelTableTests(SynchronousTestCase):
    """
    Tests for the spec's level tables.
    """

    def test_finish_reasons(self) -> None:
        """
        C{request_finished} levels follow the finish reason.
        """
        expected = {
            "completed": LogLevel.info,
            "program_failed": LogLevel.info,
            "timeout": LogLevel.warn,
            "crashed": LogLevel.error,
            "no_worker": LogLevel.warn,
            "rejected": LogLevel.warn,
            "cache_miss": LogLevel.info,
            "server_error": LogLevel.error,
            "invalid_request": LogLevel.info,
        }
        self.assertEqual(
            {reason: event_level_for_finish_reason(reason) for reason in expected}, expected
        )

    def test_retire_reasons(self) -> None:
        """
        C{worker_retired} levels follow the reason.
        """
        expected = {
            "request_limit": LogLevel.info,
            "poisoned_context": LogLevel.warn,
            "sandbox_cleanup": LogLevel.warn,
            "timeout": LogLevel.warn,
            "crashed": LogLevel.error,
        }
        self.assertEqual(
            {reason: event_level_for_retire_reason(reason) for reason in expected}, expected
        )


class InstallObserversTests(SynchronousTestCase):
    """
    Tests for L{install_observers}.
    """

    def setUp(self) -> None:
        self.base = temp_dir(self)
        cwd = os.getcwd()
        os.chdir(self.base)
        self.addCleanup(os.chdir, cwd)
        self.publisher = LogPublisher()
        self.log = Logger(namespace="kcoral.test", observer=self.publisher)
        self.console = io.StringIO()

    def install(self, **config: Any) -> Any:
        """
        Install observers for a config built from C{config}.
        """
        setup = install_observers(
            ServerConfig(**config),
            publisher=self.publisher,
            now=datetime(2026, 8, 29, 18, 42, 11, 19012),
            console_stream=self.console,
        )
        self.addCleanup(setup.close)
        return setup

    def test_files_private_to_the_server_user(self) -> None:
        """
        Run directories are 0700, events and saved programs 0600, whatever
        the umask (issue 13, item 4): they hold every client's programs.
        """
        import stat

        old = os.umask(0o022)
        self.addCleanup(os.umask, old)
        setup = self.install(log_dir="logs")
        self.log.info("x", kcoral_event="x")
        setup.recorder.save("rid", b"{}")
        run = setup.run_dir.path

        def mode(path: Path) -> int:
            return stat.S_IMODE(path.stat().st_mode)

        self.assertEqual(mode(run.parent), 0o700)
        self.assertEqual(mode(run), 0o700)
        self.assertEqual(mode(run / "programs"), 0o700)
        self.assertEqual(mode(run / "events.jsonl"), 0o600)
        self.assertEqual(mode(run / "programs" / "rid.json"), 0o600)

    def test_log_dir_cannot_be_created(self) -> None:
        """
        A log directory that cannot be created raises L{LogDirectoryError}
        naming the configured path, the reason and the path that failed
        (issue 17, item 13).
        """
        Path("afile").write_text("")
        error = self.assertRaises(
            LogDirectoryError, install_observers, ServerConfig(log_dir="afile/logs")
        )
        self.assertIsInstance(error, OSError)
        failed = os.path.join(self.base, "afile", "logs", "runs")
        self.assertEqual(
            str(error),
            f"cannot create the log directory afile/logs: Not a directory ({failed})",
        )

    def test_no_log_dir_writes_nothing(self) -> None:
        """
        With C{log_dir=None} nothing is created on disk, there is no
        recorder, and events still reach the console.
        """
        setup = self.install(log_dir=None, log_programs=True)
        self.log.info("started", kcoral_event="server_started", run_dir=None)
        self.assertIsNone(setup.run_dir)
        self.assertIsNone(setup.recorder)
        self.assertEqual(list(self.base.iterdir()), [])
        self.assertIn("INFO    server_started\n", self.console.getvalue())

    def test_log_level(self) -> None:
        """
        C{log_level} drops less severe events from both the console and
        C{events.jsonl}.
        """
        setup = self.install(log_dir="logs", log_level="warn")
        self.log.info("routine", kcoral_event="request_finished", finish_reason="completed")
        self.log.warn("slow", kcoral_event="request_finished", finish_reason="timeout")
        console = self.console.getvalue()
        self.assertNotIn("completed", console)
        self.assertIn("WARNING request_finished", console)
        lines = setup.run_dir.events_path.read_text().splitlines()
        self.assertEqual([json.loads(line)["finish_reason"] for line in lines], ["timeout"])

    def test_files(self) -> None:
        """
        With a log directory, events go to the run's C{events.jsonl} and a
        recorder saves programs under C{programs/}.
        """
        setup = self.install(log_dir="logs", log_console=False)
        self.log.info("hello", kcoral_event="shutdown_complete")
        self.assertEqual(
            setup.run_dir.path, self.base / "logs" / "runs" / "20260829T184211.019012Z"
        )
        [line] = setup.run_dir.events_path.read_text().splitlines()
        self.assertEqual(json.loads(line)["event"], "shutdown_complete")
        self.assertEqual(setup.recorder.save("r1", b"{}"), "r1.json")
        self.assertTrue((setup.run_dir.programs_dir / "r1.json").exists())
        self.assertEqual(self.console.getvalue(), "")

    def test_no_programs(self) -> None:
        """
        C{log_programs=False} gives no recorder and no C{programs/}.
        """
        setup = self.install(log_dir="logs", log_console=False, log_programs=False)
        self.assertIsNone(setup.recorder)
        self.assertFalse(setup.run_dir.programs_dir.exists())

    def test_twisted_errors_on_console(self) -> None:
        """
        Twisted's own events at warning level or above reach the console as
        text (tracebacks included); lower ones and kcoral events are not
        duplicated.
        """
        self.install(log_dir=None)
        self.log.info("chatter")
        try:
            int("not a number")
        except ValueError:
            self.log.failure("boom in {what}", what="handler")
        self.log.warn("worker gone", kcoral_event="worker_retired", reason="crashed")
        text = self.console.getvalue()
        self.assertNotIn("chatter", text)
        self.assertIn("boom in handler", text)
        self.assertIn("ValueError", text)
        self.assertEqual(len(re.findall("worker_retired", text)), 1)

    def test_close(self) -> None:
        """
        C{close} removes every observer (extra ones too) and closes the
        events file; it may be called twice.
        """
        seen: list[dict[str, Any]] = []
        setup = install_observers(
            ServerConfig(log_dir="logs"),
            publisher=self.publisher,
            console_stream=self.console,
            extra_observers=[seen.append],
        )
        self.log.info("one", kcoral_event="e")
        setup.close()
        setup.close()
        self.log.info("two", kcoral_event="e")
        self.assertEqual(len(seen), 1)
        self.assertEqual(len(setup.run_dir.events_path.read_text().splitlines()), 1)
        self.assertEqual(len(self.console.getvalue().splitlines()), 1)
        self.assertTrue(setup.events_file.closed)

    def test_rotation_configurable(self) -> None:
        """
        C{rotate_length} and C{max_rotated_files} reach the events file.
        """
        setup = install_observers(
            attrs.evolve(ServerConfig(log_dir="logs"), log_console=False),
            publisher=self.publisher,
            rotate_length=500,
            max_rotated_files=1,
        )
        self.addCleanup(setup.close)
        for i in range(50):
            self.log.info("x", kcoral_event="request_received", request_id=f"r{i}")
        names = sorted(p.name for p in setup.run_dir.path.glob("events.jsonl*"))
        self.assertEqual(names, ["events.jsonl", "events.jsonl.1"])


class TestBackgroundWriter:
    """Lines written through a L{BackgroundWriter} arrive in order, all of them by close()."""

    def test_order_and_close(self) -> None:
        import io

        from kcoral.server.observe.logwriter import BackgroundWriter

        target = io.StringIO()
        writer = BackgroundWriter(target)
        for i in range(1000):
            writer.write(f"{i}\n")
        writer.flush()
        writer.close()
        assert target.getvalue() == "".join(f"{i}\n" for i in range(1000))
        writer.write("after\n")
        writer.close()
        assert "after" not in target.getvalue()

    def test_binary_and_broken_streams(self) -> None:
        import io

        from kcoral.server.observe.logs import JsonEventObserver
        from kcoral.server.observe.logwriter import BackgroundWriter

        target = io.BytesIO()
        writer = BackgroundWriter(target)
        observer = JsonEventObserver(writer)
        observer({"kcoral_event": "pool_ready", "log_time": 0.0, "workers": 2})
        writer.close()
        assert target.getvalue().startswith(b'{"timestamp":"1970-01-01T00:00:00.000Z"')

        class Broken(io.StringIO):
            def write(self, data: str) -> int:
                raise OSError("disk full")

        broken = BackgroundWriter(Broken())
        broken.write("x\n")
        broken.close()  # the error is swallowed, the thread ends


def test_timestamps_match_datetime() -> None:
    """The per-second cache formats exactly as datetime does, edges included."""
    from datetime import datetime, timezone

    from kcoral.server.observe.logs import format_timestamp

    for t in (0.0, 1.9995, 1767225599.001, 1767225599.9999995, 1767225600.0005, 1.0009995):
        moment = datetime.fromtimestamp(t, timezone.utc)
        expected = moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
        assert format_timestamp(t) == expected


def test_request_lines_written_when_it_finishes() -> None:
    """Behind a BackgroundWriter, a request's lines are written by its request_finished."""
    import io

    from twisted.logger import LogLevel

    from kcoral.server.observe.logs import JsonEventObserver
    from kcoral.server.observe.logwriter import BackgroundWriter

    target = io.StringIO()
    writer = BackgroundWriter(target, interval=3600)
    observer = JsonEventObserver(writer)
    observer({"kcoral_event": "request_routed", "log_time": 0.0, "log_level": LogLevel.info})
    assert target.getvalue() == ""
    observer({"kcoral_event": "request_finished", "log_time": 0.0, "log_level": LogLevel.info})
    lines = target.getvalue().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["request_routed", "request_finished"]
    observer({"kcoral_event": "worker_failed", "log_time": 0.0, "log_level": LogLevel.error})
    assert len(target.getvalue().splitlines()) == 3
    writer.close()
