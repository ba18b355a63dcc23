#!/usr/bin/env bash
# final device run of this session: GPU correctness, then the measurements (each step bounded, logs under $OUT)
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
t0=$SECONDS
step() { local name=$1 lim=$2; shift 2; echo "== $name (limit ${lim}s, at $((SECONDS - t0))s)"; timeout --kill-after=5 "$lim" "$@" > "$W/$name.log" 2>&1; echo "rc=$?"; grep -E "passed|failed|error" "$W/$name.log" | grep -v "^E " | tail -3; }
step tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:logging --tb=short \
  tests/test_convert.py tests/test_triton_gemm.py tests/test_triton_norm_quant.py tests/test_layers.py \
  -k "compile or inductor or graphed or fused or replay"
step fuzz 100 python3 -m pytest -q -m "gpu and not build" -p no:cacheprovider -p no:logging --tb=short tests/test_fuzz.py
step hf_eager 110 python3 -m bench.hf_model --model llama --layers 8 --variants bf16 fp8_dynamic fp8_static \
  --modes eager --prefill 512 --host-rounds 5 --check-tokens 128 --out "$W/hf_eager"
tail -5 "$W/hf_eager.log"
step kit 90 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:logging --tb=line -k "Contract and not Cutlass" \
  tests/test_triton_gemm.py tests/test_triton_norm_quant.py tests/test_torch_providers.py tests/test_flashinfer.py
left=$((LIMIT - (SECONDS - t0) - 15))
[ $left -gt 60 ] && step hf_prefill $left python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_dynamic fp8_static --modes compiled --no-decode --prefill 512 4096 --compile-scope layers \
  --host-rounds 0 --check-tokens 0 --out "$W/hf_prefill"
tail -4 "$W/hf_prefill.log" 2>/dev/null
tar czf "$OUT/results.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
