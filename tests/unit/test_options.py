"""
Tests for L{kcoral.server.cli.options}, the one table of the server's
options, and for how L{kcoral.server.cli.tap.Options} reads it: every
option has a unique flag, field and C{KCORAL_*} variable, and each
variable is parsed by its option's type, beaten by the flag.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from kcoral.config import ServerConfig
from kcoral.server.cli import tap
from kcoral.server.cli.options import (
    ENV_VARS,
    GROUPS,
    JOIN,
    OPTIONS,
    REPEAT,
    SWITCH,
    BadValue,
    boolean,
    by_flag,
)

#: A fixed environment with no KCORAL_* variables.
BARE_ENV = {"HOME": "/home/op"}

#: For every option: a value for its variable and a different one for its
#: flag, each different from the default (C{None} for a switch's flag).
SAMPLES: dict[str, tuple[str, str | None]] = {
    "host": ("0.0.0.0", "10.0.0.1"),
    "port": ("9000", "9001"),
    "listen": ("tcp:9100 unix:/run/k.sock", "tcp:9200"),
    "listen-backlog": ("64", "128"),
    "auth-token-file": ("TOKENS-A", "TOKENS-B"),
    "public-metrics": ("yes", None),
    "max-connections": ("100", "200"),
    "max-connections-per-client": ("10", "20"),
    "first-header-timeout-seconds": ("1.5", "2.5"),
    "header-timeout-seconds": ("3", "4"),
    "body-timeout-seconds": ("5", "6"),
    "body-stall-seconds": ("7", "8"),
    "front-ends": ("2", "3"),
    "lame-duck-seconds": ("9", "10"),
    "device": ("cpu", "gpu"),  # the flag says the default again: it still beats the variable
    "gpus": ("1,2", "3"),
    "num-workers": ("4", "5"),
    "workers-per-gpu": ("6", "7"),
    "max-requests-per-worker": ("0", "2"),
    "spare-workers-per-gpu": ("2", "3"),
    "worker-start": ("spawn", "fork"),
    "cuda-connections": ("4", "16"),
    "tensor-api": ("torch", "pycuda"),
    "reuse-scope": ("any", "address"),
    "worker-termination-grace-seconds": ("1", "2"),
    "gpu-monitor-interval": ("0.5", "0"),
    "sandbox": ("auto", "bubblewrap"),
    "sandbox-readonly-path": (os.pathsep.join(["/opt/a", "/opt/b"]), "/opt/c"),
    "output-space-bytes": ("100000000", "200000000"),
    "workspace-bytes": ("1000", "2000"),
    "worker-wait-timeout-seconds": ("11", "12"),
    "max-queued-requests": ("13", "14"),
    "finish-abandoned": ("true", None),
    "default-timeout-seconds": ("15", "16"),
    "max-timeout-seconds": ("1000", "2000"),
    "max-request-bytes": ("1900", "2000"),
    "max-bytes-in-flight": ("2100", "2200"),
    "max-bytes-per-client": ("2300", "2400"),
    "max-channel-bytes": ("2500", "2600"),
    "max-response-bytes": ("2700", "2800"),
    "output-limit-bytes": ("2900", "3000"),
    "max-output-limit-bytes": ("3100", "3200"),
    "cache-capacity-bytes": ("3300", "3400"),
    "disk-cache-dir": ("/srv/cache-a", "/srv/cache-b"),
    "disk-cache-capacity-mbytes": ("35", "36"),
    "join": ("nats://127.0.0.1:4222", "nats://127.0.0.1:4223"),
    "node-id": ("node-a", "node-b"),
    "credentials": ("CREDS-A", "CREDS-B"),
    "log-dir": ("/var/log/a", "/var/log/b"),
    "log-level": ("debug", "warn"),
    "no-log-console": ("1", None),
    "no-log-programs": ("on", None),
    "log-retention-days": ("37", "38"),
    "log-retention-mbytes": ("39", "40"),
}


#: The join options come together: each is tried beside the others' values.
JOINED = {
    "KCORAL_JOIN": "nats://127.0.0.1:4000",
    "KCORAL_NODE_ID": "node-base",
    "KCORAL_CREDENTIALS": "CREDS-BASE",
}


def parse(args: list[str], environ: dict[str, str] | None = None) -> tap.Options:
    options = tap.Options(environ={**BARE_ENV, **(environ or {})})
    options.parseOptions(args)
    return options


class TableTests(SynchronousTestCase):
    """The table itself."""

    def test_unique(self) -> None:
        """Every row has its own flag, field and variable."""
        for attribute in ("flag", "field", "env"):
            values = [getattr(o, attribute) for o in OPTIONS if getattr(o, attribute) is not None]
            self.assertEqual(len(values), len(set(values)), attribute)

    def test_every_option_has_a_variable(self) -> None:
        """Each option reads a C{KCORAL_*} variable."""
        for option in OPTIONS:
            self.assertTrue(option.env.startswith("KCORAL_"), option.flag)
        self.assertEqual(set(ENV_VARS), {o.flag for o in OPTIONS})

    def test_every_field_is_an_option(self) -> None:
        """Every L{ServerConfig} field is filled by exactly one option, and only fields are."""
        fields = {f.name for f in attrs.fields(ServerConfig)}
        filled = {o.field for o in OPTIONS if o.field is not None}
        self.assertEqual(filled, fields)

    def test_the_plugin_is_the_table(self) -> None:
        """The plugin's long options are the table's rows, plus --help and --version."""
        names = {name.rstrip("=") for name in tap.Options(environ={}).longOpt}
        self.assertEqual(names - {"help", "version"}, {o.flag for o in OPTIONS})

    def test_groups(self) -> None:
        """Each row's topic is one --help lists, in the table's order."""
        for option in OPTIONS:
            self.assertIn(option.group, GROUPS, option.flag)
        titles = [title for title, _ in tap.grouped([o.flag for o in OPTIONS])]
        self.assertEqual(titles, list(GROUPS))

    def test_samples_cover_the_table(self) -> None:
        """The samples below name every option (a new row needs one)."""
        self.assertEqual(set(SAMPLES), {o.flag for o in OPTIONS})


class PrecedenceTests(SynchronousTestCase):
    """Flag > variable > default, for every option."""

    def result(self, options: tap.Options, flag: str) -> Any:
        option = by_flag()[flag]
        if option.field is None:
            return (options.endpoints, options["port"])
        return getattr(options.config, option.field)

    def sample(self, text: str | None, files: dict[str, str]) -> str | None:
        return files.get(text, text) if text is not None else None

    def test_every_option(self) -> None:
        """Each variable changes the result, and its flag changes it again."""
        files = {}
        for name in ("TOKENS-A", "TOKENS-B"):
            path = Path(self.mktemp())
            path.write_text(f"client-{name} secret-token-{name}-0123456789\n")
            files[name] = str(path)
        for name in ("CREDS-A", "CREDS-B", "CREDS-BASE"):
            path = Path(self.mktemp())
            path.write_text(json.dumps({"user": name, "password": "secret"}))
            files[name] = str(path)
        for option in OPTIONS:
            env_text, flag_text = SAMPLES[option.flag]
            env_text = self.sample(env_text, files)
            flag_text = self.sample(flag_text, files)
            base = {}
            if option.group == JOIN:
                base = {var: self.sample(text, files) or "" for var, text in JOINED.items()}
            environ = {**base, option.env: env_text or ""}
            default = self.result(parse([], base), option.flag)
            from_env = self.result(parse([], environ), option.flag)
            self.assertNotEqual(from_env, default, option.flag)
            if option.kind == SWITCH:
                # A switch's flag says "on"; its variable can say "off".
                off = {option.env: "0"}
                self.assertEqual(self.result(parse([], off), option.flag), default, option.flag)
                self.assertEqual(
                    self.result(parse([f"--{option.flag}"], off), option.flag),
                    from_env,
                    option.flag,
                )
                continue
            assert flag_text is not None
            from_flag = self.result(parse([f"--{option.flag}", flag_text], environ), option.flag)
            self.assertNotEqual(from_flag, from_env, option.flag)


class VariableTypeTests(SynchronousTestCase):
    """Each kind of value, from its variable."""

    def config(self, **environ: str) -> ServerConfig:
        config: ServerConfig = parse([], environ).config
        return config

    def test_integer(self) -> None:
        self.assertEqual(self.config(KCORAL_MAX_QUEUED_REQUESTS="7").max_queued_requests, 7)

    def test_number(self) -> None:
        config = self.config(KCORAL_LOG_RETENTION_DAYS="1.5", KCORAL_LAME_DUCK_SECONDS="2")
        self.assertEqual((config.log_retention_days, config.lame_duck_seconds), (1.5, 2.0))

    def test_words(self) -> None:
        config = self.config(KCORAL_LOG_LEVEL="debug", KCORAL_REUSE_SCOPE="any")
        self.assertEqual((config.log_level, config.reuse_scope), ("debug", "any"))

    def test_switches(self) -> None:
        """1/0, true/false, yes/no, on/off, in any case."""
        for text, value in (("1", True), ("TRUE", True), ("Yes", True), ("on", True)):
            self.assertIs(self.config(KCORAL_PUBLIC_METRICS=text).public_metrics, value)
        for text in ("0", "false", "NO", "off"):
            self.assertIs(self.config(KCORAL_PUBLIC_METRICS=text).public_metrics, False)
        self.assertIs(self.config(KCORAL_NO_LOG_CONSOLE="1").log_console, False)
        self.assertIs(self.config(KCORAL_NO_LOG_PROGRAMS="0").log_programs, True)

    def test_lists(self) -> None:
        """--listen's variable splits at white space, the read-only paths' at os.pathsep."""
        options = parse([], {"KCORAL_LISTEN": " tcp:9100  unix:/run/k.sock "})
        self.assertEqual(options.endpoints, ("tcp:9100:backlog=1024", "unix:/run/k.sock:mode=600"))
        paths = os.pathsep.join(["/opt/a", "", "/opt/b"])
        config = self.config(KCORAL_SANDBOX_READONLY_PATH=paths)
        self.assertEqual(config.sandbox_readonly_paths, (Path("/opt/a"), Path("/opt/b")))

    def test_flag_replaces_a_list(self) -> None:
        """A repeated flag replaces its variable's list rather than adding to it."""
        options = parse(["--listen", "tcp:9300"], {"KCORAL_LISTEN": "tcp:9100 tcp:9200"})
        self.assertEqual(options.endpoints, ("tcp:9300:backlog=1024",))

    def test_paths_and_empty(self) -> None:
        """An empty variable is unset, except KCORAL_LOG_DIR's, which turns logs off."""
        self.assertEqual(self.config(KCORAL_DISK_CACHE_DIR="/c").disk_cache_dir, Path("/c"))
        default = self.config().disk_cache_dir
        self.assertEqual(self.config(KCORAL_DISK_CACHE_DIR="").disk_cache_dir, default)
        self.assertIsNone(self.config(KCORAL_LOG_DIR="").log_dir)
        self.assertEqual(self.config(KCORAL_NUM_WORKERS="").num_workers, 1)

    def test_gpus_and_connections(self) -> None:
        config = self.config(KCORAL_SERVER_GPUS="2, 3", KCORAL_CUDA_CONNECTIONS="auto")
        self.assertEqual((config.gpus, config.cuda_connections), ((2, 3), None))

    def test_boolean_words(self) -> None:
        """L{boolean} refuses what is neither yes nor no."""
        with self.assertRaises(BadValue):
            boolean("maybe")


class BadVariableTests(SynchronousTestCase):
    """A bad value in a variable is a usage error naming the variable; a flag overrides it."""

    def assertRefused(self, var: str, text: str, message: str, flag: list[str]) -> None:
        with self.assertRaises(usage.UsageError) as cm:
            parse([], {var: text})
        self.assertEqual(str(cm.exception), message)
        parse(flag, {var: text})  # the flag wins: the variable is not read

    def test_integer(self) -> None:
        self.assertRefused(
            "KCORAL_NUM_WORKERS",
            "four",
            "KCORAL_NUM_WORKERS must be an integer, got 'four'",
            ["--num-workers", "4"],
        )

    def test_number(self) -> None:
        self.assertRefused(
            "KCORAL_BODY_TIMEOUT_SECONDS",
            "soon",
            "KCORAL_BODY_TIMEOUT_SECONDS must be a number, got 'soon'",
            ["--body-timeout-seconds", "1"],
        )
        self.assertRefused(
            "KCORAL_BODY_TIMEOUT_SECONDS",
            "nan",
            "KCORAL_BODY_TIMEOUT_SECONDS must be a finite number, got 'nan'",
            ["--body-timeout-seconds", "1"],
        )

    def test_switch(self) -> None:
        self.assertRefused(
            "KCORAL_FINISH_ABANDONED",
            "sometimes",
            "KCORAL_FINISH_ABANDONED must be 1 or 0 (true/false, yes/no, on/off), got 'sometimes'",
            ["--finish-abandoned"],
        )

    def test_gpus(self) -> None:
        self.assertRefused(
            "KCORAL_SERVER_GPUS",
            "0,x",
            "KCORAL_SERVER_GPUS must be a comma-separated list of integers, got '0,x'",
            ["--gpus", "0"],
        )

    def test_checked_values_name_the_flag(self) -> None:
        """A well-formed value out of range is refused as the flag's would be."""
        with self.assertRaises(usage.UsageError) as cm:
            parse([], {"KCORAL_NUM_WORKERS": "0"})
        self.assertEqual(str(cm.exception), "--num-workers must be at least 1")
        with self.assertRaises(usage.UsageError) as cm:
            parse([], {"KCORAL_LOG_LEVEL": "loud"})
        self.assertIn("--log-level must be one of", str(cm.exception))

    def test_list_kinds_only_split(self) -> None:
        """A list option's variable is split, never refused for its form."""
        for option in OPTIONS:
            if option.kind == REPEAT:
                self.assertEqual(option.env_value(""), [])
