# -*- test-case-name: tests.unit.test_client_install -*-
"""
Tests for L{kcoral.client.install}: the reference client (PyPI C{kcoral})
installed beside kcoral-server is found and reported in one line, by the
C{kcoral} command and, once, as a warning when the client is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from kcoral.client.install import conflict

ROOT = Path(__file__).resolve().parents[2]


def _site_with_reference() -> str:
    """A directory holding what pip leaves for kcoral 0.1.1: its dist-info."""
    site = tempfile.mkdtemp(prefix="kcoral-test-site-")
    info = Path(site) / "kcoral-0.1.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kcoral\nVersion: 0.1.1\n")
    (info / "RECORD").write_text("kcoral/__init__.py,,\n")
    return site


def _run(site: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KCORAL_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), site])
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
    )


class ConflictTests(SynchronousTestCase):
    def test_reference_found(self) -> None:
        """The reference distribution on the path gives one line that says what to do."""
        line = conflict([_site_with_reference()])
        assert line is not None
        self.assertNotIn("\n", line)
        self.assertIn("kcoral 0.1.1 (the reference client)", line)
        self.assertIn("pip uninstall -y kcoral kcoral-server", line)

    def test_alone(self) -> None:
        """Without the reference distribution there is nothing to say."""
        self.assertIsNone(conflict([tempfile.mkdtemp(prefix="kcoral-test-site-")]))

    def test_this_environment(self) -> None:
        """The test environment itself holds only kcoral-server."""
        self.assertIsNone(conflict())

    def test_command_says_it_in_one_line(self) -> None:
        """C{kcoral health} prints the line first, then goes on with its work."""
        done = _run(_site_with_reference(), "-m", "kcoral", "health", "--url", "http://127.0.0.1:1")
        lines = done.stderr.splitlines()
        self.assertTrue(lines[0].startswith("kcoral: warning: kcoral 0.1.1 (the reference client)"))
        self.assertEqual(len([x for x in lines if "reference client" in x]), 1)
        self.assertEqual(done.returncode, 1)  # nothing listens on port 1

    def test_import_warns_once(self) -> None:
        """Importing the client warns once, with L{KCoralInstallWarning}."""
        script = (
            "import warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    from kcoral import Client, AsyncClient\n"
            "    import kcoral.client.blocking\n"
            "print([(w.category.__name__, str(w.message)[:38]) for w in seen])\n"
        )
        done = _run(_site_with_reference(), "-c", script)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(
            done.stdout.strip(),
            "[('KCoralInstallWarning', 'kcoral 0.1.1 (the reference client) is')]",
        )
