# Sourced by the benchmark scripts: start and stop one `kvserve serve` (uses KV, PORT and BASE).
SERVER=
trap '[ -n "$SERVER" ] && kill -TERM "$SERVER" 2> /dev/null || true' EXIT

serve_up() {  # LOG ARGS...: start the server, wait for /health, send one warm-up request
    local log=$1
    shift
    "$KV" serve --port "$PORT" "$@" > "$log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 300); do
        curl -sf "$BASE/health" > /dev/null && break
        kill -0 "$SERVER" 2> /dev/null || { cat "$log"; exit 1; }
        sleep 1
    done
    # One-time costs (first torch ops, the C kernel's load) are not serving latency.
    curl -sf "$BASE/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt": "warm-up", "max_tokens": 8, "cache_salt": "warm-up"}' > /dev/null
}

serve_down() {
    kill -TERM "$SERVER"
    wait "$SERVER" || true
    SERVER=
}
