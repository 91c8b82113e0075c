#!/usr/bin/env bash
# The GPU half of issue 17 (and the AVX-512 half of issue 11, on that machine's CPU), in about
# 8 minutes on one CUDA GPU:
#   1. the CUDA variants of the Triton tests (kernels compiled, not interpreted), CUDA graphs, and
#      greedy parity with HF transformers on CUDA (tiny models; the default model too if installed);
#   2. the C kernels' tests on this machine's CPU (its own instruction sets, AVX-512 / VNNI if any)
#      and bench_kernels.py there on 2 threads;
#   3. decode step times with CUDA graphs and without, against a linears-only ceiling.
# Steps go on after a failure; each writes its log to OUT_DIR. The exit status is the failures'.
# Usage: scripts/gpu_check.sh [OUT_DIR]
# On the `device` tool's machine (no network): first scripts/device_wheels.sh here, then run
#   scripts/gpu_check.sh "$OUT" with carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check_out}"
mkdir -p "$out"
if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
if [ -d .whl ]; then  # the device machine: its own torch / triton, our missing wheels, kvserve from here
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
failed=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT_DIR/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.txt"
    [ $rc -eq 0 ] || { echo "== $name FAILED (exit $rc)"; failed=$((failed + 1)); }
}
{ lscpu; nvidia-smi; $py -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'; } \
    > "$out/machine.txt" 2>&1
grep -E 'Model name|^CPU\(s\)' "$out/machine.txt"; tail -n 1 "$out/machine.txt"
step cuda_tests 220 $py -m pytest -q -p no:cacheprovider -rfE \
    tests/attention/test_triton_backend.py tests/quant/test_triton_matmul.py tests/worker/test_cuda_graphs.py \
    tests/engine/test_default_model.py::test_default_model_greedy_matches_hf_on_cuda
step cpu_kernels 110 $py -m pytest -q -p no:cacheprovider -rfE tests/worker/test_kernels.py tests/worker/test_decode_stack.py \
    tests/attention/test_torch_backend.py
step cpu_bench_kernels 50 taskset -c 0,1 env OMP_NUM_THREADS=2 $py scripts/bench_kernels.py --rows 1,12,64,256
step gpu_decode 150 $py scripts/bench_gpu_decode.py --out "$out/gpu_decode.json"
echo "== $failed step(s) failed"
exit $failed
