#!/usr/bin/env bash
# The quantization table in BENCHMARKS.md, on the embedded default model (SmolLM2-135M-Instruct,
# whose Q4_1 GGUF dequantized to bf16 is the full-precision reference). For each weight format:
# perplexity (`kvserve eval ppl`), resident weight memory, single-stream decode (one stream of
# 128-token completions: 1000 / median TPOT) and output tok/s with 64 ShareGPT requests in flight.
# Rows: bf16 (the reference), int8 and fp8-load (-q int8 / -q fp8: round to nearest while loading),
# fp8 (a `kvserve quantize --method fp8` checkpoint: GPTQ rounding), rtn / awq / gptq (int4
# checkpoints) and gguf (the file's Q4_1 blocks kept).
#
#   scripts/bench_quant.sh            # all rows; quantized checkpoints are made once under $OUT
#   ROWS="bf16 gguf" scripts/bench_quant.sh
#
# Results (JSON per row and a summary table) go to $OUT (default bench-results/quant/).
set -euo pipefail
KV=${KV:-.venv/bin/kvserve}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench-results/quant}
PORT=${PORT:-8131}
# 128 does not divide SmolLM2's hidden size (576): its q/k/v/o and gate/up inputs allow 32, 64, 192, ...
GROUP=${GROUP:-64}
GPTQ_SAMPLES=${GPTQ_SAMPLES:-64}
AWQ_SAMPLES=${AWQ_SAMPLES:-16}
FP8_SAMPLES=${FP8_SAMPLES:-64}
ROWS=${ROWS:-bf16 int8 fp8-load fp8 rtn awq gptq gguf}
BASE=http://127.0.0.1:$PORT
mkdir -p "$OUT"
# shellcheck source=scripts/serve_lib.sh
source "$(dirname "$0")/serve_lib.sh"

quantize() {  # NAME ARGS...: a checkpoint under $OUT/NAME, made once
    local name=$1
    shift
    [ -f "$OUT/$name/config.json" ] && return 0
    rm -rf "${OUT:?}/$name"
    local start=$SECONDS
    "$KV" quantize "$@" --out "$OUT/$name"
    echo "$name: quantized in $((SECONDS - start)) s" | tee "$OUT/$name.time"
}

row_model() {  # the model of a row: a quantized checkpoint dir, or empty for the default model
    case $1 in
    rtn | awq | gptq) echo "$OUT/$1-g$GROUP" ;;
    fp8) echo "$OUT/fp8-gptq" ;;
    esac
}

row_quant() {  # the --quantization of a row (empty: what the checkpoint says)
    case $1 in
    bf16) echo none ;;
    int8 | gguf) echo "$1" ;;
    fp8-load) echo fp8 ;;
    fp8 | rtn | awq | gptq) ;;
    *) echo "unknown row $1" >&2; exit 2 ;;
    esac
}

for row in $ROWS; do
    case $row in
    rtn) quantize "rtn-g$GROUP" --method rtn --bits 4 --group-size "$GROUP" ;;
    gptq) quantize "gptq-g$GROUP" --method gptq --bits 4 --group-size "$GROUP" --act-order \
        --calib-samples "$GPTQ_SAMPLES" ;;
    awq) quantize "awq-g$GROUP" --method awq --bits 4 --group-size "$GROUP" --calib-samples "$AWQ_SAMPLES" ;;
    fp8) quantize fp8-gptq --method fp8 --calib-samples "$FP8_SAMPLES" ;;
    esac
done

for row in $ROWS; do
    q=$(row_quant "$row")
    dir=$(row_model "$row")
    flags=(--dtype bfloat16 ${q:+-q "$q"})
    echo "== $row: ${dir:-default model} ${flags[*]}"
    "$KV" eval ppl ${dir:+"$dir"} "${flags[@]}" --output-json "$OUT/$row-ppl.json" | tee "$OUT/$row-ppl.txt"
    serve_up "$OUT/$row-server.log" ${dir:+--model "$dir"} "${flags[@]}"
    "$KV" bench serve --base-url "$BASE" --dataset random --input-len 128 --output-len 128 --num-prompts 8 \
        --max-concurrency 1 --cache-salt "$row-c1" --output-json "$OUT/$row-c1.json" > "$OUT/$row-c1.txt"
    "$KV" bench serve --base-url "$BASE" --dataset sharegpt --num-prompts 128 --max-concurrency 64 \
        --cache-salt "$row-c64" --output-json "$OUT/$row-c64.json" > "$OUT/$row-c64.txt"
    serve_down
done

"$PY" - "$OUT" $ROWS <<'EOF'
import json, sys
out, rows = sys.argv[1], sys.argv[2:]
ref = json.load(open(f"{out}/bf16-ppl.json")) if "bf16" in rows else None
print("| weights | perplexity | vs bf16 | weight memory | single-stream decode | 64 concurrent |")
print("|---|---|---|---|---|---|")
for row in rows:
    p = json.load(open(f"{out}/{row}-ppl.json"))
    c1, c64 = json.load(open(f"{out}/{row}-c1.json")), json.load(open(f"{out}/{row}-c64.json"))
    change = f"{100 * (p['ppl'] / ref['ppl'] - 1):+.2f}%" if ref else "-"
    mem = f"{p['weight_bytes'] / 1e6:.1f} MB" + (f" ({p['weight_bytes'] / ref['weight_bytes']:.2f}x)" if ref else "")
    print(f"| {row} | {p['ppl']:.4f} | {change} | {mem} | {1000 / c1['tpot_ms']['median']:.1f} tok/s "
          f"| {c64['output_throughput']:.1f} tok/s |")
EOF
