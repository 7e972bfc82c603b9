#!/usr/bin/env bash
# kcoral developer entry point.
#   ./dev.sh serve   install everything, then start a CPU server on 127.0.0.1:8000
#   ./dev.sh test    install everything, then run lint, type checks, the docs build and the tests
#   ./dev.sh install only install (system packages when root, then .venv)
set -euo pipefail
cd "$(dirname "$0")"

VENV=${KCORAL_VENV:-.venv}
PY=${PYTHON:-python3}

system_packages() {
    # bubblewrap isolates workers; chromium renders /status in a test;
    # haproxy balances two nodes in tests/integration/test_haproxy.py;
    # openssl makes the certificates and curl drives the server in the TLS
    # tests (test_client_tls.py, test_auth_listen.py); nats-server carries a
    # pool's control traffic in the gateway and node-join tests
    # (kcoral/testing/nats.py).
    local wanted=(bubblewrap)
    [ "${1:-}" = test ] && wanted+=(chromium haproxy openssl curl nats-server)
    local missing=()
    for pkg in "${wanted[@]}"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    $PY -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "installing system packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

python_packages() {
    [ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # nvcc from the nvidia-cuda-nvcc wheel only when the machine has none.
    local extras=server,test
    command -v nvcc >/dev/null 2>&1 || extras+=,nvcc
    # compat mode puts the checkout on sys.path, so twistd finds
    # twisted/plugins/kcoral_plugin.py; a plain `pip install -e .` hides the
    # plugin from twistd (docs/getting-started.md).
    "$VENV/bin/python" -m pip install -q -e ".[$extras]" --config-settings editable_mode=compat
}

case "${1:-}" in
    install)
        system_packages test
        python_packages
        ;;
    serve)
        shift
        system_packages
        python_packages
        exec "$VENV/bin/kcoral" server --device cpu "$@"
        ;;
    test)
        shift
        system_packages test
        python_packages
        "$VENV/bin/ruff" check kcoral tests bench examples
        "$VENV/bin/ruff" format --check kcoral tests bench examples
        "$VENV/bin/mypy" kcoral
        # The docs site: warnings (a broken link, a page outside the toctree) fail.
        "$VENV/bin/sphinx-build" -W --keep-going -q -b html docs "${TMPDIR:-/tmp}/kcoral-docs-html"
        exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
        ;;
    *)
        echo "usage: ./dev.sh {serve|test|install} [args...]" >&2
        exit 2
        ;;
esac
