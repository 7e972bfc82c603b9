# -*- test-case-name: tests.integration.test_docs_run -*-
"""
Every Python block of the README and the docs runs, against a real CPU
server, or says why it cannot.

A fenced C{```python} block runs unless its first line is a comment that
starts with C{# illustration} (an interface sketch, a fragment, or a block
that needs a GPU server or a certificate CI does not have); the rest of
that comment says why.  Each block runs alone, as a file, in a fresh
interpreter with this checkout's C{kcoral}, in an empty temporary
directory, with every C{http://127.0.0.1:PORT} (or C{localhost}) rewritten
to the test server's address.  A failure names the file and line of the
block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from kcoral.testing.live_server import ServerProcess

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]

#: The pages whose Python blocks are checked.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))

#: The first line of a block that is not run.
ILLUSTRATION = "# illustration"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_URL = re.compile(r"https?://(?:127\.0\.0\.1|localhost):\d+")


@attrs.frozen
class Block:
    """One fenced Python block: where it is and its source."""

    page: Path
    line: int
    source: str

    @property
    def where(self) -> str:
        """C{docs/client.md:83}: the page, relative to the checkout, and the fence's line."""
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def illustration(self) -> bool:
        first = self.source.lstrip("\n").split("\n", 1)[0]
        return first.strip().startswith(ILLUSTRATION)


def python_blocks(text: str, page: Path) -> Iterator[Block]:
    """The C{```python} blocks of C{text} (Markdown), with the line of each fence."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        language = opening.group("info").strip().split(" ", 1)[0].strip("{}")
        body = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (
                closing is not None
                and closing.group("fence").startswith(fence)
                and not closing.group("info").strip()
            ):
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        if language == "python":
            yield Block(page, i + 1, "\n".join(body) + "\n")
        i = j + 1


def _all_blocks() -> list[Block]:
    return [block for page in PAGES for block in python_blocks(page.read_text(), page)]


BLOCKS = _all_blocks()


def test_blocks_found() -> None:
    """The pages have Python blocks, most of which run (the extraction works)."""
    assert any(b.page.name == "README.md" for b in BLOCKS)
    runnable = [b for b in BLOCKS if not b.illustration]
    assert len(runnable) >= 5, [b.where for b in runnable]


def test_extraction() -> None:
    """Fences of any length or indent; other languages and unclosed text left out."""
    text = "\n".join(
        [
            "```sh",
            "echo no",
            "```",
            "  ```python",
            "  print(1)",
            "  ```",
            "````python",
            "```python",
            "````",
            "```python",
            "# illustration: a sketch",
            "x(",
            "```",
        ]
    )
    blocks = list(python_blocks(text, ROOT / "README.md"))
    assert [(b.line, b.source, b.illustration) for b in blocks] == [
        (4, "print(1)\n", False),
        (7, "```python\n", False),
        (10, "# illustration: a sketch\nx(\n", True),
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("docs-server")
    process = ServerProcess(
        [
            "--device",
            "cpu",
            "--num-workers",
            "2",
            "--max-requests-per-worker",
            "0",
            "--sandbox",
            "none",
            "--log-dir",
            "",
            "--disk-cache-dir",
            str(tmp / "files"),
        ],
        log_path=tmp / "server.log",
    )
    with process:
        yield process


def _environment() -> dict[str, str]:
    """This interpreter's environment with this checkout first on the path, no KCORAL_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KCORAL_", "PYTHON"))}
    inherited = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + inherited if inherited else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.illustration], ids=lambda b: b.where)
def test_block_runs(block: Block, server: ServerProcess, tmp_path: Path) -> None:
    """The block runs to its end against the CPU server (its URLs pointed there)."""
    source = _URL.sub(f"http://127.0.0.1:{server.port}", block.source)
    script = tmp_path / "block.py"
    # Blank lines first: a traceback's line numbers are the page's.
    script.write_text("\n" * block.line + source)
    try:
        done = subprocess.run(
            [sys.executable, "-P", str(script)],
            cwd=tmp_path,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: did not finish in 300 s")
    if done.returncode != 0:
        pytest.fail(
            f"{block.where}: exit status {done.returncode} (mark it '{ILLUSTRATION}: why' "
            f"if it cannot run in CI)\n{done.stderr[-3000:]}",
            pytrace=False,
        )
