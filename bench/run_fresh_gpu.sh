#!/usr/bin/env bash
# Fresh-worker mode (issue 14), kcoral with --sandbox none, kcoral with
# --sandbox bubblewrap and the reference 0.1.1 server, one after the other,
# each driven through the reference client by bench/fresh_load.py (null
# programs at 8 clients, open loop at 3/s, copy bandwidth idle and while
# workers are replaced around it); then bench/lease_overlap.py on each
# kcoral run's events.jsonl, and one table with ratios and the targets.
# For the GPU machine:
#
#     ../shared/gpu/prepare.sh && mkdir -p .ref && cp ../shared/ref/wheels/*.whl .ref/
#     (device run, carry [".gpu", ".ref"], timeout 600):
#     . .gpu/activate.sh && bash bench/run_fresh_gpu.sh
#
# Every server: one GPU ($GPU), $WORKERS workers, --max-requests-per-worker 1.
# kcoral keeps its default warm spares (SPARES=... to set them).  The driver
# runs with PYTHONPATH=$REF_SITE alone (the reference client; ours is also
# named kcoral); the reference is installed there from .ref/*.whl when
# missing.  Results: bench/results/fresh_* (and $OUT when set).  About 7
# minutes; BUDGET (460 s) caps it.  Environment: PYTHON (python3), DRIVER_PYTHON
# (PYTHON), GPU (0),
# WORKERS (8), SPARES (kcoral's default), REF_SITE (/opt/kcoral-ref),
# ONLY ("none bubblewrap reference"), LOAD_ARGS (appended to fresh_load.py),
# DEVICE_FLAGS (replaces the device flags; a CPU dry run of the plumbing:
# DEVICE_FLAGS="--device cpu --num-workers 2" WORKERS=2 ONLY="none"
# LOAD_ARGS="--workloads null8,open3").
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# The driver's interpreter (its PYTHONPATH is $REF_SITE alone).
DRIVER_PY=${DRIVER_PYTHON:-$PY}
REF_PY=$PY
case $REF_PY in */*) REF_PY="$(cd "$(dirname "$REF_PY")" && pwd)/$(basename "$REF_PY")" ;; esac
GPU=${GPU:-0}
WORKERS=${WORKERS:-8}
REF_SITE=${REF_SITE:-/opt/kcoral-ref}
BUDGET=${BUDGET:-460}
ONLY=${ONLY:-"none bubblewrap reference"}
DEVICE_FLAGS=${DEVICE_FLAGS:-"--device gpu --gpus $GPU --workers-per-gpu $WORKERS"}
SPARE_FLAGS=""
[ -n "${SPARES:-}" ] && SPARE_FLAGS="--spare-workers-per-gpu $SPARES"
RESULTS=bench/results
START=$(date +%s)
mkdir -p "$RESULTS"
rm -rf "$RESULTS"/fresh_*

# shellcheck source=bench/server_lib.sh
. bench/server_lib.sh

# wait_ready NAME WANT_CAPACITY LIMIT_S (bench/server_lib.sh's wait_capacity)
wait_ready() {
    wait_capacity "$1" "$2" "$3" "$RESULTS/fresh_$1.log"
}

# drive NAME [extra fresh_load args]
drive() {
    local name=$1 left
    shift
    left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -lt 40 ]; then
        echo "!! $name not driven: the budget of $BUDGET s is spent"
        return 1
    fi
    echo "== driving $name (elapsed $(( $(date +%s) - START )) s)"
    # shellcheck disable=SC2086
    env -u PYTHONHOME PYTHONPATH="$REF_SITE" timeout --signal=INT --kill-after=10 "$left" \
        "$DRIVER_PY" bench/fresh_load.py --url "http://127.0.0.1:$PORT" --label "$name" \
        --output "$RESULTS/fresh_$name.json" "$@" ${LOAD_ARGS:-}
}

echo "== fresh workers: $ONLY  ($(date -u +%FT%TZ))"
ensure_reference_site

for name in $ONLY; do
    PORT=$(free_port)
    log="$RESULTS/fresh_$name.log"
    case $name in
    none | bubblewrap)
        logdir="$RESULTS/fresh_logs_$name"
        # shellcheck disable=SC2086
        "$PY" -m kcoral server $DEVICE_FLAGS $SPARE_FLAGS --sandbox "$name" \
            --max-requests-per-worker 1 --log-dir "$logdir" --no-log-console \
            --host 127.0.0.1 --port "$PORT" >"$log" 2>&1 &
        SERVER_PID=$!
        wait_ready "$name" "$WORKERS" 150 && drive "$name"
        stop_server
        events=$(find "$logdir" -name 'events.jsonl*' 2>/dev/null | sort -r | tr '\n' ' ')
        if [ -n "$events" ]; then
            # shellcheck disable=SC2086
            "$PY" bench/lease_overlap.py $events --output "$RESULTS/fresh_overlap_$name.json" \
                | tee "$RESULTS/fresh_overlap_$name.txt"
        else
            echo "!! $name: no events.jsonl under $logdir"
        fi
        ;;
    reference)
        refdir=$(mktemp -d)
        # shellcheck disable=SC2086
        (cd "$refdir" && exec env TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONPATH="$REF_SITE" \
            "$REF_PY" -P -m kcoral server $DEVICE_FLAGS --max-requests-per-worker 1 \
            --sandbox none --host 127.0.0.1 --port "$PORT" --log-dir "$refdir/logs") \
            >"$log" 2>&1 &
        SERVER_PID=$!
        # The reference replaces a worker in about 6 s: fewer copies under churn.
        wait_ready reference "$WORKERS" 150 && drive reference --open-seconds 10 --copy-runs 3
        stop_server
        ;;
    *)
        echo "!! unknown server '$name' in ONLY"
        ;;
    esac
done

echo
echo "== fresh workers (took $(( $(date +%s) - START )) s)"
"$PY" bench/fresh_table.py "$RESULTS" --output "$RESULTS/fresh_table.json" \
    | tee "$RESULTS/fresh_table.txt"
if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/fresh_*.json "$RESULTS"/fresh_*.txt "$OUT"/ 2>/dev/null
    for name in $ONLY; do tail -n 200 "$RESULTS/fresh_$name.log" >"$OUT/fresh_$name.log" 2>/dev/null; done
fi
