#!/usr/bin/env bash
# The GPU evidence batch in one command, for the GPU machine:
#
#     . .gpu/activate.sh && bash bench/run_all_gpu.sh
#
# 1. starts a GPU server with --max-requests-per-worker 1 (a fresh worker per
#    request, the reference default); runs null_program and overlap; stops it;
# 2. starts one with --max-requests-per-worker 0 (workers reused); runs
#    null_program, overlap, tensor_roundtrip and benchmark_accuracy; stops it;
# 3. prints every JSON result.
#
# The servers run one after the other (never both), each on its own free
# port.  Results go to bench/results/ (server logs too).  Environment:
# PYTHON (default python3), GPU (default 0), WORKERS (default 8),
# EXTRA_SERVER_FLAGS (appended to both servers' flags), DEVICE_FLAGS (replaces
# "--device gpu --gpus $GPU --workers-per-gpu $WORKERS"; a dry run of this
# script on a CPU machine: DEVICE_FLAGS="--device cpu --num-workers 2" WORKERS=2).
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
GPU=${GPU:-0}
WORKERS=${WORKERS:-8}
RESULTS=bench/results
DEVICE_FLAGS=${DEVICE_FLAGS:-"--device gpu --gpus $GPU --workers-per-gpu $WORKERS"}
NAMES="null_program_mr1 overlap_mr1 null_program_mr0 overlap_mr0 tensor_roundtrip benchmark_accuracy"
mkdir -p "$RESULTS"
for name in $NAMES; do rm -f "$RESULTS/$name.json"; done
BATCH_START=$(date +%s)
# Hard budget of the whole batch in seconds: a benchmark gets at most what is
# left of it (and is skipped when under 20 s remain).
BATCH_BUDGET=${BATCH_BUDGET:-450}
SERVER_PID=""
FAILED=()

# shellcheck source=bench/server_lib.sh
. bench/server_lib.sh

# start_server NAME MAX_REQUESTS: sets PORT and SERVER_PID, waits for /health
start_server() {
    local name=$1 max_requests=$2
    PORT=$(free_port)
    local log="$RESULTS/server-$name.log"
    echo "== starting server '$name' ($DEVICE_FLAGS, --max-requests-per-worker $max_requests) on port $PORT; log $log"
    # shellcheck disable=SC2086
    "$PY" -m kcoral server $DEVICE_FLAGS \
        --sandbox none --log-dir '' --host 127.0.0.1 --port "$PORT" \
        --max-requests-per-worker "$max_requests" ${EXTRA_SERVER_FLAGS:-} >"$log" 2>&1 &
    SERVER_PID=$!
    local started=$(date +%s)
    # /health answers once the listener is up; wait until every worker is
    # offered (request_capacity == WORKERS) or 90 s, whichever comes first.
    while true; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "!! server '$name' exited during start; last log lines:"
            tail -n 40 "$log"
            SERVER_PID=""
            return 1
        fi
        local capacity
        capacity=$("$PY" - "$PORT" <<'EOF' 2>/dev/null
import http.client, json, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=2)
c.request("GET", "/health")
r = c.getresponse()
h = json.loads(r.read())
idle = sum(1 for w in h.get("workers") or [] if w.get("status") == "idle")
print(h["load"]["request_capacity"] if r.status == 200 else -1, idle, len(h.get("workers") or []))
EOF
)
        if [ -n "$capacity" ]; then
            set -- $capacity
            # ready: all workers offered, and idle when the server lists them
            if [ "$1" -ge "$WORKERS" ] && { [ "$3" -eq 0 ] || [ "$2" -ge "$WORKERS" ]; }; then
                break
            fi
        fi
        if [ $(( $(date +%s) - started )) -ge 90 ]; then
            echo "   (not every worker idle after 90 s: health says '$capacity'; going on)"
            break
        fi
        sleep 1
    done
    echo "   ready after $(( $(date +%s) - started )) s"
}

# bench NAME TIMEOUT SCRIPT ARGS...
bench() {
    local name=$1 limit=$2
    shift 2
    local left=$(( BATCH_BUDGET - ($(date +%s) - BATCH_START) ))
    echo
    echo "== $name  (elapsed $(( $(date +%s) - BATCH_START )) s)"
    if [ "$left" -lt 20 ]; then
        echo "!! $name skipped: the batch budget of $BATCH_BUDGET s is spent"
        FAILED+=("$name")
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    if ! timeout --signal=INT --kill-after=10 "$limit" "$PY" "$@" --url "http://127.0.0.1:$PORT" \
            --output "$RESULTS/$name.json"; then
        echo "!! $name failed or timed out"
        FAILED+=("$name")
    fi
}

if start_server mr1 1; then
    # A fresh worker per request is slow to come back (tens of seconds on the
    # first runs): few warm-up requests and short phases keep this bounded.
    bench null_program_mr1 100 bench/null_program.py --label "gpu, max-requests 1" \
        --warmup 2 --max-seconds 20
    bench overlap_mr1 100 bench/overlap.py --label "gpu, max-requests 1" \
        --warmup 0 --single 2 --concurrency 8 --requests 100 --max-seconds 15
else
    FAILED+=(server_mr1)
fi
stop_server

if start_server mr0 0; then
    bench null_program_mr0 100 bench/null_program.py --label "gpu, max-requests 0" --max-seconds 30
    bench overlap_mr0 80 bench/overlap.py --label "gpu, max-requests 0" --max-seconds 20
    bench tensor_roundtrip 100 bench/tensor_roundtrip.py --label "gpu, max-requests 0"
    bench benchmark_accuracy 100 bench/benchmark_accuracy.py --label "gpu, max-requests 0" --gpu "$GPU"
else
    FAILED+=(server_mr0)
fi
stop_server

echo
echo "== results (batch took $(( $(date +%s) - BATCH_START )) s)"
for name in $NAMES; do
    if [ -f "$RESULTS/$name.json" ]; then
        echo "--- $RESULTS/$name.json"
        cat "$RESULTS/$name.json"
    fi
done
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "!! failed: ${FAILED[*]}"
    exit 1
fi
