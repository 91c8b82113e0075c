#!/usr/bin/env bash
# The wheels a device machine (the `device` tool's nvidia-h200: Python 3.12 with torch, triton,
# transformers, pytest, no network) lacks for kvserve's engine and tests, fetched here into .whl/
# (git-ignored through .git/info/exclude); scripts/gpu_check.sh installs them there. Run it here,
# then call the device with carry [".whl"]. Their own needs (numpy, pyyaml, tqdm) and msgpack are there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
py=.venv/bin/python
[ -x "$py" ] || py=python3
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl pyzmq gguf
ls -l .whl
