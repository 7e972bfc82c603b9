# -*- test-case-name: tests.unit.test_docs_events -*-
"""
docs/logs.md's event catalogue names exactly the events the code emits.

The code's events are found by reading the source (no server runs): every
C{kcoral_event="name"} keyword, and every literal name handed to the helpers
that forward it as C{kcoral_event} (the lease arbiter's C{_event}, the
caches' C{_on_event}).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

ROOT = Path(__file__).resolve().parents[2]

#: Functions whose first argument is an event name they log as kcoral_event.
_FORWARDERS = frozenset({"_event", "_on_event", "_cache_event", "on_event"})


def emitted_events(package: Path = ROOT / "kcoral") -> dict[str, set[str]]:
    """Event name -> the source files (relative) that emit it."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            names = [
                k.value.value
                for k in node.keywords
                if k.arg == "kcoral_event"
                and isinstance(k.value, ast.Constant)
                and isinstance(k.value.value, str)
            ]
            func = node.func
            callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if (
                callee in _FORWARDERS
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.append(node.args[0].value)
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def documented_events(page: Path = ROOT / "docs" / "logs.md") -> list[str]:
    """The event names in the first column of the "Event catalogue" table."""
    text = page.read_text()
    section = text.split("## Event catalogue", 1)[1]
    # The catalogue is the first table of the section: up to its first
    # blank line after the header row.
    table = section[section.index("| Event |") :].split("\n\n", 1)[0]
    names: list[str] = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        names.extend(re.findall(r"`([a-z_]+)`", first_cell))
    return names


class EventCatalogueTests(SynchronousTestCase):
    def test_scanner_sees_forwarded_events(self) -> None:
        """
        The scan finds events named through a forwarding helper, not only
        C{kcoral_event=} keywords (otherwise the comparison below is weaker
        than it looks).
        """
        events = emitted_events()
        self.assertIn("lease_granted", events)
        self.assertIn("cache_hit", events)
        self.assertIn("request_finished", events)

    def test_catalogue_lists_each_event_once(self) -> None:
        """No event has two rows."""
        names = documented_events()
        self.assertEqual(sorted(names), sorted(set(names)))

    def test_every_emitted_event_is_documented(self) -> None:
        """An event the code emits has a row in docs/logs.md."""
        missing = {
            name: sorted(files)
            for name, files in emitted_events().items()
            if name not in documented_events()
        }
        self.assertEqual(missing, {}, "add these events to docs/logs.md's catalogue")

    def test_every_documented_event_is_emitted(self) -> None:
        """docs/logs.md lists no event that the code never emits."""
        phantoms = sorted(set(documented_events()) - set(emitted_events()))
        self.assertEqual(phantoms, [], "docs/logs.md lists events the code never emits")
