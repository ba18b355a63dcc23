#!/usr/bin/env bash
# stop 25 call 6 (issue 14): one-token decode in CUDA graphs, bf16 / torchao float8 / fp8_static in one process
# (torchao's graph decode had not been measured since stop 16)
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
t0=$SECONDS
timeout 200 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 $(( ${LIM_ALL:-290} - (SECONDS - t0) )) python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 torchao fp8_static --prefill --modes graph --host-rounds 0 --check-tokens 0 --rounds 5 \
  --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
grep -A6 "^| workload" "$W/hf/hf_model_llama.md" | head -8
tar czf "$OUT/call6.tar.gz" -C "$W" .
