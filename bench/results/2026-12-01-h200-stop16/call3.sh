#!/bin/bash
# stop 16 call 3: Llama 8 layers, one process, static launcher on, objective auto (quantize_model's default)
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
W=$OUT/call3; mkdir -p $W
export PYTHONUNBUFFERED=1
git log --oneline -1 > $W/commit.txt
timeout 585 python3 -m bench.hf_model --model llama --layers 8 --variants bf16 torchao fp8_static fp8_dynamic \
  --modes eager compiled graph --prefill 512 --static-launch on --host-rounds 5 --check-tokens 128 --step-profile \
  --out $W/llama > $W/llama.log 2>&1
echo "llama rc=$?"
grep -A12 "^| workload" $W/llama/hf_model_llama.md | head -14; grep -A12 "Host µs per call" $W/llama/hf_model_llama.md | head -14
grep -B2 -A8 "Logits against" $W/llama/hf_model_llama.md | head -12; tail -5 $W/llama.log
