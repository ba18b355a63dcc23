#!/usr/bin/env bash
# stop 23 call 1: CUTLASS build, the whole GPU suite and the GPU fuzz in parallel processes, then the eager host
# table (host µs per Fp8Linear call against nn.Linear, with cProfiles) and eager prefill / logits
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
LIM=${LIM:-300}
W=$OUT/w; mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | tee "$W/gpu.txt"
python3 -c "import torch,triton;print(torch.__version__,torch.version.cuda,triton.__version__)" | tee -a "$W/gpu.txt"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
shard() {  # name limit marker paths/args...
  local name=$1 lim=$2 mk=$3; shift 3
  timeout --kill-after=5 "$lim" python3 -m pytest -q -m "$mk" -p no:cacheprovider --tb=short \
    --durations=5 --junitxml="$W/$name.xml" "$@" > "$W/$name.log" 2>&1
  echo "[$((SECONDS - t0))s] $name rc=$? :: $(grep -E '[0-9]+ (passed|failed|error)' "$W/$name.log" | tail -1)"
}
FS=${FUZZ_SCALE:-0.15}
( timeout 250 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
  shard cutlass $((LIM - (SECONDS - t0) - 5)) gpu tests/test_cutlass.py ) &
shard triton $LIM gpu tests/test_triton_gemm.py &
shard norm $LIM gpu tests/test_triton_norm_quant.py &
shard small $LIM gpu tests/test_triton_quant.py tests/test_quant.py tests/test_layers.py tests/test_convert.py tests/test_tuning.py tests/test_objective.py &
shard fi $LIM gpu tests/test_flashinfer.py tests/test_torch_providers.py &
FP8_FUZZ_SCALE=$FS shard fuzz_gemm $LIM "gpu and not build" tests/test_fuzz.py -k "fuzz_gemm" &
FP8_FUZZ_SCALE=$FS shard fuzz_lin $LIM "gpu and not build" tests/test_fuzz.py -k "functional_linear or quant_ops" &
FP8_FUZZ_SCALE=$FS shard fuzz_norm $LIM "gpu and not build" tests/test_fuzz.py -k "fuzz_norm_quant" &
wait
# every gpu-marked test file the shards above did not name
python3 - <<'PY' > "$W/unnamed.txt"
import pathlib
named = {"test_cutlass.py", "test_triton_gemm.py", "test_triton_norm_quant.py", "test_triton_quant.py", "test_quant.py",
         "test_layers.py", "test_convert.py", "test_tuning.py", "test_objective.py", "test_flashinfer.py",
         "test_torch_providers.py", "test_fuzz.py"}
for p in sorted(pathlib.Path("tests").glob("test_*.py")):
    if p.name not in named and "gpu" in p.read_text():
        print(p)
PY
if [ -s "$W/unnamed.txt" ]; then
  shard rest 120 gpu $(cat "$W/unnamed.txt")
fi
for f in "$W"/*.log; do echo "--- $(basename "$f")"; grep -E "^(FAILED|ERROR)|Falsifying|cases$" "$f" | head -12; done
echo "== eager host table and eager prefill 512 [$((SECONDS - t0))s]"
timeout --kill-after=5 150 python3 -m bench.hf_model --model llama --layers 8 --variants bf16 fp8_static fp8_dynamic \
  --modes eager --no-decode --prefill 512 --host-rounds 5 --host-profile --check-tokens 128 \
  --out "$W/eager" > "$W/eager.log" 2>&1
echo "eager rc=$?"
grep -A12 "^| workload" "$W/eager/hf_model_llama.md" | head -8; grep -A10 "Host µs per call" "$W/eager/hf_model_llama.md" | head -12
tar czf "$OUT/call1.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
