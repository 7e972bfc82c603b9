# -*- test-case-name: tests.integration.test_interop -*-
"""
The reference KCoral client (PyPI C{kcoral==0.1.1}) in its own virtualenv,
and the same way of running our own client, so one interop suite drives both.

Its import name C{kcoral} collides with ours, so it never runs in the test
interpreter: L{ensure_venv} builds (once, outside the repository) a virtualenv
holding it, and L{run_client} / L{kcoral_cli} run code in that virtualenv
with an isolated interpreter (C{-I}), no C{PYTHONPATH} and a temporary
working directory, so our package cannot leak in.

The virtualenv lives in C{~/.cache/kcoral-tests/refclient-0.1.1} unless
C{KCORAL_REFCLIENT_VENV} names another directory. A marker file records the
installed version; a virtualenv without it is rebuilt.

L{ensure_server_venv} builds a second one, C{refserver-0.1.1}
(C{KCORAL_REFSERVER_VENV}), that can also run the reference I{server} on a
CPU: the package with the two server extras its CPU path imports (FastAPI,
uvicorn) and none of the GPU ones (torch, TVM, CUTLASS), so the side-by-side
benchmark's CI form can measure it beside ours.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import venv
from collections.abc import Mapping, Sequence
from pathlib import Path

REFCLIENT_VERSION = "0.1.1"
REQUIREMENTS = (f"kcoral=={REFCLIENT_VERSION}", "numpy", "ml_dtypes")
#: The reference server on a CPU: what its C{server} extra lists, less the GPU stack.
SERVER_REQUIREMENTS = (*REQUIREMENTS, "fastapi>=0.110", "uvicorn>=0.29")
_MARKER = ".kcoral-refclient"


class RefClientUnavailable(Exception):
    """The reference client's virtualenv could not be built."""


def venv_dir(kind: str = "refclient") -> Path:
    override = os.environ.get(f"KCORAL_{kind.upper()}_VENV")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "kcoral-tests" / f"{kind}-{REFCLIENT_VERSION}"


def _python(root: Path) -> Path:
    return root / "bin" / "python"


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "KCORAL_", "VIRTUAL_ENV", "PIP_REQUIRE"))
    }
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def ensure_venv() -> Path:
    """
    Build the client's virtualenv if needed and return its root.

    @raise RefClientUnavailable: when it cannot be built (no PyPI, say).
    """
    return _ensure(venv_dir(), REQUIREMENTS)


def ensure_server_venv() -> Path:
    """
    Build the virtualenv that also runs the reference server on a CPU
    (C{python -I -m kcoral server --device cpu ...}) and return its root.

    @raise RefClientUnavailable: when it cannot be built.
    """
    return _ensure(venv_dir("refserver"), SERVER_REQUIREMENTS)


def _ensure(root: Path, requirements: Sequence[str]) -> Path:
    marker = root / _MARKER
    wanted = " ".join(requirements)
    if marker.is_file() and marker.read_text() == wanted and _python(root).exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(root)
        subprocess.run(
            [
                str(_python(root)),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                *requirements,
            ],
            env=_clean_env(),
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        shutil.rmtree(root, ignore_errors=True)
        raise RefClientUnavailable(
            f"cannot build the kcoral {REFCLIENT_VERSION} virtualenv: {e} "
            f"{detail.decode(errors='replace')[-2000:]}"
        ) from e
    marker.write_text(wanted)
    return root


def _run(
    argv: Sequence[str],
    env: Mapping[str, str] | None,
    timeout: float,
    cwd: str | os.PathLike[str] | None,
    script: str | None = None,
) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="kcoral-refclient-") as tmp:
        argv = list(argv)
        if script is not None:
            # A file, not -c: remote functions need inspect.getsource().
            path = Path(tmp, "refclient_script.py")
            path.write_text(script)
            argv.insert(2, str(path))
        return subprocess.run(
            argv,
            env=_clean_env(env),
            cwd=cwd if cwd is not None else tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )


def run_client(
    script: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the Python source C{script} in the reference virtualenv (C{sys.argv[1:]} = C{args})."""
    python = _python(ensure_venv())
    return _run([str(python), "-I", *args], env, timeout, cwd, script=script)


def kcoral_cli(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the reference virtualenv's C{kcoral} console script."""
    root = ensure_venv()
    # The console script's shebang would run Python without -I; call it the
    # same way it does, but isolated.
    script = root / "bin" / "kcoral"
    return _run([str(_python(root)), "-I", str(script), *args], env, timeout, cwd)


def run_our_client(
    script: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run C{script} the same way, with our package (this interpreter's environment)."""
    return _run([sys.executable, "-P", *args], _our_env(env), timeout, cwd, script=script)


def our_kcoral_cli(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run our C{kcoral} command (C{python -P -m kcoral}) the same way."""
    return _run([sys.executable, "-P", "-m", "kcoral", *args], _our_env(env), timeout, cwd)


def _our_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """
    The environment for our own client: isolated like the reference's (no
    working directory on the path, no user site, no C{KCORAL_*}), but with
    this interpreter's C{PYTHONPATH} and our package's directory, which is
    how the GPU machine's environment provides both (C{-I} would drop them).
    """
    import kcoral

    root = str(Path(kcoral.__file__).resolve().parents[1])
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**(env or {}), "PYTHONPATH": os.pathsep.join([root, *inherited])}


if __name__ == "__main__":  # pragma: no cover
    print(ensure_venv())
    sys.exit(0)
