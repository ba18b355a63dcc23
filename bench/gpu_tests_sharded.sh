#!/usr/bin/env bash
# The GPU test suite (`pytest -m gpu`) in parallel pytest processes, one per group of test files, so that it fits one
# device call (~5 minutes on the H200 machine instead of ~15 in one process). The GPU fuzz runs at FP8_FUZZ_SCALE
# (default 0.1). Every test file that mentions the gpu marker and no group names runs in the group "rest".
#
#   bash bench/gpu_tests_sharded.sh OUTDIR [LIMIT_SECONDS]
#
# TEST_GROUPS (space-separated group names) runs only those groups. Writes OUTDIR/<group>.log and OUTDIR/<group>.xml
# (JUnit), prints one line per group and every failure; exits 1
# when a group failed or ran out of time.
set -u
out=$1
lim=${2:-540}
mkdir -p "$out"
t0=$SECONDS
export FP8_FUZZ_SCALE=${FP8_FUZZ_SCALE:-0.1}

group() {  # name marker paths/args...
  local name=$1 marker=$2; shift 2
  case " ${TEST_GROUPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
  # SIGINT first: pytest stops where it is and still prints its failures and summary
  timeout --signal=INT --kill-after=15 "$((lim - 20))" python3 -m pytest -q -m "$marker" -p no:cacheprovider --tb=short \
    --junitxml="$out/$name.xml" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "[$((SECONDS - t0))s] $name rc=$rc :: $(grep -E '[0-9]+ (passed|failed|error)' "$out/$name.log" | tail -1)"
  return "$rc"
}

block="test_triton_block_gemm.py test_triton_group_quant.py test_triton_norm_dynamic.py test_triton_block_provider.py"
views="test_fuzz_views.py test_strided_inputs.py test_unaligned.py"
block_jit="test_cutlass_block.py test_flashinfer_block.py"
named="test_cutlass.py test_triton_gemm.py test_triton_norm_quant.py test_fuzz.py test_flashinfer.py test_torch_providers.py"
named="$named $block $views $block_jit"
rest=()
for path in tests/test_*.py; do
  case " $named " in *" $(basename "$path") "*) continue ;; esac
  grep -q "gpu" "$path" && rest+=("$path")
done

pids=()
group cutlass gpu tests/test_cutlass.py & pids+=($!)
group triton gpu tests/test_triton_gemm.py & pids+=($!)
group norm gpu tests/test_triton_norm_quant.py & pids+=($!)
group providers gpu tests/test_flashinfer.py tests/test_torch_providers.py & pids+=($!)
group triton_block gpu $(for f in $block; do echo "tests/$f"; done) & pids+=($!)
group views gpu $(for f in $views; do echo "tests/$f"; done) & pids+=($!)
group block_jit gpu $(for f in $block_jit; do echo "tests/$f"; done) & pids+=($!)
group rest gpu "${rest[@]}" & pids+=($!)
group fuzz_gemm "gpu and not build" tests/test_fuzz.py -k "fuzz_gemm" & pids+=($!)
group fuzz_linear "gpu and not build" tests/test_fuzz.py -k "functional_linear or quant_ops" & pids+=($!)
group fuzz_norm "gpu and not build" tests/test_fuzz.py -k "fuzz_norm_quant" & pids+=($!)
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || rc=1
done
for log in "$out"/*.log; do
  grep -E "^(FAILED|ERROR)|Falsifying|cases$" "$log" | head -12 | sed "s|^|$(basename "$log" .log): |"
done
exit "$rc"
