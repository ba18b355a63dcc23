#!/bin/bash
# stop 16 call 4: Llama 8 layers, compiled decode/graph and compiled prefill 512, one process, static launcher on;
# fp8_static (objective auto: host choices under compile) and fp8_static+objective=kernel (the graph choices)
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
W=$OUT/call4; mkdir -p $W
export PYTHONUNBUFFERED=1
git log --oneline -1 > $W/commit.txt
timeout 540 python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 torchao fp8_static "fp8_static+objective=kernel" \
  --modes compiled graph --prefill 512 --static-launch on --host-rounds 0 --check-tokens 0 --step-profile \
  --out $W/llama > $W/llama.log 2>&1
echo "llama rc=$?"
grep "ready in\|µs (host\|/ graph\|/ compiled" $W/llama.log | head -30
