"""
Generate the option tables of docs/configuration.md from the code.

The tables sit between C{<!-- generated:NAME -->} and C{<!-- end generated -->}
markers and are built from L{kcoral.server.cli.tap.Options} (flags, their help,
environment variables and command-line defaults) and L{ServerConfig} (fields
and Python defaults).  C{tests/unit/test_docs_tables.py} fails when the page
and the code disagree; run C{python docs/_ext/gen_tables.py} to rewrite them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"

#: Flags whose command-line default depends on the machine.
_MACHINE_DEFAULTS = {"disk-cache-dir": "see below", "cache-capacity-bytes": "RAM / 8"}

#: Flags that set a field by their absence (C{--no-X} clears field X).
_NEGATED = {"no-log-console": "log_console", "no-log-programs": "log_programs"}

_MARKER = re.compile(r"(<!-- generated:(?P<name>[a-z-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def _cell(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text.replace("|", "\\|")


def _help(doc: str) -> str:
    doc = re.sub(r"\s*\(env [A-Z_]+\)", "", doc)
    doc = re.sub(r"\s*\[default: [^\]]*\]", "", doc)
    return _cell(doc)


def _code(value: Any) -> str:
    return f"`{value}`"


def _flag_fields() -> dict[str, str]:
    from kcoral.server.cli import tap

    fields = {flag: field for field, flag in tap._FIELD_FLAGS.items()}
    fields.update(_NEGATED)
    return fields


def _python_default(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return "computed"
    if isinstance(default, Path):
        return _code(str(default))
    return _code(repr(default))


def options_table() -> str:
    """
    One row per flag of C{kcoral server} / C{twistd kcoral}, in one table
    per topic (L{kcoral.server.cli.tap.OPTION_GROUPS}, as C{--help} lists them).
    """
    from kcoral.config import ServerConfig
    from kcoral.server.cli import tap

    options = tap.Options(environ={})
    fields = {f.name: f for f in attrs.fields(ServerConfig)}
    flag_fields = _flag_fields()
    rows = []
    for name, _short, default, doc, *_ in options.optParameters:
        rows.append((name, _MACHINE_DEFAULTS.get(name, _code(default)), doc))
    for name, _short, doc in options.optFlags:
        rows.append((name, "off", doc))
    for name in sorted(options.synonyms):
        method = getattr(options, "opt_" + name.replace("-", "_"), None)
        if method is None or name in ("help", "version") or len(name) == 1:
            continue
        if any(row[0] == name for row in rows):
            continue
        rows.append((name, "none", method.__doc__ or ""))
    by_name = {row[0]: row for row in rows}
    tables = []
    # One table per topic, as `kcoral server --help` groups them.
    for title, names in tap.grouped(list(by_name)):
        lines = [
            f"**{title}**",
            "",
            "| Flag | Env var | Default | `ServerConfig` field (Python default) | What it does |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name in names:
            _, default, doc = by_name[name]
            env = tap.ENV_VARS.get(name)
            field = flag_fields.get(name)
            target = (
                f"`{field}` ({_python_default(fields[field])})" if field in fields else "none"
            )
            lines.append(
                f"| `--{name}` | {_code(env) if env else 'none'} | {default} | {target} "
                f"| {_help(doc)} |"
            )
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


def fields_table() -> str:
    """One row per L{ServerConfig} field, with the flag that sets it."""
    from kcoral.config import ServerConfig

    flags = {field: flag for flag, field in _flag_fields().items()}
    lines = [
        "| Field | Python default | Flag |",
        "| --- | --- | --- |",
    ]
    for field in attrs.fields(ServerConfig):
        flag = flags.get(field.name)
        lines.append(
            f"| `{field.name}` | {_python_default(field)} | {f'`--{flag}`' if flag else 'none'} |"
        )
    return "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "options": options_table,
    "fields": fields_table,
}


def render(text: str) -> str:
    """C{text} with every generated block rebuilt from the code."""

    def replace(match: re.Match[str]) -> str:
        body = GENERATORS[match.group("name")]()
        return match.group(1) + body + match.group(4)

    return _MARKER.sub(replace, text)


def blocks(text: str) -> list[str]:
    """Names of the generated blocks in C{text}, in order."""
    return [m.group("name") for m in _MARKER.finditer(text)]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    PAGE.write_text(render(PAGE.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
