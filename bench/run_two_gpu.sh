#!/usr/bin/env bash
# The two-GPU mixed load (bench/mixed_load.py) on the nvidia-h200-x2 machine:
#
#     . .gpu/activate.sh && bash bench/run_two_gpu.sh
#
# For each --max-requests-per-worker in MAX_REQUESTS (default "0 1"): starts
# `kcoral server --device gpu --gpus 0,1 --workers-per-gpu $WORKERS` in
# bubblewrap (the default sandbox) with its own log directory, waits for
# /health, runs mixed_load.py (200 requests, 16 clients; its lease-overlap
# check reads the server's events.jsonl), stops the server.  Results go to
# bench/results/mixed_load_mr<N>.json.  Environment: PYTHON (default
# python3), WORKERS (default 4), REQUESTS (default 200), MAX_SECONDS (default
# 240), EXTRA_SERVER_FLAGS (appended; e.g. "--sandbox none").
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WORKERS=${WORKERS:-4}
RESULTS=bench/results
mkdir -p "$RESULTS"
STATUS=0

readonly_flags() {
    # PyCUDA and friends installed with --target on PYTHONPATH must be
    # visible to sandboxed workers.
    local IFS=:
    for entry in ${PYTHONPATH:-}; do
        if [ -d "$entry" ] && [ ! -e "$entry/kcoral" ]; then
            printf -- '--sandbox-readonly-path %s ' "$entry"
        fi
    done
}

for mr in ${MAX_REQUESTS:-0 1}; do
    PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    LOGS=$(mktemp -d)
    echo "== max-requests $mr: server on port $PORT, logs in $LOGS"
    # shellcheck disable=SC2046
    "$PY" -m kcoral server --device gpu --gpus 0,1 --workers-per-gpu "$WORKERS" \
        --max-requests-per-worker "$mr" --log-dir "$LOGS" --host 127.0.0.1 --port "$PORT" \
        $(readonly_flags) ${EXTRA_SERVER_FLAGS:-} >"$RESULTS/server-mixed-mr$mr.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 120); do
        "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
            2>/dev/null && break
        kill -0 "$SERVER" 2>/dev/null || break
        sleep 1
    done
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "!! server exited during start:"
        tail -n 30 "$RESULTS/server-mixed-mr$mr.log"
        STATUS=1
        continue
    fi
    "$PY" bench/mixed_load.py --url "http://127.0.0.1:$PORT" --log-dir "$LOGS" \
        --requests "${REQUESTS:-200}" --max-seconds "${MAX_SECONDS:-240}" \
        --label "two GPUs, $WORKERS workers/GPU, max-requests $mr" \
        --output "$RESULTS/mixed_load_mr$mr.json" || STATUS=1
    kill -TERM "$SERVER"
    wait "$SERVER"
    rm -rf "$LOGS"
done
exit $STATUS
