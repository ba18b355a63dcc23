#!/usr/bin/env bash
# stop 25 call 1 (issue 14): the host objective's context (registry/host_aware: a call costs
# max(kernel, host + 50 µs of the model's other host work), FP8_SELECTION_HOST_CONTEXT_US) against the stop-24 rule
# (+host_context=0) and bf16, in ONE process: whole-model compiled prefill at T = 512, 1024 and 4096
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 ${LIM:-420} python3 -m bench.hf_model --model llama --layers 8 --no-decode \
  --variants bf16 fp8_static fp8_static+host_context=0 --prefill 512 1024 4096 --modes compiled \
  --host-rounds 0 --check-tokens 0 --rounds 7 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
tail -3 "$W/hf.log"
grep -A8 "^| workload" "$W/hf/hf_model_llama.md" | head -10
python3 - "$W/hf/hf_model_llama.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for v, n in r.get("notes", {}).items():
    print(v, n.get("providers") if isinstance(n, dict) else n)
PY
tar czf "$OUT/call1.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
