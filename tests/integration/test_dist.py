# -*- test-case-name: tests.integration.test_dist -*-
"""
The sdist and the wheel built from it hold what an operator needs: the
LICENSE, every package, the twistd plugin, and contrib/ (tac files, systemd
units, HAProxy configuration) as package data under C{kcoral/contrib}.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _files(top: str) -> set[str]:
    """Files under C{top} of the checkout, relative to the checkout."""
    return {
        str(p.relative_to(ROOT))
        for p in (ROOT / top).rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix != ".pyc"
        # Twisted's plugin cache, written at run time (gitignored).
        and p.name != "dropin.cache"
    }


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the sdist, then the wheel from the sdist (as pip would)."""
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_sdist_contents(dist: Path) -> None:
    """The sdist carries the LICENSE, all of contrib/, docs/ and the sources."""
    (sdist,) = dist.glob("kcoral_server-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for required in ("LICENSE", "README.md", "setup.cfg", "pyproject.toml", "dev.sh"):
        assert required in names
    expected = _files("contrib") | _files("docs") | _files("kcoral") | _files("twisted")
    expected = {name for name in expected if not name.startswith("docs/_build/")}
    assert sorted(expected - names) == []


def test_wheel_contents(dist: Path) -> None:
    """
    The wheel has every module, the plugin, the LICENSE and contrib/ as
    package data, and no tests.
    """
    (wheel,) = dist.glob("kcoral_server-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    modules = {name for name in _files("kcoral") if name.endswith(".py")}
    assert sorted(modules - names) == []
    assert "twisted/plugins/kcoral_plugin.py" in names
    assert "twisted/plugins/__init__.py" not in names
    contrib = {"kcoral/" + name for name in _files("contrib")}
    assert sorted(contrib - names) == []
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    assert "License-Expression: Apache-2.0" in text or "License: Apache-2.0" in text
    # Every endpoint needs only the server extra; nvcc is its own extra.
    assert 'Requires-Dist: prometheus_client>=0.20; extra == "server"' in text.replace(
        "prometheus-client", "prometheus_client"
    )
    assert 'extra == "nvcc"' in text
