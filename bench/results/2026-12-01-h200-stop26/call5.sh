#!/usr/bin/env bash
# stop 26 call 5 (issue 14): a second sample on the warm machine of calls 3-4: compiled decode (call 3 measured it
# in a process still compiling) and prefill 512; bf16 / fp8_static / fp8_dynamic / fp8_static+fuse=0 in ONE process
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
uptime
timeout --kill-after=5 ${LIM:-330} python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_static fp8_dynamic fp8_static+fuse=0 --prefill 512 --modes compiled \
  --host-rounds 0 --check-tokens 0 --rounds 7 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
grep -A8 "^| workload" "$W/hf/hf_model_llama.md" | head -8
grep -i -A6 "logits\|top-1" "$W/hf/hf_model_llama.md" | head -12
python3 - "$W/hf/hf_model_llama.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for v, n in r.get("notes", {}).items():
    if isinstance(n, dict) and "providers" in n:
        print(v, "swapped", n.get("swapped"), "gemms", n.get("gemms"))
        for rows, count in n["providers"].items():
            print("  ", count, rows.split("; in CUDA graphs")[0])
PY
tail -3 "$W/hf.log"
tar czf "$OUT/call5.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
