# -*- test-case-name: tests.integration.test_sandbox_pythonpath -*-
"""
A bubblewrap server whose packages come from PYTHONPATH (for example
C{pip install --target DIR}) starts its workers, and they import from there
(issue 17, item 7).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kcoral.testing.live_server import ServerProcess, post_program

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]

PROGRAM = {
    "instructions": [
        {
            "op": "upload",
            "kind": "module",
            "id": "m",
            "source": "import h17_target_module\ndef f():\n    return h17_target_module.VALUE\n",
        },
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": []},
        {"op": "return", "key": "r", "value": {"$ref": "r"}},
    ]
}


def test_pythonpath_packages_reach_sandboxed_workers(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "h17_target_module.py").write_text("VALUE = 'imported from PYTHONPATH'\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(target)
    args = ["--device", "cpu", "--sandbox", "bubblewrap", "--log-dir", "", "--disk-cache-dir", ""]
    with ServerProcess(args, env=env, log_path=tmp_path / "server.log") as server:
        health = server.health()
        assert health["sandbox"] == "bubblewrap", (tmp_path / "server.log").read_text()
        body = post_program(server.port, PROGRAM).json()
    assert body["status"] == "COMPLETED", body
    assert body["results"]["r"]["value"] == "imported from PYTHONPATH"
