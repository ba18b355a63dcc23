#!/usr/bin/env bash
# stop 26 call 1 (issue 14): quantize_model now fuses q/k/v and gate/up into one GEMM each (fuse=True, the default).
# bf16 / fp8_static (fused) / fp8_static+fuse=0 (stop 25's layout) in ONE process: compiled decode and prefill
# 512, 1024, 4096
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 ${LIM:-420} python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_static fp8_static+fuse=0 --prefill 512 1024 4096 --modes compiled \
  --host-rounds 0 --check-tokens 0 --rounds 7 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
grep -A8 "^| workload" "$W/hf/hf_model_llama.md" | head -10
python3 - "$W/hf/hf_model_llama.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for v, n in r.get("notes", {}).items():
    if isinstance(n, dict) and "providers" in n:
        print(v, "swapped", n.get("swapped"), "gemms", n.get("gemms"))
        for rows, count in n["providers"].items():
            print("  ", count, rows.split("; in CUDA graphs")[0])
PY
tail -5 "$W/hf.log"
tar czf "$OUT/call1.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
