#!/usr/bin/env bash
# issue 14 measurements in one call (each step bounded; logs and results under $OUT/w, packed into results.tar.gz)
set -u
export PYTHONUNBUFFERED=1
LIM=${LIM:-540}
W=$OUT/w; mkdir -p "$W"
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv,noheader
step() { local name=$1 lim=$2; shift 2; echo "== $name (limit ${lim}s, at $((SECONDS - t0))s)";
  timeout --kill-after=5 "$lim" "$@" > "$W/$name.log" 2>&1; echo "rc=$?"; grep -E "µs \(host|ERROR" "$W/$name.log" | tail -6; }
HF=(python3 -m bench.hf_model --model llama --layers 8 --compile-scope layers --host-rounds 0 --check-tokens 0)
# decode: regional compile, step in a CUDA graph; Inductor's static launcher on for the library's kernels
step decode_on 230 "${HF[@]}" --variants bf16 torchao fp8_static fp8_dynamic --modes compiled graph --prefill \
  --static-launch on --step-profile --out "$W/decode_on"
# the same step with the static launcher off (bf16 again as the in-run reference)
step decode_off 100 "${HF[@]}" --variants bf16 fp8_static --modes compiled --prefill --static-launch off \
  --out "$W/decode_off"
left=$((LIM - (SECONDS - t0) - 20))
[ $left -gt 60 ] && step prefill $left "${HF[@]}" --variants bf16 torchao fp8_static --modes compiled --no-decode \
  --prefill 512 4096 --static-launch on --out "$W/prefill"
tar czf "$OUT/results.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
