#!/bin/bash
# Issue 16's goal 4: vq_bench_store_load against a standalone redis-server and a 3-master cluster,
# both started here on 127.0.0.1 (ports 27500-27503, bus ports +10000) without persistence, and
# stopped by pid on exit, even when the bench fails.
#   bench/run_store_load.sh [BUILD_DIR=build] [SECONDS=30] [CLIENTS=16]
set -u
BUILD=${1:-build}; SECONDS_RUN=${2:-30}; CLIENTS=${3:-16}
B=$(realpath "$BUILD")/bench/vq_bench_store_load
D=$(mktemp -d /tmp/vq-store-load-XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait; rm -rf "$D"' EXIT
start() { redis-server --port "$1" --bind 127.0.0.1 --save '' --appendonly no --dir "$D" --daemonize no --logfile "$D/r$1.log" "${@:2}" & pids+=($!); }
start 27500
for p in 27501 27502 27503; do start $p --cluster-enabled yes --cluster-config-file "$D/n$p.conf" --cluster-node-timeout 1000; done
for p in 27500 27501 27502 27503; do
  for _ in $(seq 600); do redis-cli -p $p PING 2>/dev/null | grep -q PONG && break; sleep 0.1; done
done
redis-cli --cluster create 127.0.0.1:27501 127.0.0.1:27502 127.0.0.1:27503 --cluster-replicas 0 --cluster-yes > "$D/create.log" 2>&1 ||
  { echo "redis-cli --cluster create failed:"; cat "$D/create.log"; exit 1; }
for _ in $(seq 600); do redis-cli -p 27501 CLUSTER INFO | grep -q cluster_state:ok && break; sleep 0.1; done
rc=0
"$B" redis://127.0.0.1:27500 --clients "$CLIENTS" --seconds "$SECONDS_RUN" || rc=1
"$B" redis-cluster://127.0.0.1:27501 --clients "$CLIENTS" --seconds "$SECONDS_RUN" || rc=1
exit $rc
