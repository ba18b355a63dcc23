#!/usr/bin/env bash
# stop 24 call 3 (issue 14): whole-model compiled prefill with the traced plan, T = 512 and 4096, bf16 / torchao /
# fp8_static, one process per variant, with the kernel list of one step (--profile: GPU time per kernel) and the
# host profile of 20 steps (--step-profile)
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 ${LIM:-520} python3 -m bench.hf_model --model llama --layers 8 --parallel-compile \
  --variants bf16 torchao fp8_static --prefill 512 4096 --no-decode --modes compiled --profile --step-profile \
  --host-rounds 0 --check-tokens 0 --rounds 7 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
tail -3 "$W/hf.log"
grep -A8 "^| workload" "$W/hf/hf_model_llama.md" | head -10
tar czf "$OUT/call3.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
