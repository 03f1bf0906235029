#!/bin/bash
# Issue 16's goal 4: vq_bench_store_load against a standalone redis-server and a 3-master cluster,
# both started here on 127.0.0.1 at free ports (bus ports +10000) without persistence, and stopped
# by pid on exit, even when the bench fails.
#   bench/run_store_load.sh [BUILD_DIR=build] [SECONDS=30] [CLIENTS=16] [--kill-master AFTER_S]
# --kill-master AFTER_S: the cluster only, with ?timeout_ms=500, and `kill -9` of the third master
# AFTER_S seconds into the run (no replicas: its keys fail with an error, no get may return other
# bytes; the masters run with cluster-require-full-coverage no, so the other two keep serving their
# slots, as an operator who wants partial availability sets). Then `veloxquant generate --store` against the cluster with that master still down: a
# context stored before the kill (store put, stories260K, fp32 chunks of 16 tokens) is loaded with
# one warning and recomputed, exit status 0 (a generate before the kill shows the reuse).
set -u -o pipefail
KILL_AFTER=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kill-master) KILL_AFTER=${2:?--kill-master needs seconds}; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
BUILD=${args[0]:-build}; SECONDS_RUN=${args[1]:-30}; CLIENTS=${args[2]:-16}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=$(realpath "$BUILD")/bench/vq_bench_store_load
CLI=$(realpath "$BUILD")/veloxquant
D=$(mktemp -d /tmp/vq-store-load-XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait; rm -rf "$D"' EXIT
# A port p free on 127.0.0.1 with p + 10000 free too (the cluster bus), between 20000 and 29999.
free_port() {
  python3 - "$@" <<'EOF'
import random, socket, sys
taken = {int(a) for a in sys.argv[1:]}
for _ in range(1000):
    p = random.randint(20000, 29999)
    if p in taken or p + 10000 in taken: continue
    try:
        for q in (p, p + 10000):
            s = socket.socket(); s.bind(("127.0.0.1", q)); s.close()
    except OSError:
        continue
    print(p); break
EOF
}
ports=()
for _ in 1 2 3 4; do ports+=("$(free_port "${ports[@]}")"); done
STANDALONE=${ports[0]}; M1=${ports[1]}; M2=${ports[2]}; M3=${ports[3]}
start() { redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no --dir "$D" --daemonize no --logfile "$D/r$1.log" "${@:2}" & pids+=($!); }
[ -z "$KILL_AFTER" ] && start "$STANDALONE"
coverage=(); [ -n "$KILL_AFTER" ] && coverage=(--cluster-require-full-coverage no)
for p in "$M1" "$M2" "$M3"; do start "$p" --cluster-enabled yes --cluster-config-file "$D/n$p.conf" --cluster-node-timeout 1000 "${coverage[@]}"; done
M3_PID=${pids[-1]}
for p in $([ -z "$KILL_AFTER" ] && echo "$STANDALONE") "$M1" "$M2" "$M3"; do
  for _ in $(seq 600); do redis-cli -p "$p" PING 2>/dev/null | grep -q PONG && break; sleep 0.1; done
done
redis-cli --cluster create 127.0.0.1:"$M1" 127.0.0.1:"$M2" 127.0.0.1:"$M3" --cluster-replicas 0 --cluster-yes > "$D/create.log" 2>&1 ||
  { echo "redis-cli --cluster create failed:"; cat "$D/create.log"; exit 1; }
for _ in $(seq 600); do redis-cli -p "$M1" CLUSTER INFO | grep -q cluster_state:ok && break; sleep 0.1; done
rc=0
if [ -z "$KILL_AFTER" ]; then
  "$B" redis://127.0.0.1:"$STANDALONE" --clients "$CLIENTS" --seconds "$SECONDS_RUN" || rc=1
  "$B" redis-cluster://127.0.0.1:"$M1" --clients "$CLIENTS" --seconds "$SECONDS_RUN" || rc=1
  exit $rc
fi

URL="redis-cluster://127.0.0.1:$M1,127.0.0.1:$M2?timeout_ms=500"
MODEL="$ROOT/../shared/models/stories260K.bin"; TOK="$ROOT/../shared/models/tok512.bin"
PROMPT="Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. One day, she saw a big red ball under a tree and ran to get it, but a small dog took it first."
GEN=(--model "$MODEL" --tokenizer "$TOK" --prompt "$PROMPT" --store "$URL" --levels fp32 --chunk-tokens 16 --steps 100 --seed 7 --json)
"$CLI" store put --store "$URL" --model "$MODEL" --tokenizer "$TOK" --prompt "$PROMPT" --levels fp32 --chunk-tokens 16 || rc=1
# generate's JSON report in one line: tokens reused, each chunk's level, time to first token
summary() { python3 -c 'import json,sys; r=json.load(sys.stdin); print("tokens_reused", r["tokens_reused"], "chunks", [c["level"] for c in r["chunks"]], "ttft_ms %.1f" % r["ttft_ms"])'; }
echo "generate --store before the kill:"
"$CLI" generate "${GEN[@]}" 2> "$D/gen0.err" | summary || rc=1
cat "$D/gen0.err"

echo "cluster bench, master 127.0.0.1:$M3 (pid $M3_PID) killed after ${KILL_AFTER} s:"
"$B" "$URL" --clients "$CLIENTS" --seconds "$SECONDS_RUN" &
bench=$!
sleep "$KILL_AFTER"
kill -9 "$M3_PID" && echo "killed master 127.0.0.1:$M3 (pid $M3_PID) at ${KILL_AFTER} s"
wait "$bench" || rc=1

echo "generate --store with master 127.0.0.1:$M3 down:"
"$CLI" generate "${GEN[@]}" 2> "$D/gen.err" > "$D/gen.json"
gen_rc=$?
summary < "$D/gen.json"
cat "$D/gen.err"
echo "generate exit status: $gen_rc"
[ "$gen_rc" = 0 ] || rc=1
exit $rc
