#!/usr/bin/env bash
# stop 25 call 4 (issue 14): the GPU tests of the touched paths (triton GEMM, quantize_model, layers, traced plan),
# then bench/decoder_block.py (its call column follows the host objective's buckets) with the time left
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_gemm.py \
  tests/test_convert.py tests/test_layers.py tests/test_traced_plan.py tests/test_objective.py > "$W/gpu_tests.log" 2>&1
echo "[$((SECONDS - t0))s] gpu tests rc=$?"
tail -4 "$W/gpu_tests.log"
left=$(( ${LIM_ALL:-560} - (SECONDS - t0) ))
if [ $left -gt 90 ]; then
  timeout --kill-after=5 $((left - 30)) python3 -m bench.decoder_block --tokens 1 256 --budget-s $((left - 60)) \
    --out "$W/block" > "$W/block.log" 2>&1
  echo "[$((SECONDS - t0))s] block rc=$?"
  grep -B2 -A16 "call" "$W/block/decoder_block.md" | head -40
fi
tar czf "$OUT/call4.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
