#!/usr/bin/env bash
# One command that checks and times everything on a GPU machine (the H200 the project measures on).
#
#   source .device/setup.sh || exit 1; bash bench/run_device.sh [STAGE ...]
#
# Stages (default: all, in this order): install list tests build cutlass_cfg triton_cfg flashinfer host tune gemm
# norm chain block; also norm_cfg (the norm-quant warps sweep), profile (the decoder block kernel by kernel),
# hf (a transformers model in bf16 / torchao / fp8-backends, bench/hf_model.py, HF_ARGS),
# shipped (tune the shipped selection data grid, resumable: bench/shipped_data.sh; SHIPPED_FROM, SHIPPED_SHARDS),
# heldout (bench.auto_eval on HELDOUT_MODELS against HELDOUT_DATA, the data packed without them) and auto_eval
# (bench.auto_eval with EVAL_ARGS; EVAL_SHARDS=N splits both over N GPUs: bench/auto_eval.sh), not in the default list
# ingrid (bench.auto_eval on the shipped grid's INGRID_MODELS at TP 1/2/4/8: issue 15's in-grid targets) is not in the
# default list either; block_gemm (bench/block_gemm.py, --quick unless BLOCK_GEMM_ARGS), unaligned (bench/unaligned.py)
# and ckpt (bench/checkpoints.py) are not in it either; heldout packs HELDOUT_DATA itself (the shipped file without HELDOUT_MODELS) when it is missing.
# The tests stage runs 8 pytest processes side by side (bench/gpu_tests_sharded.sh: one per group of test files, the
# GPU fuzz at FP8_FUZZ_SCALE, 0.1 by default), which fits the device tool's 10-minute call; TESTS_SHARDS=1 or
# TESTS_PATHS runs one process.
# A CUTLASS build cache carried in .prebuilt/cutlass (built on a CPU machine with nvcc 13 and nvidia-cutlass:
# `FP8_BACKENDS_CUTLASS_CACHE=$PWD/.prebuilt/cutlass python -m fp8_backends.build cutlass`), or packed as
# .prebuilt/cutlass.tar.xz (`tar -C .prebuilt -cJf .prebuilt/cutlass.tar.xz --exclude='*.lock' cutlass`: 1.1 MB for
# the 22 libraries against 22 MB unpacked, which matters under the device tool's 64 MiB), is used instead of building
# the kernels here (~110-220 s on a fresh machine): carry `.prebuilt/cutlass.tar.xz`. The cache key holds the kernel
# source, flags, nvcc and CUTLASS versions: after a change the device finds none cached and builds as before.
# The build stage also builds the cutlass provider's C++ op against this machine's torch (~30 s on the H200; it cannot
# be prebuilt on a CPU machine's torch); run it before tests, or the first test that needs it builds it.
# Each stage has its own time limit (override: LIMIT_<stage>=seconds), logs to $OUT/logs/<stage>.log, and a
# failing stage does not stop the others. TESTS_PATHS narrows the tests stage. Extra arguments per stage: TESTS_ARGS, TUNE_ARGS, GEMM_ARGS,
# NORM_ARGS, BLOCK_ARGS, BLOCK_GEMM_ARGS, UNALIGNED_ARGS, CKPT_ARGS, CUTLASS_ARGS, TRITON_ARGS, HOST_ARGS, CHAIN_ARGS, NORM_CFG_ARGS, PROFILE_ARGS, HF_ARGS (e.g. GEMM_ARGS="--models llama3-8b --m 1,16,256,4096").
# At the end everything under $OUT/work is packed into $OUT/results.tar.gz (the device tool returns at most
# 8 files) and a summary of every stage is printed.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs" "$OUT/work"
W=$OUT/work
export PYTHONUNBUFFERED=1
if [ -f .prebuilt/cutlass.tar.xz ]; then  # the CUTLASS build cache, packed on a CPU machine (see above)
  mkdir -p /tmp/fp8b-cutlass && tar -C /tmp/fp8b-cutlass -xJf .prebuilt/cutlass.tar.xz &&
    export FP8_BACKENDS_CUTLASS_CACHE=/tmp/fp8b-cutlass/cutlass
elif [ -d .prebuilt/cutlass ]; then
  export FP8_BACKENDS_CUTLASS_CACHE=$PWD/.prebuilt/cutlass
fi
if [ -f .prebuilt/fi-ws.tar.xz ] && [ ! -d /tmp/fi-ws/.cache ]; then  # flashinfer's built fp8_blockscale module
  tar -C /tmp -xJf .prebuilt/fi-ws.tar.xz  # (its JIT cache, .device/setup.sh's FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws)
fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install list tests build cutlass_cfg triton_cfg flashinfer host tune gemm norm chain block)
summary=()

run_stage() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local override="LIMIT_$name"
  limit=${!override:-$limit}
  local t0=$SECONDS rc
  echo "== $name (limit ${limit}s)"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  tail -n 25 "$OUT/logs/$name.log" | grep -v "nanobind: leaked" | tail -n 12
}

for stage in "${stages[@]}"; do
  case $stage in
    install)
      run_stage install 300 bash -c 'python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . &&
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv &&
        python3 -c "import torch,triton;print(torch.__version__,torch.version.cuda,triton.__version__)"' ;;
    list)
      run_stage list 120 bash -c "python3 -m fp8_backends.list && python3 -m fp8_backends.list --json > $W/list.json" ;;
    tests)
      if [ "${TESTS_SHARDS:-8}" -le 1 ] || [ -n "${TESTS_PATHS:-}" ]; then
        # shellcheck disable=SC2086
        run_stage tests 900 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 ${TESTS_PATHS:-tests} \
          --junitxml="$W/gpu-tests.xml" ${TESTS_ARGS:-}
      else
        run_stage tests 540 bash bench/gpu_tests_sharded.sh "$W/tests" "${LIMIT_tests:-540}"
      fi ;;
    build)
      [ -f fp8_backends/build.py ] && run_stage build 600 python3 -m fp8_backends.build cutlass ;;
    cutlass_cfg)
      [ -f bench/cutlass_configs.py ] && run_stage cutlass_cfg 600 python3 -m bench.cutlass_configs --out "$W/cutlass" ${CUTLASS_ARGS:-} ;;
    triton_cfg)
      [ -f bench/triton_configs.py ] && run_stage triton_cfg 600 python3 -m bench.triton_configs --out "$W/triton" ${TRITON_ARGS:-} ;;
    host)
      [ -f bench/host_cost.py ] && run_stage host 300 python3 -m bench.host_cost --out "$W/host" ${HOST_ARGS:-} ;;
    norm_cfg)
      [ -f bench/norm_configs.py ] && run_stage norm_cfg 600 python3 -m bench.norm_configs --out "$W/norm_cfg" ${NORM_CFG_ARGS:-} ;;
    profile)
      [ -f bench/block_profile.py ] && run_stage profile 600 python3 -m bench.block_profile --out "$W/profile" ${PROFILE_ARGS:-} ;;
    chain)
      [ -f bench/pdl_chain.py ] && run_stage chain 300 python3 -m bench.pdl_chain --out "$W/chain" ${CHAIN_ARGS:-} ;;
    flashinfer)
      [ -f bench/flashinfer_host.py ] && run_stage flashinfer 600 python3 -m bench.flashinfer_host --out "$W/flashinfer" ;;
    tune)
      [ -f fp8_backends/tune.py ] && run_stage tune 600 python3 -m fp8_backends.tune --model llama3-8b \
        --lockfile "$W/selection.lock.json" --report "$W/tune-report.json" ${TUNE_ARGS:-} ;;
    gemm)
      [ -f bench/gemm.py ] && FP8_BACKENDS_LOCKFILE="$W/selection.lock.json" \
        run_stage gemm 900 python3 -m bench.gemm --out "$W/gemm" ${GEMM_ARGS:-} ;;
    norm)
      [ -f bench/norm_quant.py ] && run_stage norm 600 python3 -m bench.norm_quant --out "$W/norm" ${NORM_ARGS:-} ;;
    shipped)
      lim=${LIMIT_shipped:-540}
      run_stage shipped "$lim" bash bench/shipped_data.sh "$W/shipped" "$((lim - 45))" ;;
    heldout)
      heldout_models=${HELDOUT_MODELS:-gemma3-12b mistral-nemo-12b qwen2.5-3b phi3-mini}
      heldout_data=${HELDOUT_DATA:-$W/shipped/heldout.json}
      if [ ! -f "$heldout_data" ]; then
        heldout_data=$W/heldout-data.json
        # shellcheck disable=SC2086
        python3 -m fp8_backends.selection_data pack fp8_backends/data/selection/sm90-nvidia-h200.json --partial \
          --exclude-model $heldout_models --out "$heldout_data"
      fi
      # shellcheck disable=SC2086
      run_stage heldout 600 bash bench/auto_eval.sh "$W/heldout" --data "$heldout_data" \
        --model $heldout_models ${HELDOUT_ARGS:-} ;;
    ingrid)
      # shellcheck disable=SC2086
      run_stage ingrid 600 bash bench/auto_eval.sh "$W/ingrid" \
        --model ${INGRID_MODELS:-llama3-8b qwen2-7b llama3-70b llama3.2-1b} --tp 1 2 4 8 ${INGRID_ARGS:-} ;;
    auto_eval)
      # shellcheck disable=SC2086
      run_stage auto_eval "${LIMIT_auto_eval:-600}" bash bench/auto_eval.sh "$W/auto_eval" ${EVAL_ARGS:---model llama3-8b} ;;
    block)
      [ -f bench/decoder_block.py ] && FP8_BACKENDS_LOCKFILE="$W/selection.lock.json" \
        run_stage block 900 python3 -m bench.decoder_block --out "$W/block" ${BLOCK_ARGS:-} ;;
    block_gemm)
      [ -f bench/block_gemm.py ] && run_stage block_gemm 600 python3 -m bench.block_gemm --out "$W/block_gemm" \
        ${BLOCK_GEMM_ARGS:---quick} ;;
    unaligned)
      [ -f bench/unaligned.py ] && run_stage unaligned 300 python3 -m bench.unaligned --out "$W/unaligned" \
        ${UNALIGNED_ARGS:---quick} ;;
    ckpt)
      # needs transformers and compressed-tensors: ../shared/tools/make-device-bundle --hf
      [ -f bench/checkpoints.py ] && run_stage ckpt 900 python3 -m bench.checkpoints --out "$W/checkpoints" \
        ${CKPT_ARGS:-} ;;
    hf)
      # needs transformers (+ torchao for its baseline): ../shared/tools/make-device-bundle --hf
      [ -f bench/hf_model.py ] && run_stage hf 900 python3 -m bench.hf_model --out "$W/hf" ${HF_ARGS:-} ;;
    *) echo "unknown stage $stage" ;;
  esac
done

cp "$OUT"/logs/*.log "$W/" 2>/dev/null
tar -C "$OUT" -czf "$OUT/results-$(date +%H%M%S).tar.gz" work
rm -rf "$OUT/logs" "$W"
echo "== summary"
printf '%s\n' "${summary[@]}"
