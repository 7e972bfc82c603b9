"""
Generate the option tables of docs/configuration.md from the code.

The tables sit between C{<!-- generated:NAME -->} and C{<!-- end generated -->}
markers and are built from the one table of options,
L{kcoral.server.cli.options.OPTIONS} (flags, fields, environment variables,
command-line defaults, help and topics), and from L{ServerConfig} (fields and
Python defaults).  C{tests/unit/test_docs_tables.py} fails when the page and
the code disagree; run C{python docs/_ext/gen_tables.py} to rewrite them.
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

_MARKER = re.compile(r"(<!-- generated:(?P<name>[a-z-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def _cell(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text.replace("|", "\\|")


def _help(doc: str) -> str:
    doc = re.sub(r"\s*\[default: [^\]]*\]", "", doc)
    return _cell(doc)


def _code(value: Any) -> str:
    return f"`{value}`"


def _python_default(field: attrs.Attribute[Any]) -> str:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return "computed"
    if isinstance(default, Path):
        return _code(str(default))
    return _code(repr(default))


def _default(option: Any) -> str:
    """An option's command-line default, as the table shows it."""
    from kcoral.server.cli.options import REPEAT, SWITCH

    if option.kind == SWITCH:
        return "off"
    if option.kind == REPEAT:
        return "none"
    return _MACHINE_DEFAULTS.get(option.flag, _code(option.default))


def options_table() -> str:
    """
    One row per option of C{kcoral server} / C{twistd kcoral}, in one table
    per topic (L{kcoral.server.cli.options.OPTION_GROUPS}, as C{--help}
    lists them).
    """
    from kcoral.config import ServerConfig
    from kcoral.server.cli.options import by_flag, grouped

    options = by_flag()
    fields = {f.name: f for f in attrs.fields(ServerConfig)}
    tables = []
    # One table per topic, as `kcoral server --help` groups them.
    for title, names in grouped(list(options)):
        lines = [
            f"**{title}**",
            "",
            "| Flag | Env var | Default | `ServerConfig` field (Python default) | What it does |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name in names:
            option = options[name]
            field = option.field
            target = f"`{field}` ({_python_default(fields[field])})" if field in fields else "none"
            lines.append(
                f"| `--{name}` | {_code(option.env)} | {_default(option)} | {target} "
                f"| {_help(option.help)} |"
            )
        tables.append("\n".join(lines) + "\n")
    return "\n".join(tables)


def fields_table() -> str:
    """One row per L{ServerConfig} field, with the flag that sets it."""
    from kcoral.config import ServerConfig
    from kcoral.server.cli.options import FIELD_FLAGS

    lines = [
        "| Field | Python default | Flag |",
        "| --- | --- | --- |",
    ]
    for field in attrs.fields(ServerConfig):
        flag = FIELD_FLAGS.get(field.name)
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
