#!/usr/bin/env bash
# Where a GPU hold's time goes beyond its kernel (bench/handover_probe.py),
# against kcoral in reuse mode (8 workers on GPU 0, --sandbox none, no log
# directory, as in run_side_by_side.sh) under each configuration of CONFIGS:
# one mechanism switched off at a time, each on a server of its own, one
# after the other.
#
#     (device run, carry [".gpu", ".ref"]):
#     . .gpu/activate.sh && bash bench/handover_probe.sh
#
# Environment: PYTHON (python3), CLIENTS (8), SECONDS_EACH (8), DEVICE_FLAGS
# ("--device gpu --gpus 0 --workers-per-gpu 8"), CONFIGS (space-separated
# NAME=ENV, "," for a space in ENV).
# Results: bench/results/handover_probe_*.json (and $OUT when set).
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEVICE_FLAGS=${DEVICE_FLAGS:-"--device gpu --gpus 0 --workers-per-gpu 8"}
CONFIGS=${CONFIGS:-"default= eager-run-lease=KCORAL_LAZY_RUN_LEASE=0"}
RESULTS=bench/results
mkdir -p "$RESULTS"

# shellcheck source=bench/server_lib.sh
. bench/server_lib.sh

workers=$(echo "$DEVICE_FLAGS" | sed -n 's/.*--\(workers-per-gpu\|num-workers\) \([0-9]*\).*/\2/p')
for config in $CONFIGS; do
    name=${config%%=*}
    environment=${config#*=}
    PORT=$(free_port)
    log="$RESULTS/handover_probe_$name.log"
    # shellcheck disable=SC2086
    env ${environment//,/ } "$PY" -m kcoral server $DEVICE_FLAGS --sandbox none --log-dir '' \
        --host 127.0.0.1 --port "$PORT" --max-requests-per-worker 0 >"$log" 2>&1 &
    SERVER_PID=$!
    if wait_capacity "$name" "${workers:-8}" 120 "$log"; then
        echo "== $name (${environment:-default environment})"
        "$PY" bench/handover_probe.py --url "http://127.0.0.1:$PORT" \
            --clients "${CLIENTS:-8}" \
            --seconds "${SECONDS_EACH:-8}" --label "$name" \
            --output "$RESULTS/handover_probe_$name.json" | grep -v '^wrote'
    fi
    stop_server
done
if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/handover_probe_*.json "$OUT"/ 2>/dev/null
fi
