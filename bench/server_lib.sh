# Sourced by the bench/*.sh batches: a free port and stopping the server
# they started ($SERVER_PID), with the traps that stop it on exit.  Needs $PY.

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

SERVER_PID=""
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM
