#!/usr/bin/env bash
# stop 25 call 3 (issue 14): call 1 again with the triton TMA configs priced at their measured host cost
# (TritonGemmBackend.host_us_for, call 2) and Dynamo's recompile limits raised (call 1's ninth compile ran eagerly):
# bf16 / fp8_static (context 50 µs) / fp8_static+host_context=0 in ONE process, compiled prefill 512, 1024, 4096 and
# compiled decode
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 ${LIM:-440} python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_static fp8_static+host_context=0 --prefill 512 1024 4096 --modes compiled \
  --host-rounds 0 --check-tokens 0 --rounds 7 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
grep -c "recompile_limit" "$W/hf.log"
grep -A8 "^| workload" "$W/hf/hf_model_llama.md" | head -10
python3 - "$W/hf/hf_model_llama.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for v, n in r.get("notes", {}).items():
    if isinstance(n, dict) and "providers" in n:
        for rows, count in n["providers"].items():
            print(v, count, rows.split("; in CUDA graphs")[0])
PY
tar czf "$OUT/call3.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
