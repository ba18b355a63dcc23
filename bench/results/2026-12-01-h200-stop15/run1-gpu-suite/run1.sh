#!/usr/bin/env bash
# GPU correctness in one call: the whole GPU suite in parallel shards + the GPU fuzz (logs and junit under $OUT)
set -u
export PYTHONUNBUFFERED=1
LIM=${LIM:-540}
W=$OUT/w; mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
python3 -c "import torch,triton;print(torch.__version__,torch.version.cuda,triton.__version__)"
t0=$SECONDS
shard() {  # name limit marker paths... (extra args after --)
  local name=$1 lim=$2 mk=$3; shift 3
  timeout --kill-after=5 "$lim" python3 -m pytest -q -m "$mk" -p no:cacheprovider -p no:logging --tb=short \
    --durations=5 --junitxml="$W/$name.xml" "$@" > "$W/$name.log" 2>&1
  echo "[$((SECONDS - t0))s] $name rc=$? :: $(grep -E '[0-9]+ (passed|failed)' "$W/$name.log" | tail -1)"
}
( shard cutlass $((LIM - 20)) gpu tests/test_cutlass.py
  left=$((LIM - (SECONDS - t0) - 10)); [ $left -gt 30 ] && FP8_FUZZ_SCALE=${FUZZ_SCALE:-0.5} shard fuzz_cutlass $left "gpu and build" --run-build tests/test_fuzz.py ) &
shard triton $((LIM - 20)) gpu tests/test_triton_gemm.py &
shard small $((LIM - 20)) gpu tests/test_triton_norm_quant.py tests/test_triton_quant.py tests/test_quant.py tests/test_layers.py tests/test_convert.py tests/test_tuning.py &
shard fi $((LIM - 20)) gpu tests/test_flashinfer.py tests/test_torch_providers.py &
FP8_FUZZ_SCALE=${FUZZ_SCALE:-0.5} shard fuzz $((LIM - 20)) "gpu and not build" tests/test_fuzz.py &
wait
for f in "$W"/*.log; do echo "--- $(basename "$f")"; grep -E "^(FAILED|ERROR)|Falsifying|seed" "$f" | head -8; done
tar czf "$OUT/results.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
