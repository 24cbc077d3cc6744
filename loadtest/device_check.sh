#!/usr/bin/env bash
# One prepared run for a session lent a GPU (the device tool): the kernel tests on CUDA, the kernel
# benchmark, the launch sweep (num_warps/num_stages per head size), then the whole model against
# transformers' generate (SDPA) on the GPU (loadtest/model_bench.py); everything is written under
# $OUT (default ./device-out).
#
# The device image has torch, triton, transformers, pytest and hypothesis but no msgspec, and no
# network: first, on the developer machine, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl msgspec
# then call the device tool with carry [".whl"] and the command `bash loadtest/device_check.sh`.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
export PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/kernel-tests.txt" | tail -5
timeout 240 python3 loadtest/kernel_bench.py >"$OUT/kernel-bench.json" 2>"$OUT/kernel-bench.err"
echo "kernel_bench rc=$?"
tail -c 2000 "$OUT/kernel-bench.json"
timeout 200 python3 loadtest/kernel_bench.py --launch-sweep >"$OUT/launch-sweep.json" 2>"$OUT/launch-sweep.err"
echo "launch_sweep rc=$?"
grep -E '"(head_dim|chosen_over_best)"' "$OUT/launch-sweep.json" | tr -d ' \n'; echo
timeout 300 python3 loadtest/model_bench.py >"$OUT/model-bench.json" 2>"$OUT/model-bench.err"
echo "model_bench rc=$?"
tail -c 1500 "$OUT/model-bench.json"
