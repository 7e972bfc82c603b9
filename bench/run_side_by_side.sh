#!/usr/bin/env bash
# The stub floor, kcoral and the reference 0.1.1 server, one after the other,
# each driven by bench/ref_driver.py through the reference client; then one
# table with the ratios and issue 15's targets.  For the GPU machine:
#
#     ../shared/gpu/prepare.sh && mkdir -p .ref && cp ../shared/ref/wheels/*.whl .ref/
#     (device run, carry [".gpu", ".ref"]):
#     . .gpu/activate.sh && bash bench/run_side_by_side.sh
#
# 1. installs the reference from .ref/*.whl into $REF_SITE (/opt/kcoral-ref)
#    unless it is there already (REF_SITE=... to use another);
# 2. starts bench/stub_server.py (the floor), drives it, stops it;
# 3. starts kcoral (8 workers on GPU 0, reuse mode, --sandbox none), drives
#    it, stops it;
# 4. starts the reference server (the same), drives it, stops it;
# 5. prints bench/side_by_side_table.py's table.
#
# The driver always runs with PYTHONPATH=$REF_SITE alone (the reference
# client; ours is also named kcoral).  Results: bench/results/side_by_side_*
# (and $OUT when set, for the device tool).  About 6-8 minutes; BUDGET caps it.
# Environment: PYTHON (python3), DRIVER_PYTHON and REF_PYTHON (PYTHON), GPU (0), WORKERS (8), REF_SITE, BUDGET (480 s),
# ONLY may also name kcoral-feN: kcoral as N front ends (--front-ends N), with a
# second table in kcoral's place.
# WORKLOADS (the driver's workloads, default "null open-loop tensor overlap copy"),
# PIN_REACTOR (a CPU number: each server's main thread alone on that CPU, the
# rest of the server and the driver on the others; an experiment, reuse mode),
# DRIVER_ARGS (appended to every driver run), ONLY (e.g. "stub kcoral" to skip
# the reference), DEVICE_FLAGS and REF_DEVICE_FLAGS (replace the servers'
# device flags; a CPU dry run: DEVICE_FLAGS="--device cpu --num-workers 2"
# WORKERS=2 ONLY="stub kcoral").
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# The driver's interpreter (its PYTHONPATH is $REF_SITE alone).
DRIVER_PY=${DRIVER_PYTHON:-$PY}
# The reference server's interpreter, as an absolute path (it starts elsewhere).
REF_PY=${REF_PYTHON:-$PY}
case $REF_PY in */*) REF_PY="$(cd "$(dirname "$REF_PY")" && pwd)/$(basename "$REF_PY")" ;; esac
GPU=${GPU:-0}
WORKERS=${WORKERS:-8}
REF_SITE=${REF_SITE:-/opt/kcoral-ref}
BUDGET=${BUDGET:-480}
ONLY=${ONLY:-"stub kcoral reference"}
DEVICE_FLAGS=${DEVICE_FLAGS:-"--device gpu --gpus $GPU --workers-per-gpu $WORKERS"}
REF_DEVICE_FLAGS=${REF_DEVICE_FLAGS:-"--device gpu --gpus $GPU --workers-per-gpu $WORKERS"}
RESULTS=bench/results
START=$(date +%s)
SERVER_PID=""
mkdir -p "$RESULTS"
rm -f "$RESULTS"/side_by_side_*.json

# The driver's workloads and sizes (about 70-100 s a server on the H200).
DRIVER_DEFAULTS="${WORKLOADS:-null open-loop tensor overlap copy} --seconds 4 --warmup-seconds 1 \
--sequential 200 --clients 1,8,32,64 --rates 50,100,150 --iterations 5 \
--overlap-clients 8,16"

# shellcheck source=bench/server_lib.sh
. bench/server_lib.sh

# wait_ready NAME WANT_CAPACITY LIMIT_S (bench/server_lib.sh's wait_capacity)
wait_ready() {
    wait_capacity "$1" "$2" "$3" "$RESULTS/side_by_side_$1.log"
}

# drive NAME: runs the driver against 127.0.0.1:$PORT
drive() {
    local name=$1 left
    left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -lt 30 ]; then
        echo "!! $name not driven: the budget of $BUDGET s is spent"
        return 1
    fi
    echo "== driving $name (elapsed $(( $(date +%s) - START )) s)"
    local pin=()
    if [ -n "${PIN_REACTOR:-}" ]; then
        pin=(taskset -c "$(pin_reactor "$PIN_REACTOR")")
        echo "   $name's main thread on CPU $PIN_REACTOR; the rest and the driver on ${pin[2]}"
    fi
    # shellcheck disable=SC2086
    "${pin[@]}" env -u PYTHONHOME PYTHONPATH="$REF_SITE" timeout --signal=INT --kill-after=10 "$left" \
        "$DRIVER_PY" bench/ref_driver.py $DRIVER_DEFAULTS ${DRIVER_ARGS:-} \
        --url "http://127.0.0.1:$PORT" --label "$name" --server-pid "$SERVER_PID" \
        --output "$RESULTS/side_by_side_$name.json"
}

echo "== side by side: $ONLY  ($(date -u +%FT%TZ))"
ensure_reference_site

for name in $ONLY; do
    PORT=$(free_port)
    log="$RESULTS/side_by_side_$name.log"
    case $name in
    stub)
        env -u PYTHONPATH "$PY" bench/stub_server.py --port "$PORT" --gpus 1 >"$log" 2>&1 &
        SERVER_PID=$!
        wait_ready stub 1 30 && drive stub
        ;;
    kcoral)
        # shellcheck disable=SC2086
        "$PY" -m kcoral server $DEVICE_FLAGS --sandbox none --log-dir '' --host 127.0.0.1 \
            --port "$PORT" --max-requests-per-worker 0 >"$log" 2>&1 &
        SERVER_PID=$!
        wait_ready kcoral "$WORKERS" 120 && drive kcoral
        ;;
    kcoral-fe[0-9]*)
        # kcoral again, as ${name#kcoral-fe} front ends sharing the port and the lease.
        # shellcheck disable=SC2086
        "$PY" -m kcoral server $DEVICE_FLAGS --front-ends "${name#kcoral-fe}" --sandbox none \
            --log-dir '' --host 127.0.0.1 --port "$PORT" --max-requests-per-worker 0 >"$log" 2>&1 &
        SERVER_PID=$!
        wait_ready "$name" "$WORKERS" 180 && wait_front_ends "$name" "${name#kcoral-fe}" 60 \
            && drive "$name"
        ;;
    reference)
        # shellcheck disable=SC2086
        # From a directory of its own and with -P: `python -m` would otherwise
        # find this checkout's kcoral first (the current directory leads sys.path).
        refdir=$(mktemp -d)
        reflogs="$PWD/$RESULTS/reflogs"
        (cd "$refdir" && exec env TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONPATH="$REF_SITE" \
            "$REF_PY" -P -m kcoral server $REF_DEVICE_FLAGS --max-requests-per-worker 0 \
            --sandbox none --host 127.0.0.1 --port "$PORT" --log-dir "$reflogs") \
            >"$log" 2>&1 &
        SERVER_PID=$!
        wait_ready reference "$WORKERS" 150 && drive reference
        ;;
    *)
        echo "!! unknown server '$name' in ONLY"
        ;;
    esac
    stop_server
done

echo
echo "== side by side (took $(( $(date +%s) - START )) s); floor = the stub"
"$PY" bench/side_by_side_table.py "$RESULTS/side_by_side_stub.json" \
    "$RESULTS/side_by_side_kcoral.json" "$RESULTS/side_by_side_reference.json" \
    --output "$RESULTS/side_by_side_table.json" | tee "$RESULTS/side_by_side_table.txt"
for name in $ONLY; do
    case $name in
    kcoral-fe[0-9]*)
        echo
        echo "== $name in kcoral's place"
        "$PY" bench/side_by_side_table.py "$RESULTS/side_by_side_stub.json" \
            "$RESULTS/side_by_side_$name.json" "$RESULTS/side_by_side_reference.json" \
            --output "$RESULTS/side_by_side_table_$name.json" | tee -a "$RESULTS/side_by_side_table.txt"
        ;;
    esac
done
if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/side_by_side_*.json "$RESULTS"/side_by_side_table.txt "$OUT"/ 2>/dev/null
    for name in $ONLY; do tail -n 200 "$RESULTS/side_by_side_$name.log" >"$OUT/side_by_side_$name.log" 2>/dev/null; done
fi
