#!/bin/bash
# bench/instructions.sh SRC TAG [N]: user-space instructions per request of the crossbar in
# checkout SRC (PYTHONPATH), under valgrind's callgrind: instrumentation off during start-up,
# switched on after 50 warm-up requests, N (default 400) sequential keep-alive requests of
# bench (a), dumped, divided. The machine's load moves the count little (bench/HISTORY.md,
# "Second pass"): ~1% on a busy machine, where what runs by the clock is counted longer. Needs valgrind, curl, bench/.venv (bench/run makes it) and twistd in PY's dir.
# EVENTS=1: instructions per streamed event instead: after the warm-up, one stream of 100
# events and one of N+100 (2 ms apart: meant to be a read each), each its own dump; the
# difference divided by N leaves out what a request costs besides its events. GAP=20: the
# events 20 ms apart instead of 2: under callgrind on a loaded machine 2 ms apart lets
# 10-40% of them share a read, which moves the count by up to +-10%; 20 ms apart almost
# none do (runs of one tree within ~1%), and the count is that of an event in a read of
# its own (~57k against ~46k). CROSSBAR_TWISTED_OFF=N,...: with those Twisted touchpoints
# switched off (crossbar/compat/twisted.py; bench/README.md, "Each Twisted touchpoint").
# WORKERS=2: crossbar runs with workers: 2 and the count is the supervisor's alone (its
# workers are not under callgrind) per request the workers served: what the supervisor
# pays per request (issue 33). LOGFILE=0: twistd logs to its standard output instead.
# WORKERS=2 WHO=workers: the workers' instructions per request instead (every process of
# the tree under callgrind, the workers' counts summed), and the busy worker's minus the
# idle one's (what runs by the clock, slowed down by callgrind, taken out).
set -euo pipefail
SRC=$1; TAG=$2; N=${3:-400}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-$(command -v python3)}
OUT=$(mktemp -d)
"$HERE/.venv/bin/python" "$HERE/upstream.py" --port 0 > "$OUT/up" & UPPID=$!
trap 'kill $UPPID ${CB:-} 2>/dev/null || true' EXIT
sleep 1; UPPORT=$(head -1 "$OUT/up" | awk '{print $2}')
PORT=$("$PY" -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
cat > "$OUT/cb.yaml" <<Y
listen: "tcp:$PORT:interface=127.0.0.1"
health: {interval: 60, timeout: 5}
hosts:
  up: http://127.0.0.1:$UPPORT
routes:
  bench:
    hosts: [up]
    default_model: bench
Y
if [ -n "${WORKERS:-}" ]; then echo "workers: $WORKERS" >> "$OUT/cb.yaml"; fi
LOGARG=--logfile="$OUT/log"
if [ "${LOGFILE:-1}" = 0 ]; then LOGARG=; fi
TRACE=; if [ "${WHO:-}" = workers ]; then TRACE=--trace-children=yes; fi
(cd "$OUT" && PYTHONPATH=$SRC exec valgrind --tool=callgrind $TRACE --instr-atstart=no --callgrind-out-file="$OUT/cg.%p" \
    "$PY" "$(dirname "$PY")/twistd" -n --pidfile= $LOGARG crossbar --config "$OUT/cb.yaml" > "$OUT/vg" 2>&1) & CB=$!
for _ in $(seq 1 600); do curl -s -o /dev/null -m 2 "http://127.0.0.1:$PORT/_crossbar/readyz" && break; sleep 0.5; done
"$PY" "$HERE/seq_client.py" "$PORT" 50 > /dev/null
stream() {  # one SSE stream of $1 events through the route, read to its end
    curl -s -N -o /dev/null -m 600 -H 'Content-Type: application/json' \
        -d "{\"model\":\"bench\",\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" \
        "http://127.0.0.1:$PORT/bench/v1/chat/completions?stream=1&n=$1&d=${GAP:-2}"
}
if [ -n "${EVENTS:-}" ]; then
    stream 20
    callgrind_control -i on "$CB" > /dev/null 2>&1
    stream 100; callgrind_control -d "$CB" > /dev/null 2>&1
    stream $((N + 100)); callgrind_control -d "$CB" > /dev/null 2>&1
    SHORT=$(grep -h "^summary:" "$OUT"/cg.*.1 | head -1 | awk '{print $2}')
    LONG=$(grep -h "^summary:" "$OUT"/cg.*.2 | head -1 | awk '{print $2}')
    echo "$TAG instructions/event $(((LONG - SHORT) / N))  (stream of 100: $SHORT, of $((N + 100)): $LONG)"
    exit 0
fi
PIDS=$CB
if [ "${WHO:-}" = workers ]; then PIDS=$(cat /proc/$CB/task/*/children); fi
for P in $PIDS; do callgrind_control -i on "$P" > /dev/null 2>&1; done
"$PY" "$HERE/seq_client.py" "$PORT" "$N" > /dev/null
if [ -n "${WORKERS:-}" ]; then sleep 1; fi  # the workers' last log lines reach the supervisor
for P in $PIDS; do callgrind_control -d "$P" > /dev/null 2>&1; done
TOTAL=0; EACH=; LEAST=
for P in $PIDS; do
    T=$(grep -h "^summary:" "$OUT"/cg.$P.1 | head -1 | awk '{print $2}')
    TOTAL=$((TOTAL + T)); EACH="$EACH $T"
    if [ -z "$LEAST" ] || [ "$T" -lt "$LEAST" ]; then LEAST=$T; fi
done
if [ "${WHO:-}" = workers ]; then  # one connection: one worker serves it, the other idles
    echo "$TAG workers' instructions/request $((TOTAL / N)); busy minus idle worker $(((TOTAL - 2 * LEAST) / N))  (each:$EACH, N=$N)"
    exit 0
fi
echo "$TAG instructions/request $((TOTAL / N))  (total $TOTAL, N=$N)"
