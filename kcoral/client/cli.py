# -*- test-case-name: tests.unit.test_client_cli -*-
"""
C{kcoral run <tool> [options] -- <arguments>} and C{kcoral health}, with
the 0.1.1 CLI's tools and flags (protocol §12).

A run sends one program: the runner and the tool's module (uploaded
source), a tar archive of the C{--send} paths, a C{run} of the runner, and
returns of its outcome and, with C{--out}, of the C{outputs} folder.  The
exit status is the remote command's (0 only when the program COMPLETED).
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import json
import os
import re
import sys
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from kcoral.client.program import Program
from kcoral.client.tools import TOOLS, source

DEFAULT_TIMEOUT = 300
DEFAULT_OUTPUT_LIMIT = 256 * 1024 * 1024
_PROFILERS = ("ncu", "run-iket")
_MANAGED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "KCORAL_DIR"})
_BAD_HOST = re.compile(r"[\s\x00-\x1f\x7f/@?#\\]")
_HOST_ERROR = "--host must be a hostname or IP address, without a scheme, port or path"


def relative(name: str) -> str:
    """A relative POSIX path without '..' (ValueError otherwise)."""
    parts = name.split("/")
    if not name or "\\" in name or name.startswith("/") or ".." in parts:
        raise ValueError(f"expected a relative file path: {name!r}")
    kept = [p for p in parts if p not in ("", ".")]
    if not kept:
        raise ValueError(f"expected a relative file path: {name!r}")
    return "/".join(kept)


def add_connection_options(parser: argparse.ArgumentParser, *, execution: bool = True) -> None:
    parser.add_argument(
        "--url", help="server URL; default: KCORAL_URL; cannot combine with --host or --port"
    )
    parser.add_argument("--host", help="server host; overrides KCORAL_URL (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="server port; overrides KCORAL_URL (default 8000)")
    if execution:
        parser.add_argument(
            "--timeout",
            type=int,
            default=DEFAULT_TIMEOUT,
            help="execution timeout in seconds (default: 300; server caps apply)",
        )
        parser.add_argument(
            "--output-limit-bytes",
            type=int,
            default=DEFAULT_OUTPUT_LIMIT,
            help="capture limit per stream (default: 268435456; server caps apply)",
        )


def resolve_url(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: dict[str, str], err: IO[str]
) -> str:
    """The base URL from C{--url}, C{--host}/C{--port} or C{KCORAL_URL}."""
    from_env = environ.get("KCORAL_URL")
    if args.host is None and args.port is None:
        url = args.url if args.url is not None else from_env
        if not url:
            parser.error("set KCORAL_URL or pass --url, --host or --port")
        return str(url)
    if args.url is not None:
        parser.error("--url cannot be combined with --host or --port")
    host = "127.0.0.1" if args.host is None else args.host
    port = 8000 if args.port is None else args.port
    if not 1 <= port <= 65535:
        parser.error("--port must be between 1 and 65535")
    if not host or _BAD_HOST.search(host):
        parser.error(_HOST_ERROR)
    if ":" in host:
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            parser.error(_HOST_ERROR)
        host = f"[{bare}]"
    elif re.search(r"[\[\]%]", host):
        parser.error(_HOST_ERROR)
    url = f"http://{host}:{port}"
    if from_env:
        err.write(f"kcoral: warning: --host/--port override KCORAL_URL; using {url}\n")
    return url


def check_python_arguments(parser: argparse.ArgumentParser, arguments: list[str]) -> None:
    """A script, C{-c} or C{-m} is required; interactive and stdin runs are refused."""
    tokens = iter(arguments)
    for token in tokens:
        if token == "--":
            if next(tokens, "-") != "-":
                return
            break
        if token == "-":
            break
        if not token.startswith("-"):
            return  # the script
        if token.startswith("--"):
            if token == "--check-hash-based-pycs":
                next(tokens, None)
            continue
        for position, flag in enumerate(token[1:], start=1):
            if flag == "i":
                parser.error("interactive Python execution is unsupported")
            if flag in "cmWX":
                value = token[position + 1 :] or next(tokens, None)
                if value is None:
                    parser.error(f"Python -{flag} requires an argument")
                if flag in "cm":
                    return
                break
    parser.error("a script, -c command, or -m module is required; stdin execution is unsupported")


def check_profiler_arguments(
    parser: argparse.ArgumentParser,
    arguments: list[str],
    *,
    managed: tuple[str, ...],
    short: tuple[str, ...],
    subcommand: str | None = None,
) -> None:
    """C{profiler options -- application}, without options kcoral manages itself."""
    if "--" not in arguments:
        parser.error("separate profiler options from the application with another '--'")
    split = arguments.index("--")
    options = arguments[:split]
    if not arguments[split + 1 :] or (subcommand is not None and subcommand not in options):
        parser.error("expected profiler options followed by '-- application [args]'")
    for token in options:
        option = token.split("=", 1)[0]
        if option.startswith("--"):
            clash = any(flag.startswith(option) for flag in managed)
        else:
            clash = any(option.startswith(flag) for flag in short)
        if clash:
            parser.error(f"{option} conflicts with managed remote capture paths or mode")


def _check_tool_arguments(tool: str, parser: argparse.ArgumentParser, rest: list[str]) -> None:
    if tool == "python":
        check_python_arguments(parser, rest)
    elif tool == "ncu":
        check_profiler_arguments(
            parser,
            rest,
            managed=("--export", "--import", "--mode", "--config-file", "--config-file-path"),
            short=("-o", "-i"),
        )
    elif tool == "run-iket":
        check_profiler_arguments(
            parser,
            rest,
            managed=("--output-dir", "--working-dir"),
            short=("-o",),
            subcommand="profile",
        )


def parse_tool_arguments(
    tool: str,
    argv: Sequence[str],
    *,
    environ: dict[str, str] | None = None,
    err: IO[str] | None = None,
) -> tuple[argparse.Namespace, list[str]]:
    """
    Parse C{kcoral run <tool>}'s own options (before C{--}) and check the
    tool's arguments (after it).  Usage errors exit with status 2.
    """
    env = dict(os.environ if environ is None else environ)
    profiling = tool in _PROFILERS
    parser = argparse.ArgumentParser(
        prog=f"kcoral run {tool}",
        allow_abbrev=False,
        description=f"Run {tool} on a KCoral worker.",
    )
    add_connection_options(parser)
    parser.add_argument(
        "--send",
        type=Path,
        action="append",
        default=[],
        help="upload a file or directory, keeping its name; repeatable",
    )
    parser.add_argument(
        "-e",
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="set a remote environment variable; NAME alone copies the local value",
    )
    parser.add_argument(
        "--out", type=Path, required=profiling, help="new local directory for returned artifacts"
    )
    if profiling:
        parser.set_defaults(fetch=[])
    else:
        parser.add_argument(
            "--fetch",
            action="append",
            default=[],
            help="relative output file or directory to return (needs --out); repeatable",
        )
    argv = list(argv)
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            parser.parse_args(["--help"])
        parser.error("separate KCoral options from tool arguments with '--'")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    rest = argv[split + 1 :]
    if not rest:
        parser.error("arguments are required after '--'")
    args.url = resolve_url(parser, args, env, sys.stderr if err is None else err)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.output_limit_bytes <= 0:
        parser.error("--output-limit-bytes must be positive")
    overrides: dict[str, str] = {}
    for entry in args.env:
        name, has_value, value = entry.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            parser.error("environment variable names must be identifiers")
        if name in _MANAGED_ENV:
            parser.error(f"{name} is managed by the remote worker")
        if not has_value:
            if name not in env:
                parser.error(f"local environment variable {name} is not set")
            value = env[name]
        if "\x00" in value:
            parser.error(f"environment variable {name} contains NUL")
        overrides[name] = value
    args.env = overrides
    if not profiling and bool(args.fetch) != (args.out is not None):
        parser.error("--fetch and --out must be used together")
    for name in args.fetch:
        try:
            relative(name)
        except ValueError as e:
            parser.error(str(e))
    _check_tool_arguments(tool, parser, rest)
    return args, rest


def pack_inputs(paths: Sequence[Path] = ()) -> bytes:
    """
    An uncompressed tar of the C{--send} paths: a file as its name, a
    directory as C{<name>/<relative path>} for each regular file
    (C{__pycache__} skipped); mode 0700 when executable locally, else 0600.
    """
    buffer = io.BytesIO()
    names: set[str] = set()
    with tarfile.open(fileobj=buffer, mode="w") as tar:

        def add(name: str, data: bytes, executable: bool) -> None:
            name = relative(name)
            if name in names or any(
                name.startswith(other + "/") or other.startswith(name + "/") for other in names
            ):
                raise ValueError(f"duplicate or conflicting input path: {name}")
            names.add(name)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o700 if executable else 0o600
            tar.addfile(info, io.BytesIO(data))

        for path in paths:
            if path.is_symlink() or not path.exists():
                raise ValueError(f"input must exist and not be a symlink: {path}")
            if path.is_dir():
                base = path.resolve().name
                if not base:
                    raise ValueError(f"input directory must have a name: {path}")
                entries = sorted(path.rglob("*"))
            else:
                base, entries = path.name, [path]
            for entry in entries:
                if "__pycache__" in entry.parts:
                    continue
                if entry.is_symlink():
                    raise ValueError(f"symlink inputs are not supported: {entry}")
                if entry.is_dir():
                    continue
                if not entry.is_file():
                    raise ValueError(f"input is not a regular file: {entry}")
                name = f"{base}/{entry.relative_to(path).as_posix()}" if path.is_dir() else base
                add(name, entry.read_bytes(), bool(entry.stat().st_mode & 0o111))
    return buffer.getvalue()


def build_program(tool: str, args: argparse.Namespace, arguments: list[str]) -> Program:
    """The program of one C{kcoral run} (protocol §12.2, with its fixed ids)."""
    program = Program()
    runner_module = program.upload(id="tool_runner", kind="module", source=source("runner"))
    runner = program.get_function(id="runner", module=runner_module, name="run")
    definition = program.upload(id="definition", kind="module", source=source(TOOLS[tool]))
    tool_run = program.get_function(id="tool_run", module=definition, name="run")
    inputs = program.upload(id="inputs", kind="bytes", value=pack_inputs(args.send))
    outcome = program.run(
        id="run", fn=runner, args=[inputs, tool_run, arguments, args.env, args.fetch]
    )
    # Returned first, so the exit status survives a failing artifact return.
    program.return_(key="outcome", value=outcome)
    if args.out is not None:
        program.return_folder(key="artifacts", path="outputs")
    return program


def _progress(stream: IO[str]) -> Any:
    if not stream.isatty():
        return None
    from kcoral.client.blocking import client_reactor
    from kcoral.client.progress import TerminalProgress

    # The progress line ticks on the reactor the blocking client runs.
    return TerminalProgress(stream, clock=client_reactor())


def interruptible(name: str, command: Callable[[], int], *, err: IO[str] | None = None) -> int:
    """
    Run C{command}; on Ctrl-C print one line and return 130 (128 + SIGINT),
    as a shell does for a command killed by SIGINT.  The blocking client has
    already cancelled its request (the server cancels the program).
    """
    import signal

    try:
        return command()
    except KeyboardInterrupt:
        # A second Ctrl-C while the interpreter shuts down ends it quietly.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        stream = sys.stderr if err is None else err
        clear = "\r\x1b[K" if stream.isatty() else ""  # over a progress line
        stream.write(f"{clear}{name}: interrupted\n")
        stream.flush()
        return 130


def run_tool(
    tool: str,
    args: argparse.Namespace,
    arguments: list[str],
    *,
    client_factory: Callable[..., Any] | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """Run one tool remotely; return the exit status."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if client_factory is None:
        from kcoral.client.blocking import Client

        client_factory = Client
    try:
        if args.out is not None:
            if os.path.lexists(args.out):
                raise ValueError(f"output already exists; choose a new --out directory: {args.out}")
            args.out.parent.mkdir(parents=True, exist_ok=True)
        program = build_program(tool, args, arguments)
        with client_factory(args.url, progress=_progress(err)) as client:
            result = client.execute(
                program, timeout_seconds=args.timeout, output_limit_bytes=args.output_limit_bytes
            )
        out.write(result.stdout)
        out.flush()
        err.write(result.stderr)
        if result.stdout_truncated or result.stderr_truncated:
            err.write("kcoral: remote output was truncated\n")
        if "artifacts" in result.results:
            result.results["artifacts"].save(args.out)
            err.write(f"kcoral: saved artifacts to {args.out}\n")
        if not result.completed:
            error = result.error or {}
            err.write(
                f"kcoral run {tool}: {result.status}: {error.get('kind')}: "
                f"{error.get('message')}\n{error.get('traceback', '')}"
            )
            return 1
        outcome = result.results["outcome"]
        code = int(outcome["returncode"])
        if outcome["missing"]:
            err.write(f"kcoral: missing artifacts: {', '.join(outcome['missing'])}\n")
            code = code or 1
        return code if code >= 0 else 128 - code
    except Exception as e:
        err.write(f"kcoral run {tool}: {type(e).__name__}: {e}\n")
        return 1


def run_main(argv: Sequence[str]) -> int:
    """C{kcoral run <tool> ...}."""
    parser = argparse.ArgumentParser(
        prog="kcoral run", description="Run a tool on a KCoral server.", allow_abbrev=False
    )
    tools = parser.add_subparsers(dest="tool", required=True)
    for name in TOOLS:
        tools.add_parser(name, add_help=False, help=f"run {name} remotely")
    try:
        tool = parser.parse_args(list(argv[:1])).tool
        args, arguments = parse_tool_arguments(tool, argv[1:])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return run_tool(tool, args, arguments)


def health_main(
    argv: Sequence[str],
    *,
    client_factory: Callable[..., Any] | None = None,
    out: IO[str] | None = None,
) -> int:
    """C{kcoral health}: print the server's C{/health} object; 0 when it is ok."""
    out = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(
        prog="kcoral health", description="Check a KCoral server.", allow_abbrev=False
    )
    add_connection_options(parser, execution=False)
    try:
        args = parser.parse_args(list(argv))
        url = resolve_url(parser, args, dict(os.environ), sys.stderr)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if client_factory is None:
        from kcoral.client.blocking import Client

        client_factory = Client
    try:
        with client_factory(url) as client:
            health = client.health()
    except Exception as e:
        sys.stderr.write(f"kcoral health: {type(e).__name__}: {e}\n")
        return 1
    out.write(json.dumps(health, indent=2, sort_keys=True) + "\n")
    return 0


__all__ = [
    "build_program",
    "health_main",
    "interruptible",
    "pack_inputs",
    "parse_tool_arguments",
    "run_main",
]
