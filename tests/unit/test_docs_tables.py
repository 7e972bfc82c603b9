# -*- test-case-name: tests.unit.test_docs_tables -*-
"""
docs/configuration.md's option tables are the ones the code generates, so
a flag or a default cannot change without the page changing too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from twisted.trial.unittest import SynchronousTestCase

from kcoral.server.cli import tap

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    path = ROOT / "docs" / "_ext" / "gen_tables.py"
    spec = importlib.util.spec_from_file_location("kcoral_docs_gen_tables", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ConfigurationTablesTests(SynchronousTestCase):
    def test_page_is_up_to_date(self) -> None:
        """
        Regenerating the tables leaves docs/configuration.md unchanged
        (if not: run C{python docs/_ext/gen_tables.py}).
        """
        gen = _generator()
        text = gen.PAGE.read_text()
        self.assertEqual(gen.blocks(text), ["options", "fields"])
        self.assertEqual(gen.render(text), text, "run: python docs/_ext/gen_tables.py")

    def test_every_flag_has_a_row(self) -> None:
        """Each long option of the plugin appears in the options table."""
        table = _generator().options_table()
        options = tap.Options(environ={})
        for name in options.longOpt:
            name = name.rstrip("=")
            if name in ("help", "version"):
                continue
            self.assertIn(f"| `--{name}` |", table)

    def test_environment_variables_shown(self) -> None:
        """Every KCORAL_* variable the options read is named in its row."""
        table = _generator().options_table()
        for flag, var in tap.ENV_VARS.items():
            self.assertIn(f"| `--{flag}` | `{var}` |", table)
