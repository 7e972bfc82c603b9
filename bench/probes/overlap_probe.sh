#!/usr/bin/env bash
# Where the overlap workload's GPU time goes: kcoral (8 workers on GPU 0,
# reuse mode, --sandbox none, an events log) driven by bench/ref_driver.py
# overlap through the reference client; then, from the server's own
# lease_granted / lease_released events, how long each request held the GPU
# and how long the GPU sat unheld between a release and the next grant while
# someone waited (bench/probes/overlap_gaps.py), and bench/lease_overlap.py's phase
# split.
#
#     (device run, carry [".gpu", ".ref"]):
#     . .gpu/activate.sh && bash bench/probes/overlap_probe.sh
#
# Environment: PYTHON (python3), REF_SITE (/opt/kcoral-ref), CLIENTS (8),
# SECONDS_EACH (6), SERVER_ENV (extra environment for the server, "," for a space).
# Results: bench/results/overlap_probe_* (and $OUT when set).
set -u
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
REF_SITE=${REF_SITE:-/opt/kcoral-ref}
RESULTS=bench/results
LOGS=$(mktemp -d)
mkdir -p "$RESULTS"

# shellcheck source=bench/server_lib.sh
. bench/server_lib.sh

ensure_reference_site

PORT=$(free_port)
log="$RESULTS/overlap_probe_server.log"
# shellcheck disable=SC2086
env ${SERVER_ENV:+${SERVER_ENV//,/ }} "$PY" -m kcoral server --device gpu --gpus 0 --workers-per-gpu 8 \
    --sandbox none --log-dir "$LOGS" --host 127.0.0.1 --port "$PORT" \
    --max-requests-per-worker 0 >"$log" 2>&1 &
SERVER_PID=$!
wait_capacity kcoral 8 120 "$log" || exit 1
env -u PYTHONHOME PYTHONPATH="$REF_SITE" "$PY" bench/ref_driver.py overlap \
    --overlap-clients "${CLIENTS:-8}" --seconds "${SECONDS_EACH:-6}" \
    --url "http://127.0.0.1:$PORT" --output "$RESULTS/overlap_probe_driver.json" | grep overlap
stop_server
events=$(find "$LOGS" -name events.jsonl | sort)
# shellcheck disable=SC2086
"$PY" bench/probes/overlap_gaps.py $events --output "$RESULTS/overlap_probe_gaps.json"
# shellcheck disable=SC2086
"$PY" bench/lease_overlap.py $events --output "$RESULTS/overlap_probe_phases.json" | tail -n 12
if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/overlap_probe_*.json "$OUT"/ 2>/dev/null
fi
rm -rf "$LOGS"
