#!/bin/bash
# stop 16 call 1: whole-model compiled decode (no graph / graph), static launcher and triton-everywhere proxy
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
W=$OUT/call1; mkdir -p $W
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $W/gpu.txt
git log --oneline -1 > $W/commit.txt
timeout 570 python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 torchao fp8_static fp8_static_sl "fp8_static_sl+backend=triton" \
  --modes compiled graph --prefill --host-rounds 0 --check-tokens 0 --step-profile --parallel-compile \
  --out $W/decode > $W/decode.log 2>&1
echo "rc=$?" >> $W/decode.log
tail -40 $W/decode.log
