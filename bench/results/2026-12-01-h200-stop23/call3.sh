#!/usr/bin/env bash
# stop 23 call 3 (issue 14): the whole model compiled (torch.compile(model)), prefill of 512 and 4096 tokens, bf16 /
# torchao / the library (static, dynamic, static with every GEMM on the triton op), with step profiles (host
# against GPU time); then bench/decoder_block.py at T = 1 and 256
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout --kill-after=5 ${LIM_HF:-400} python3 -m bench.hf_model --model llama --layers 8 \
  --variants bf16 torchao fp8_static fp8_dynamic "fp8_static+backend=triton" \
  --modes compiled --no-decode --prefill 512 4096 --host-rounds 0 --check-tokens 0 --step-profile \
  --out "$W/prefill" > "$W/prefill.log" 2>&1
echo "[$((SECONDS - t0))s] prefill rc=$?"
grep -A12 "^| workload" "$W/prefill/hf_model_llama.md" | head -12; grep -E "ready|ERROR|Error" "$W/prefill.log" | tail -12
left=$(( ${LIM_ALL:-575} - (SECONDS - t0) ))
if [ $left -gt 60 ]; then
  timeout --kill-after=5 $left python3 -m bench.decoder_block --tokens 1 256 --budget-s $((left - 25)) \
    --out "$W/block" > "$W/block.log" 2>&1
  echo "[$((SECONDS - t0))s] block rc=$?"
  grep -B2 -A16 "call" "$W/block/decoder_block.md" | head -40
fi
tar czf "$OUT/call3.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
