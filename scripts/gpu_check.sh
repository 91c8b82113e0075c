#!/usr/bin/env bash
# The GPU half of issue 17, in at most 8 minutes on one CUDA GPU (a device machine):
#   1. the CUDA variants of the Triton tests (kernels compiled, not interpreted), CUDA graphs;
#   2. greedy parity with HF transformers on the default model, on CUDA, graphs on and off;
#   3. decode step times with CUDA graphs and without, against the linears-only ceiling.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (make setup first; results land in OUT_DIR, default .)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
py=.venv/bin/python
[ -x "$py" ] || py=python3
$py -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())'
export TRITON_INTERPRET=0
timeout 300 $py -m pytest -q -x -p no:cacheprovider \
    tests/attention/test_triton_backend.py tests/quant/test_triton_matmul.py tests/worker/test_cuda_graphs.py \
    "tests/engine/test_default_model.py::test_default_model_greedy_matches_hf_on_cuda" 2>&1 | tee "$out/gpu_tests.txt"
timeout 240 $py scripts/bench_gpu_decode.py --out "$out/gpu_decode.json" 2>&1 | tee "$out/gpu_decode.txt"
