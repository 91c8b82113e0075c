#!/usr/bin/env bash
# The serving benchmarks in BENCHMARKS.md: start `kvserve serve` on the embedded default
# model, warm it up with one request, run `kvserve bench serve`, stop the server.
#
#   scripts/bench_serving.sh prefix      # TTFT with prefix caching on vs off (2048-token shared prefix)
#   scripts/bench_serving.sh sharegpt    # ShareGPT at concurrency 1, 16 and 64
#   scripts/bench_serving.sh budget      # ShareGPT at concurrency 64 with a 512-token step budget
#   scripts/bench_serving.sh tiers       # multi-turn chat, a small KV pool, KV tiers off / RAM / disk / Redis
#   scripts/bench_serving.sh tiers-reference  # the same with the dataset's replies in the history
#
# Results (table + JSON) go to $OUT (default bench-results/). SERVE_ARGS adds flags to every
# server (e.g. SERVE_ARGS="--max-num-batched-tokens 2048", the step budget before it was sized by
# the machine); TIERS="off cpu" runs only those of the tiers benchmarks' four servers.
set -euo pipefail
KV=${KV:-.venv/bin/kvserve}
PORT=${PORT:-8123}
OUT=${OUT:-bench-results}
BASE=http://127.0.0.1:$PORT
mkdir -p "$OUT"
# shellcheck source=scripts/serve_lib.sh
source "$(dirname "$0")/serve_lib.sh"

# -q none: the GGUF dequantized (--dtype auto: bfloat16 or float32, by the CPU), as every number in
# BENCHMARKS.md's serving sections
start_server() { serve_up "$OUT/server.log" -q none ${SERVE_ARGS:-} "$@"; }

bench() {
    local name=$1
    shift
    echo "== $name"
    "$KV" bench serve --base-url "$BASE" "$@" --output-json "$OUT/$name.json" | tee "$OUT/$name.txt"
}

want_tier() { [[ " ${TIERS:-off cpu disk redis} " == *" $1 "* ]]; }  # TIERS: which servers run

run_tiers() {
    if want_tier off; then
        start_server "${POOL[@]}"
        bench multiturn-off "${MT[@]}"
        serve_down
    fi
    if want_tier cpu; then
        start_server "${POOL[@]}" --kv-offload-cpu 4GiB
        bench multiturn-cpu "${MT[@]}"
        serve_down
    fi
    # RAM smaller than the working set, so the disk tier serves the rest
    rm -rf "$OUT/kv-disk"
    if want_tier disk; then
        start_server "${POOL[@]}" --kv-offload-cpu 128MiB --kv-offload-disk "$OUT/kv-disk"
        bench multiturn-cpu-disk "${MT[@]}"
        serve_down
        rm -rf "$OUT/kv-disk"
    fi
    want_tier redis || return 0
    REDIS_PORT=$((PORT + 1))
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --maxmemory 4gb \
        --maxmemory-policy allkeys-lru > "$OUT/redis.log" 2>&1 &
    REDIS=$!
    start_server "${POOL[@]}" --kv-offload-cpu 128MiB --kv-offload-disk "$OUT/kv-disk" \
        --kv-remote "redis://127.0.0.1:$REDIS_PORT"
    bench multiturn-cpu-disk-redis "${MT[@]}"
    serve_down
    kill "$REDIS"
    rm -rf "$OUT/kv-disk"
}


case "${1:-all}" in
prefix|all)
    for mode in enable no-enable; do
        start_server "--$mode-prefix-caching"
        bench "prefix-$mode" --dataset prefix --prefix-len 2048 --num-prompts 32 --max-concurrency 1
        serve_down
    done
    ;;&
sharegpt|all)
    start_server
    bench sharegpt-c1 --dataset sharegpt --num-prompts 32 --max-concurrency 1 --cache-salt c1
    bench sharegpt-c16 --dataset sharegpt --num-prompts 128 --max-concurrency 16 --cache-salt c16
    bench sharegpt-c64 --dataset sharegpt --num-prompts 256 --max-concurrency 64 --cache-salt c64
    serve_down
    ;;
budget)
    start_server --max-num-batched-tokens 512
    bench sharegpt-c64-budget512 --dataset sharegpt --num-prompts 256 --max-concurrency 64 --cache-salt b512
    serve_down
    ;;
c64)
    start_server
    bench sharegpt-c64 --dataset sharegpt --num-prompts 256 --max-concurrency 64 --cache-salt c64
    serve_down
    ;;
tiers)
    # A chat service: 16 ShareGPT conversations (up to 6 turns) starting at 0.5 per second, 30 s
    # between a reply and the next question (people read and type). Each turn's prompt is the
    # conversation so far with the server's own earlier replies (up to 128 tokens each), as a
    # chat client sends it, so all but the new question can come from cache. The working set
    # (the 16 conversations' KV, ~12.7k tokens) is about 4x the KV pool (192 blocks of 16
    # tokens), so a conversation's KV is evicted by the others' turns before its next turn.
    MT=(--dataset multiturn --multiturn-history generated --num-prompts 16 --max-turns 6
        --max-prompt-len 2000 --max-output-len 128 --request-rate 0.5 --turn-gap 30)
    POOL=(--num-kv-blocks 192)
    run_tiers
    ;;
tiers-reference)
    # The same question with the dataset's reference replies in the history instead of the
    # server's (the server never computed them, so ~40% of each later prompt is new): 8
    # conversations, 4 in flight, 10 s gaps, 32 output tokens, a 128-block pool.
    MT=(--dataset multiturn --multiturn-history reference --num-prompts 8 --max-turns 6
        --max-prompt-len 2000 --output-len 32 --max-concurrency 4 --turn-gap 10)
    POOL=(--num-kv-blocks 128)
    run_tiers
    ;;
prefix|sharegpt|all) ;;
*)
    echo "usage: $0 prefix|sharegpt|all|c64|budget|tiers|tiers-reference" >&2
    exit 2
    ;;
esac
