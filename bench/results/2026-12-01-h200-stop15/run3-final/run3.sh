#!/usr/bin/env bash
# final GPU call: the whole GPU suite and the GPU fuzz in parallel processes, then (time left) regional compiled decode
set -u
export PYTHONUNBUFFERED=1
LIM=${LIM:-420}     # tests and fuzz
BLIM=${BLIM:-150}   # the decode bench after them
W=$OUT/w; mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
python3 -c "import torch,triton;print(torch.__version__,torch.version.cuda,triton.__version__)"
git log --oneline -1 2>/dev/null
t0=$SECONDS
shard() {  # name limit marker paths/args...
  local name=$1 lim=$2 mk=$3; shift 3
  timeout --kill-after=5 "$lim" python3 -m pytest -q -m "$mk" -p no:cacheprovider --tb=short \
    --durations=5 --junitxml="$W/$name.xml" "$@" > "$W/$name.log" 2>&1
  echo "[$((SECONDS - t0))s] $name rc=$? :: $(grep -E '[0-9]+ (passed|failed)' "$W/$name.log" | tail -1)"
}
FS=${FUZZ_SCALE:-0.3}
( shard cutlass $((LIM - 10)) gpu tests/test_cutlass.py
  left=$((LIM - (SECONDS - t0) - 5)); [ $left -gt 30 ] && FP8_FUZZ_SCALE=${FUZZ_SCALE_CUTLASS:-0.15} shard fuzz_cutlass $left "gpu and build" --run-build tests/test_fuzz.py ) &
shard triton $LIM gpu tests/test_triton_gemm.py &
shard norm $LIM gpu tests/test_triton_norm_quant.py &
shard small $LIM gpu tests/test_triton_quant.py tests/test_quant.py tests/test_layers.py tests/test_convert.py tests/test_tuning.py &
shard fi $LIM gpu tests/test_flashinfer.py tests/test_torch_providers.py &
FP8_FUZZ_SCALE=$FS shard fuzz_gemm $LIM "gpu and not build" tests/test_fuzz.py -k "fuzz_gemm" &
FP8_FUZZ_SCALE=$FS shard fuzz_lin $LIM "gpu and not build" tests/test_fuzz.py -k "functional_linear or quant_ops" &
FP8_FUZZ_SCALE=$FS shard fuzz_norm $LIM "gpu and not build" tests/test_fuzz.py -k "fuzz_norm_quant" &
wait
for f in "$W"/*.log; do echo "--- $(basename "$f")"; grep -E "^(FAILED|ERROR)|Falsifying|cases$" "$f" | head -12; done
tar czf "$OUT/tests.tar.gz" -C "$W" .
left=$((LIM + BLIM - (SECONDS - t0) - 10))
if [ $left -gt 60 ]; then
  echo "== decode bench (limit ${left}s)"
  timeout --kill-after=5 $left python3 -m bench.hf_model --model llama --layers 8 --compile-scope layers --host-rounds 0 \
    --check-tokens 0 --variants bf16 fp8_static fp8_dynamic --modes compiled graph --prefill --static-launch on \
    --out "$W/decode_on" > "$W/decode_on.log" 2>&1
  grep -E "µs \(host|ready|ERROR" "$W/decode_on.log" | tail -12
  tar czf "$OUT/bench.tar.gz" -C "$W" decode_on decode_on.log 2>/dev/null
fi
echo "done at $((SECONDS - t0))s"
