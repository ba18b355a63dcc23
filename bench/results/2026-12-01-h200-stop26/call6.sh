#!/usr/bin/env bash
# stop 26 call 6 (issue 14): eager decode and eager prefill 512 with fused q/k/v and gate/up: bf16 / fp8_static /
# fp8_static+fuse=0 in ONE process (cutlass disabled to skip its build: the eager rows at M = 1 and 512 never chose it)
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1 FP8_BACKENDS_DISABLED=gemm:cutlass
W=$OUT/w; mkdir -p "$W"
t0=$SECONDS
timeout --kill-after=5 ${LIM:-150} python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_static fp8_static+fuse=0 --prefill 512 --modes eager \
  --host-rounds 0 --check-tokens 0 --rounds 5 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
grep -A6 "^| workload" "$W/hf/hf_model_llama.md" | head -6
tail -3 "$W/hf.log"
