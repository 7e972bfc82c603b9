# -*- test-case-name: tests.unit.test_tap,tests.unit.test_options -*-
"""
The C{kcoral} twistd plugin's options and service maker.

C{twistd -n kcoral [options]} and C{kcoral server [options]} both parse their
options with L{Options}, so the two accept exactly the same flags.  Every
option is a row of L{kcoral.server.cli.options.OPTIONS}, the one table of
flags, fields, C{KCORAL_*} variables, defaults and help topics; L{Options}
is generated from it.  Parsing applies the precedence I{command-line flag >
environment variable > built-in default}, runs the checks of the reference
command line with its messages, and leaves two results on the options
object:

  - C{options.config}: the validated L{ServerConfig};
  - C{options.endpoint}: a server endpoint description for
    L{twisted.application.strports.service}, such as
    C{tcp:port=8000:interface=127.0.0.1}.

L{makeService} hands both to L{kcoral.server.service.makeService}, which
builds the root service.  Nothing here starts a reactor, binds a port or
spawns a process.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from twisted.internet.endpoints import quoteStringArgument
from twisted.python import usage

from kcoral.config import (
    DEVICES,
    LOG_LEVELS,
    SANDBOXES,
    TENSOR_APIS,
    WORKER_STARTS,
    ServerConfig,
    default_disk_cache_dir,
)
from kcoral.server.cli.options import (
    DEFAULT_BACKLOG,
    ENV_VARS,
    FIELD_FLAGS,
    OPTION_GROUPS,
    OPTIONS,
    OTHER_GROUP,
    REPEAT,
    SWITCH,
    VALUE,
    BadValue,
    Option,
    by_flag,
    grouped,
)

if TYPE_CHECKING:
    from twisted.application.service import MultiService

__all__ = [
    "DEFAULT_BACKLOG",
    "ENV_VARS",
    "OPTION_GROUPS",
    "OTHER_GROUP",
    "Options",
    "endpoint_description",
    "grouped",
    "makeService",
    "with_backlog",
    "with_owner_only",
]

_OPTIONS = by_flag()

_FIELD_RE = re.compile(r"\b(" + "|".join(FIELD_FLAGS) + r")\b(?![=_])")


def _flag_message(message: str) -> str:
    """Name flags rather than L{ServerConfig} fields in an error message."""
    return _FIELD_RE.sub(lambda m: "--" + FIELD_FLAGS[m.group(1)], message)


def _bad(name: str, error: BadValue, text: str) -> usage.UsageError:
    """The usage error of C{text} given to C{name} (a flag or a variable)."""
    return usage.UsageError(f"{name} {error}, got {text!r}")


def _coercer(option: Option) -> Callable[[str], Any] | None:
    """What Twisted coerces C{option}'s command-line value with, naming the flag."""
    parse = option.parse
    if parse is None:
        return None

    def coerce(text: str) -> Any:
        try:
            return parse(text)
        except BadValue as e:
            raise _bad(f"--{option.flag}", e, text) from None

    return coerce


def _help(option: Option) -> str:
    """An option's C{--help} text: its help and its variable."""
    return f"{option.help} (env {option.env})"


def _documented(flag: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a repeatable option's C{opt_} method its help from the table."""

    def document(method: Callable[..., None]) -> Callable[..., None]:
        method.__doc__ = _help(_OPTIONS[flag])
        return method

    return document


def _unbroken_width(options: list[dict[str, Any]]) -> int:
    """
    The least width at which Twisted's help columns for C{options} break no
    word (a long C{KCORAL_*} name would otherwise be cut in two).
    """
    names = [len(o["long"]) + (o["optType"] == "parameter") for o in options]
    words = [len(word) for o in options for word in (o["doc"] or "").split()]
    return max(names) + len("  -s, --  ") + max(words, default=0)


class Options(usage.Options):
    """
    Options of C{twistd kcoral} and C{kcoral server}, generated from
    L{kcoral.server.cli.options.OPTIONS}.

    @ivar config: the L{ServerConfig} built by L{postOptions}.
    @ivar endpoints: the endpoint descriptions of the HTTP listening ports
        (C{--listen}, or C{tcp:} on C{--host}/C{--port}), built by
        L{postOptions}.
    @ivar endpoint: the first of them.
    """

    longdesc = (
        "Run a KCoral-compatible server: HTTP on --host/--port, GPU workers "
        "(--device gpu) or CUDA C compile workers (--device cpu). Every option can "
        "also be set by the KCORAL_* environment variable its help names; a flag "
        "given on the command line beats its environment variable, which beats the "
        "built-in default."
    )

    optFlags = [[o.flag, None, _help(o)] for o in OPTIONS if o.kind == SWITCH]

    optParameters = [
        [o.flag, None, o.default, _help(o), _coercer(o)] for o in OPTIONS if o.kind == VALUE
    ]

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        """
        @param environ: the environment whose C{KCORAL_*} variables supply
            defaults; L{os.environ} when C{None}.  It is read now, once.
        """
        super().__init__()  # type: ignore[no-untyped-call]
        env = os.environ if environ is None else environ
        self._environ = env
        xdg_default = str(default_disk_cache_dir(env))
        self["disk-cache-dir"] = xdg_default
        self.defaults["disk-cache-dir"] = xdg_default
        #: Raw values taken from variables, by flag (checked in postOptions,
        #: where a flag given on the command line has replaced them).
        self._from_env: dict[str, str] = {}
        #: The values of repeatable options' variables, used when no flag is.
        self._env_lists: dict[str, list[str]] = {}
        for option in OPTIONS:
            if option.kind == REPEAT:
                self[option.flag] = []
            value = env.get(option.env)
            if value is None or (value == "" and not option.empty_is_value):
                # An empty variable means "unset", except KCORAL_LOG_DIR=""
                # which disables file logging like --log-dir ''.
                continue
            if option.kind == REPEAT:
                self._env_lists[option.flag] = self._from_variable(option, value)
                continue
            self._from_env[option.flag] = value
            self[option.flag] = value
            if option.kind == VALUE:
                self.defaults[option.flag] = value if value else "''"

    @staticmethod
    def _from_variable(option: Option, text: str) -> Any:
        """C{option}'s value from its variable's C{text}; a usage error naming it."""
        try:
            return option.env_value(text)
        except BadValue as e:
            raise _bad(option.env, e, text) from None

    @_documented("listen")
    def opt_listen(self, description: str) -> None:
        if not description:
            raise usage.UsageError("--listen needs an endpoint description")
        self["listen"].append(description)

    @_documented("sandbox-readonly-path")
    def opt_sandbox_readonly_path(self, path: str) -> None:
        if not path:
            raise usage.UsageError("--sandbox-readonly-path needs a non-empty path")
        self["sandbox-readonly-path"].append(path)

    def opt_help(self) -> None:
        """
        Display this help and exit.
        """
        print(self.__str__())
        raise SystemExit(0)

    opt_h = opt_help

    def getUsage(self, width: int | None = None) -> str:
        """
        Twisted's usage text with the options grouped by topic
        (L{OPTION_GROUPS}) instead of one alphabetical list.
        """
        from twisted.python.usage import docMakeChunks

        if not width:
            width = int(os.environ.get("COLUMNS", "80"))
        short = {long: key for key, long in self.synonyms.items() if len(key) == 1}
        dicts = {}
        for opt in self.longOpt:
            name = opt.rstrip("=")
            dicts[name] = {
                "long": name,
                "short": short.get(name),
                "doc": " ".join(self.docs[name].split()),
                "optType": "parameter" if opt.endswith("=") else "flag",
                "default": self.defaults.get(name),
                "dispatch": self._dispatch.get(name),
            }
        sections = []
        for title, names in grouped(list(dicts)):
            options = [dicts[name] for name in names]
            chunks = docMakeChunks(options, max(width, _unbroken_width(options)))
            sections.append(f"\n{title}:\n" + "".join(chunks))
        longdesc = "\n".join(textwrap.wrap(self.longdesc, width)).strip()
        return "".join(sections) + "\n" + longdesc + "\n"

    def opt_version(self) -> None:
        """
        Display the kcoral version and exit.
        """
        from importlib import metadata

        try:
            version = metadata.version("kcoral-server")
        except metadata.PackageNotFoundError:
            version = "unknown"
        print(f"kcoral {version}")
        raise SystemExit(0)

    def parseOptions(self, options: Sequence[str] | None = None) -> None:
        """
        Parse C{options}, refusing abbreviated long options.

        getopt accepts any unambiguous prefix of a long option; the reference
        command line does not, so neither do we.
        """
        if options is not None:
            self._reject_abbreviations(options)
        super().parseOptions(options)  # type: ignore[no-untyped-call]

    def _reject_abbreviations(self, options: Sequence[str]) -> None:
        known = {name.rstrip("=") for name in self.longOpt}
        takes_value = {name[:-1] for name in self.longOpt if name.endswith("=")}
        skip = False
        for arg in options:
            if skip:
                skip = False
                continue
            if arg == "--":
                return
            if arg.startswith("--"):
                name, has_value, _ = arg[2:].partition("=")
                if name not in known:
                    raise usage.UsageError(f"option --{name} not recognized")
                skip = name in takes_value and not has_value

    def _value(self, option: Option) -> Any:
        """
        C{option}'s value: a flag's, coerced while parsing; else its
        variable's, coerced here (a usage error naming the variable); else
        its default (coerced naming the flag, for a default given as text).
        """
        flag = option.flag
        if option.kind == REPEAT:
            given: list[str] = self[flag]
            return given or self._env_lists.get(flag, [])
        value = self[flag]
        if not isinstance(value, str):
            return value
        if flag in self._from_env:
            # Still the variable's text: a flag would have been coerced.
            return self._from_variable(option, value)
        if option.parse is None:
            return value
        coerce = _coercer(option)
        assert coerce is not None
        return coerce(value)

    def postOptions(self) -> None:
        """
        Check the options and build C{self.config} and C{self.endpoint}.

        @raise usage.UsageError: naming the offending flag or variable.
        """
        values = {option.flag: self._value(option) for option in OPTIONS}
        device = values["device"]
        if device not in DEVICES:
            raise usage.UsageError(f"--device must be 'cpu' or 'gpu', got {device!r}")
        sandbox = values["sandbox"]
        if sandbox not in SANDBOXES:
            raise usage.UsageError(
                f"--sandbox must be 'none', 'bubblewrap' or 'auto', got {sandbox!r}"
            )
        for flag, allowed in (
            ("tensor-api", TENSOR_APIS),
            ("worker-start", WORKER_STARTS),
            ("log-level", LOG_LEVELS),
        ):
            if values[flag] not in allowed:
                raise usage.UsageError(
                    f"--{flag} must be one of {', '.join(allowed)}, got {values[flag]!r}"
                )
        host, port = values["host"], values["port"]
        if not host:
            raise usage.UsageError("--host must not be empty")

        # The reference command line's checks, in its order and words.
        if device == "gpu" and not values["gpus"]:
            raise usage.UsageError("--gpus needs at least one GPU id")
        if values["num-workers"] < 1:
            raise usage.UsageError("--num-workers must be at least 1")
        if values["workers-per-gpu"] < 1:
            raise usage.UsageError("--workers-per-gpu must be at least 1")
        if not 1 <= port <= 65535:
            raise usage.UsageError("--port must be between 1 and 65535")
        if values["max-requests-per-worker"] < 0:
            raise usage.UsageError("--max-requests-per-worker must be non-negative")
        if values["disk-cache-capacity-mbytes"] < 0:
            raise usage.UsageError("--disk-cache-capacity-mbytes must be non-negative")
        if values["sandbox-readonly-path"] and sandbox == "none":
            raise usage.UsageError("--sandbox-readonly-path requires --sandbox bubblewrap")
        if values["listen-backlog"] < 1:
            raise usage.UsageError("--listen-backlog must be at least 1")
        token_file = values["auth-token-file"] or None
        if token_file is not None:
            from kcoral.server.http.auth import TokenFileError, load_tokens

            try:
                load_tokens(token_file)
            except TokenFileError as e:
                raise usage.UsageError(f"--auth-token-file: {e}") from None

        fields = {
            option.field: option.to_field(values[option.flag])
            for option in OPTIONS
            if option.field is not None
        }
        try:
            self.config = ServerConfig(**fields)
        except ValueError as e:
            raise usage.UsageError(_flag_message(str(e))) from None
        self["port"] = port
        descriptions = values["listen"] or [endpoint_description(host, port)]
        self.endpoints = tuple(
            with_owner_only(with_backlog(d, values["listen-backlog"])) for d in descriptions
        )
        if self.config.front_ends > 1:
            other = [d for d in self.endpoints if d.split(":", 1)[0].lower() not in ("tcp", "tcp6")]
            if other:
                raise usage.UsageError(
                    f"--front-ends needs plain TCP endpoints (tcp:...), not {other[0]!r}"
                )
        if self.config.join_url is not None:
            self._check_join()
        self.endpoint = self.endpoints[0]

    def _check_join(self) -> None:
        """
        A node that joins a pool listens on loopback only (its jobs come
        through NATS), and its credentials file must be readable.
        """
        from kcoral.server.join.options import JoinListenError, check_join_endpoints

        try:
            check_join_endpoints(self.endpoints)
        except JoinListenError as e:
            raise usage.UsageError(f"--join: {e}") from None
        from kcoral.gateway.natsbridge import load_credentials

        assert self.config.join_credentials is not None
        try:
            load_credentials(str(self.config.join_credentials))
        except (OSError, ValueError) as e:
            raise usage.UsageError(f"--credentials: {e}") from None


def endpoint_description(host: str, port: int) -> str:
    """
    Describe a TCP listening port for L{twisted.application.strports}.

    @param host: the interface address; colons (IPv6) are escaped.
    @param port: the TCP port.
    @return: e.g. C{tcp:port=8000:interface=127.0.0.1}.
    """
    interface: str = quoteStringArgument(host)  # type: ignore[no-untyped-call]
    return f"tcp:port={port}:interface={interface}"


def with_backlog(description: str, backlog: int) -> str:
    """
    Add C{backlog=} to a C{tcp:} or C{ssl:} endpoint description that has
    none (Twisted's default of 50 resets connections in a burst).
    """
    kind = description.split(":", 1)[0].lower()
    if kind in ("tcp", "tcp6", "ssl") and "backlog=" not in description:
        return f"{description}:backlog={backlog}"
    return description


#: The mode of a UNIX socket given without C{mode=}: its owner only.
DEFAULT_UNIX_MODE = "600"


def with_owner_only(description: str) -> str:
    """
    Add C{mode=600} to a C{unix:} endpoint description that has no mode
    (Twisted's default, 0666, lets every local user connect).
    """
    kind, _, rest = description.partition(":")
    fields = rest.split(":")
    if kind.lower() == "unix" and not any(f.startswith("mode=") for f in fields[1:]):
        return f"{description}:mode={DEFAULT_UNIX_MODE}"
    return description


def makeService(options: Options, *, console_mirror: bool = False) -> MultiService:
    """
    Build the root service from parsed options (the L{IServiceMaker} hook).

    Under plain twistd, twistd's own log observer already writes every event
    (kcoral's included) to its log file or the terminal, so kcoral's console
    mirror stays off there: each event appears once, where twistd's
    C{--logfile}/C{--syslog} send it.  C{kcoral server} installs a twistd
    logger that leaves kcoral events out and asks for the mirror instead.

    @param options: an L{Options} whose C{postOptions} has run.
    @param console_mirror: keep C{config.log_console} as parsed.
    @return: the service made by L{kcoral.server.service.makeService}.
    """
    # Imported here so that parsing options never loads the service tree.
    import attrs

    from kcoral.server.service import makeService as make_root_service

    config = options.config
    if not console_mirror:
        config = attrs.evolve(config, log_console=False)
    root: MultiService = make_root_service(config, options.endpoints)
    return root
