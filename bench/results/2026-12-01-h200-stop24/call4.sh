#!/usr/bin/env bash
# stop 24 call 4 (issue 14): the traced plan against the general path (+plan=general) and bf16 in ONE process (the
# host-bound rows of calls 1 and 3 came from one process per variant, and call 3's fp8 process ran every host
# function ~2x slower than its bf16 process), compiled prefill 512 and decode, with the step profiles
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 ${LIM:-540} python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_static fp8_static+plan=general --prefill 512 --modes compiled --step-profile \
  --host-rounds 0 --check-tokens 0 --rounds 9 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
tail -3 "$W/hf.log"
grep -A6 "^| workload" "$W/hf/hf_model_llama.md" | head -8
grep -E "built-in method torch\.(_scaled_mm|mm)\}|_launch_kernel\}|^### cProfile" "$W/hf/hf_model_llama.md"
tar czf "$OUT/call4.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
