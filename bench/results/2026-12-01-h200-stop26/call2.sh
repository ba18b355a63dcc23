#!/usr/bin/env bash
# stop 26 call 2 (issue 14): call 1's process was host-slow (bf16 prefill-512 host 4579 µs against 2378 at stop 25).
# Again at T = 512 only, in one process: bf16 / fused fp8_static / fp8_static+fuse=0 / fused with every GEMM on
# torch_scaled_mm (call 1's fused gate_up ran cutlass at M <= 1024); then the GPU tests of quantize_model's paths
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
nproc; uptime
timeout --kill-after=5 ${LIM:-300} python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_static fp8_static+fuse=0 fp8_static+backend=torch_scaled_mm --prefill 512 --no-decode \
  --modes compiled --host-rounds 0 --check-tokens 0 --rounds 9 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
grep -A8 "^| workload" "$W/hf/hf_model_llama.md" | head -8
left=$(( ${LIM_ALL:-560} - (SECONDS - t0) ))
if [ $left -gt 60 ]; then
  timeout --kill-after=5 $((left - 20)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_convert.py \
    tests/test_shared_input.py tests/test_layers.py > "$W/gpu_tests.log" 2>&1
  echo "[$((SECONDS - t0))s] gpu tests rc=$?"
  tail -5 "$W/gpu_tests.log"
fi
tar czf "$OUT/call2.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
