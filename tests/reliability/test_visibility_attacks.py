"""
The server's own files are out of a program's sight whatever the install
(issue 13, item 5): with a log directory inside the checkout, the program
sees neither the logs nor the rest of the checkout, only the package.
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kcoral.server.sandbox.bubblewrap import PACKAGE_MOUNT, WORKSPACE
from kcoral.server.sandbox.interface import package_root
from kcoral.testing.live_server import ServerProcess
from tests.reliability.conftest import assert_serves, body_of, requires_bwrap, run_program

pytestmark = [pytest.mark.integration, requires_bwrap]

SPY = r"""
import glob
import json
import os


def spy(log_dir, checkout):
    found = {}
    inside = os.path.join(checkout, os.path.basename(log_dir))
    for path in glob.glob(os.path.join(log_dir, "**"), recursive=True) + glob.glob(
        os.path.join(inside, "**"), recursive=True
    ):
        try:
            with open(path, "rb") as f:
                found[path] = f.read(200).decode("utf-8", "replace")
        except OSError:
            pass
    try:
        listing = sorted(os.listdir(checkout))
    except OSError as e:
        listing = [type(e).__name__]
    return json.dumps({"found": found, "listing": listing})
"""


def _checkout_inside() -> str:
    """
    Where a sandboxed program finds the checkout's package directory: its own
    path, or L{PACKAGE_MOUNT} for a checkout under the workspace's C{/work}.
    """
    root = package_root()
    if root == WORKSPACE or root.startswith(WORKSPACE + "/"):
        return PACKAGE_MOUNT
    return root


@pytest.fixture(scope="module")
def log_dir() -> Iterator[Path]:
    """A log directory inside the checkout, like the default C{--log-dir logs}."""
    path = Path(package_root()) / f".reliability-logs-{uuid.uuid4().hex[:8]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_log_dir_in_checkout_invisible(log_dir: Path) -> None:
    server = ServerProcess(
        ["--device", "cpu", "--sandbox", "bubblewrap", "--num-workers", "1"]
        + ["--log-dir", str(log_dir), "--disk-cache-dir", ""]
    )
    with server:
        secret = run_program("def f():\n    return 'log-secret-77'\n", "f")
        assert body_of(server.execute(secret))["status"] == "COMPLETED"
        assert list(log_dir.glob("runs/*/events.jsonl")), "the server writes its log"
        response = server.execute(run_program(SPY, "spy", str(log_dir), _checkout_inside()))
        body = body_of(response)
        assert body["status"] == "COMPLETED", body
        seen = json.loads(body["results"]["out"]["value"])
        assert seen["found"] == {}, sorted(seen["found"])
        assert "log-secret-77" not in response.body.decode("utf-8", "replace")
        # Of the checkout, only the package is there (and the virtualenv
        # the server runs from, when it lives in the checkout).
        assert "kcoral" in seen["listing"]
        assert set(seen["listing"]) <= {"kcoral", Path(sys.prefix).name}, seen["listing"]
        assert_serves(server)
