# Sourced by the bench/*.sh batches: a free port and stopping the server
# they started ($SERVER_PID), with the traps that stop it on exit, waiting
# for a server's capacity, and the reference's install.  Needs $PY (and
# $REF_SITE for ensure_reference_site).

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# stop_server: TERM, up to 30 s for a graceful stop, then KILL.
stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID"
        for _ in $(seq 1 60); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.5
        done
        kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
        wait "$SERVER_PID" 2>/dev/null
    fi
    SERVER_PID=""
}

# wait_capacity NAME WANT_CAPACITY LIMIT_S LOG: the server ($SERVER_PID on
# $PORT) answers /health offering at least WANT_CAPACITY requests; after
# LIMIT_S it goes on anyway; returns 1 (with LOG's tail) if it exited.
wait_capacity() {
    local name=$1 want=$2 limit=$3 log=$4 started capacity
    started=$(date +%s)
    while true; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "!! $name exited during start; last log lines:"
            tail -n 30 "$log"
            SERVER_PID=""
            return 1
        fi
        capacity=$("$PY" - "$PORT" <<'EOF' 2>/dev/null
import http.client, json, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=2)
c.request("GET", "/health")
r = c.getresponse()
print(json.loads(r.read())["load"]["request_capacity"] if r.status == 200 else -1)
EOF
)
        if [ -n "$capacity" ] && [ "$capacity" -ge "$want" ]; then
            echo "   $name ready after $(( $(date +%s) - started )) s"
            return 0
        fi
        if [ $(( $(date +%s) - started )) -ge "$limit" ]; then
            echo "   ($name: capacity '$capacity' after $limit s; going on)"
            return 0
        fi
        sleep 1
    done
}

# wait_front_ends NAME COUNT LIMIT_S: every one of COUNT front ends on $PORT
# has answered /health (the kernel spreads new connections over the processes
# sharing the port; one that has not started listening gets none).
wait_front_ends() {
    local name=$1 count=$2 limit=$3
    if "$PY" - "$PORT" "$count" "$limit" <<'EOF'
import http.client, json, sys, time
port, count, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
seen, deadline = set(), time.monotonic() + limit
while len(seen) < count and time.monotonic() < deadline:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/health")
        seen.add(json.loads(c.getresponse().read())["front_end"]["index"])
        c.close()
    except (OSError, KeyError, ValueError):
        time.sleep(0.2)
sys.exit(0 if len(seen) == count else 1)
EOF
    then
        echo "   $name: all $count front ends answer"
    else
        echo "   ($name: not all $count front ends answered after $limit s; going on)"
    fi
}

# ensure_reference_site: the reference 0.1.1 in $REF_SITE, installed from
# .ref/*.whl (the GPU machine has no package index) unless it is there.
ensure_reference_site() {
    [ -d "$REF_SITE/kcoral" ] && return 0
    if ! ls .ref/*.whl >/dev/null 2>&1; then
        echo "!! no reference client in $REF_SITE and no .ref/*.whl to install it from"
        echo "   (mkdir -p .ref && cp ../shared/ref/wheels/*.whl .ref/, then carry .ref)"
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$REF_SITE" .ref/*.whl || exit 2
}

SERVER_PID=""
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

# pin_reactor CPU: the server's main thread ($SERVER_PID) alone on CPU, and
# every other thread of the server and of the processes under it on the
# other CPUs; prints those other CPUs (for the client).  An experiment on
# the reactor's moves between CPUs, for reuse mode only: a worker started
# later would inherit the main thread's single CPU.
pin_reactor() {
    "$PY" - "$SERVER_PID" "$1" <<'PYEOF'
import os, sys
import psutil
root, cpu = psutil.Process(int(sys.argv[1])), int(sys.argv[2])
others = sorted(os.sched_getaffinity(0) - {cpu})
for process in [root, *root.children(recursive=True)]:
    try:
        threads = process.threads()
    except psutil.Error:
        continue
    for thread in threads:
        try:
            os.sched_setaffinity(thread.id, {cpu} if thread.id == root.pid else others)
        except OSError:
            pass
print(",".join(map(str, others)))
PYEOF
}
