#!/bin/bash
# stop 16 call 2: host per compiled linear per provider, static launcher off / on; then one-process decode compare
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
W=$OUT/call2; mkdir -p $W
export PYTHONUNBUFFERED=1
for SL in off on; do
  if [ $SL = on ]; then export TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1; fi
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$SL timeout 200 python3 -m bench.compiled_host --out $W/host --static-launch $SL \
    --providers triton torch_scaled_mm flashinfer_bmm --ms 1 16 512 > $W/host-$SL.log 2>&1
  echo "host $SL rc=$?"
done
unset TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS
timeout 230 python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 fp8_static "fp8_static+backend=triton" --modes compiled --prefill --host-rounds 0 --check-tokens 0 \
  --rounds 7 --out $W/decode1p > $W/decode1p.log 2>&1
echo "decode1p rc=$?"
grep -A30 "^| N x K" $W/host/*.md; grep -A3 "Bypassing" $W/host/*.md | head; grep "decode / compiled" $W/decode1p.log
