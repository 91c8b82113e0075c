#!/usr/bin/env bash
# The serving benchmarks in BENCHMARKS.md: start `kvserve serve` on the embedded default
# model, warm it up with one request, run `kvserve bench serve`, stop the server.
#
#   scripts/bench_serving.sh prefix      # TTFT with prefix caching on vs off (2048-token shared prefix)
#   scripts/bench_serving.sh sharegpt    # ShareGPT at concurrency 1, 16 and 64
#   scripts/bench_serving.sh budget      # ShareGPT at concurrency 64 with a 512-token step budget
#   scripts/bench_serving.sh tiers       # multi-turn ShareGPT, a small KV pool, KV tiers off / RAM / disk / Redis
#
# Results (table + JSON) go to $OUT (default bench-results/).
set -euo pipefail
KV=${KV:-.venv/bin/kvserve}
PORT=${PORT:-8123}
OUT=${OUT:-bench-results}
BASE=http://127.0.0.1:$PORT
mkdir -p "$OUT"
SERVER=

start_server() {
    "$KV" serve --port "$PORT" "$@" > "$OUT/server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 300); do
        curl -sf "$BASE/health" > /dev/null && break
        kill -0 "$SERVER" 2> /dev/null || { cat "$OUT/server.log"; exit 1; }
        sleep 1
    done
    # One-time costs (first torch ops, the C kernel's load) are not serving latency.
    curl -sf "$BASE/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt": "warm-up", "max_tokens": 8, "cache_salt": "warm-up"}' > /dev/null
}

stop_server() {
    kill -TERM "$SERVER"
    wait "$SERVER" || true
}
trap '[ -n "$SERVER" ] && kill -TERM "$SERVER" 2> /dev/null || true' EXIT

bench() {
    local name=$1
    shift
    echo "== $name"
    "$KV" bench serve --base-url "$BASE" "$@" --output-json "$OUT/$name.json" | tee "$OUT/$name.txt"
}

run_tiers() {
    start_server "${POOL[@]}"
    bench multiturn-off "${MT[@]}"
    stop_server
    start_server "${POOL[@]}" --kv-offload-cpu 4GiB
    bench multiturn-cpu "${MT[@]}"
    stop_server
    # RAM smaller than the working set, so the disk tier serves the rest
    rm -rf "$OUT/kv-disk"
    start_server "${POOL[@]}" --kv-offload-cpu 128MiB --kv-offload-disk "$OUT/kv-disk"
    bench multiturn-cpu-disk "${MT[@]}"
    stop_server
    rm -rf "$OUT/kv-disk"
    REDIS_PORT=$((PORT + 1))
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --maxmemory 4gb \
        --maxmemory-policy allkeys-lru > "$OUT/redis.log" 2>&1 &
    REDIS=$!
    start_server "${POOL[@]}" --kv-offload-cpu 128MiB --kv-offload-disk "$OUT/kv-disk" \
        --kv-remote "redis://127.0.0.1:$REDIS_PORT"
    bench multiturn-cpu-disk-redis "${MT[@]}"
    stop_server
    kill "$REDIS"
    rm -rf "$OUT/kv-disk"
}


case "${1:-all}" in
prefix|all)
    for mode in enable no-enable; do
        start_server "--$mode-prefix-caching"
        bench "prefix-$mode" --dataset prefix --prefix-len 2048 --num-prompts 32 --max-concurrency 1
        stop_server
    done
    ;;&
sharegpt|all)
    start_server
    bench sharegpt-c1 --dataset sharegpt --num-prompts 32 --max-concurrency 1 --cache-salt c1
    bench sharegpt-c16 --dataset sharegpt --num-prompts 128 --max-concurrency 16 --cache-salt c16
    bench sharegpt-c64 --dataset sharegpt --num-prompts 256 --max-concurrency 64 --cache-salt c64
    stop_server
    ;;
budget)
    start_server --max-num-batched-tokens 512
    bench sharegpt-c64-budget512 --dataset sharegpt --num-prompts 256 --max-concurrency 64 --cache-salt b512
    stop_server
    ;;
c64)
    start_server
    bench sharegpt-c64 --dataset sharegpt --num-prompts 256 --max-concurrency 64 --cache-salt c64
    stop_server
    ;;
tiers)
    # 8 ShareGPT conversations (up to 6 turns), 4 in flight, 10 s between a reply and the next
    # question (people read and type; it also keeps the load below this machine's capacity, so
    # TTFT is prefill rather than queueing). Each turn's prompt is the conversation so far with
    # the dataset's replies (prompts up to 2000 tokens), 32 output tokens a turn. The KV pool
    # (128 blocks of 16 tokens) holds about a third of what the 4 conversations in flight have
    # computed, so a conversation's prefix is evicted by the others' turns before its next turn.
    MT=(--dataset multiturn --multiturn-history reference --num-prompts 8 --max-turns 6
        --max-prompt-len 2000 --output-len 32 --max-concurrency 4 --turn-gap 10)
    POOL=(--num-kv-blocks 128)
    run_tiers
    ;;
prefix|sharegpt|all) ;;
*)
    echo "usage: $0 prefix|sharegpt|all|c64|budget|tiers" >&2
    exit 2
    ;;
esac
