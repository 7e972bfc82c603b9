#!/usr/bin/env bash
# Where one sequential null request's time goes, on this machine: kcoral in
# reuse mode (8 workers, --sandbox none) under each configuration of
# CONFIGS, timed by bench/null_program.py (the client's wall clock beside the
# server's queue/elapsed/lease numbers) and by the reference client
# (bench/ref_driver.py null, sequential only); the stub floor first.  Comparing
# a GPU server with a CPU server on the same machine isolates what the GPU
# worker adds; the other configurations switch one mechanism off.
#
#     (device run, carry [".gpu", ".ref"]):
#     . .gpu/activate.sh && bash bench/probes/seq_probe.sh
#
# Environment: PYTHON (python3), REF_SITE (/opt/kcoral-ref), SEQUENTIAL (300),
# CONFIGS (space-separated NAME=ENV:FLAGS, "," for a space in either part).
# Results: bench/results/seq_probe_*.json (and $OUT when set).
set -u
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
REF_SITE=${REF_SITE:-/opt/kcoral-ref}
SEQUENTIAL=${SEQUENTIAL:-300}
GPU_FLAGS="--device,gpu,--gpus,0,--workers-per-gpu,8"
CONFIGS=${CONFIGS:-"gpu=:$GPU_FLAGS cpu=:--device,cpu,--num-workers,8 \
gpu-eager-module-lease=KCORAL_LAZY_MODULE_LEASE=0:$GPU_FLAGS"}
RESULTS=bench/results
mkdir -p "$RESULTS"

# shellcheck source=bench/server_lib.sh
. bench/server_lib.sh

ensure_reference_site

reference_client() {
    env -u PYTHONHOME PYTHONPATH="$REF_SITE" "$PY" bench/ref_driver.py null \
        --sequential "$SEQUENTIAL" --clients 1 --seconds 2 --warmup-seconds 1 \
        --url "http://127.0.0.1:$PORT" --label "$1" --output "$RESULTS/seq_probe_$1_ref.json" |
        grep -E "sequential|rps"
}

PORT=$(free_port)
env -u PYTHONPATH "$PY" bench/stub_server.py --port "$PORT" --gpus 1 >"$RESULTS/seq_probe_stub.log" 2>&1 &
SERVER_PID=$!
if wait_capacity stub 1 30 "$RESULTS/seq_probe_stub.log"; then
    echo "== stub"
    reference_client stub
fi
stop_server

for config in $CONFIGS; do
    name=${config%%=*}
    rest=${config#*=}
    environment=${rest%%:*}
    flags=${rest#*:}
    PORT=$(free_port)
    log="$RESULTS/seq_probe_$name.log"
    # shellcheck disable=SC2086
    env ${environment//,/ } "$PY" -m kcoral server ${flags//,/ } --sandbox none --log-dir '' \
        --host 127.0.0.1 --port "$PORT" --max-requests-per-worker 0 >"$log" 2>&1 &
    SERVER_PID=$!
    if wait_capacity "$name" 8 120 "$log"; then
        echo "== $name (${environment:-default environment})"
        "$PY" bench/null_program.py --url "http://127.0.0.1:$PORT" --sequential "$SEQUENTIAL" \
            --requests 0 --label "$name" --output "$RESULTS/seq_probe_$name.json" | sed -n '/^sequential/,/^concurrency/p' | grep -v '^concurrency'
        reference_client "$name"
    fi
    stop_server
done
if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/seq_probe_*.json "$OUT"/ 2>/dev/null
fi
