#!/usr/bin/env bash
# The interop suite (tests/integration/test_interop.py: the reference client
# 0.1.1 and ours) against GPU servers with fresh workers, on the GPU machine,
# which has no network: the reference client's virtualenv is made from the
# wheels in .ref/ (../shared/ref/wheels) over the machine's own packages
# (numpy, ml_dtypes), instead of from PyPI.
#
#     (device run, carry [".gpu", ".ref"]):
#     . .gpu/activate.sh && bash tests/gpu/run_interop.sh [pytest args...]
#
# Environment: PYTHON (python3), REFCLIENT_VENV (a fresh temporary
# directory), KCORAL_INTEROP_GPUS (0).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
VENV=${REFCLIENT_VENV:-$(mktemp -d)/refclient}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile \
        .ref/kcoral-0.1.1-*.whl
    # The client's dependencies (httpx, numpy, ml_dtypes) come from this
    # interpreter's environment (the prepared GPU environment is a
    # virtualenv, not the system's site): its directories in a .pth file,
    # less any that holds a kcoral package (ours must not leak in).
    "$PY" - "$VENV" <<'EOF'
import glob
import os
import sys

venv = sys.argv[1]
dirs = [
    d for d in sys.path
    if d and os.path.isdir(d) and os.path.abspath(d) != os.getcwd()
    and not os.path.exists(os.path.join(d, "kcoral", "__init__.py"))
]
(site,) = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
with open(os.path.join(site, "kcoral-interop-deps.pth"), "w") as f:
    f.write("\n".join(dirs) + "\n")
EOF
    # What tests/integration/refclient.py checks before it uses a virtualenv.
    "$PY" - "$VENV" <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, ".")
from tests.integration.refclient import _MARKER, REQUIREMENTS

Path(sys.argv[1], _MARKER).write_text(" ".join(REQUIREMENTS))
EOF
fi
export KCORAL_REFCLIENT_VENV=$VENV
export KCORAL_INTEROP_DEVICE=gpu
exec "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_interop.py "$@"
