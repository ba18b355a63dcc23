#!/usr/bin/env bash
# stop 24 call 2: issue 15 on the re-decided (tie margin 0) shipped data, in-grid and held out (.device/data/heldout.json
# packed from the margin-0 file: `python -m fp8_backends.selection_data pack fp8_backends/data/selection/sm90-nvidia-h200.json
# --partial --exclude-model gemma3-12b mistral-nemo-12b qwen2.5-3b phi3-mini`); then issue 14: bench/decoder_block.py
# (the traced plan under lib_fused/compiled) and the eager host table with its profile
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout 300 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$?"
timeout --kill-after=5 ${LIM_IN:-150} bash bench/auto_eval.sh "$W/ingrid" --model llama3-8b qwen2-7b llama3-70b llama3.2-1b \
  --tp 1 2 4 8 --limit-seconds $(( ${LIM_IN:-150} - 30 )) > "$W/ingrid.log" 2>&1
echo "[$((SECONDS - t0))s] ingrid rc=$?"
sed -n '/## Targets/,/## By source/p' "$W/ingrid/auto_eval.md" | head -30
timeout --kill-after=5 ${LIM_HO:-150} bash bench/auto_eval.sh "$W/heldout" --data .device/data/heldout.json \
  --model gemma3-12b mistral-nemo-12b qwen2.5-3b phi3-mini --limit-seconds $(( ${LIM_HO:-150} - 30 )) > "$W/heldout.log" 2>&1
echo "[$((SECONDS - t0))s] heldout rc=$?"
sed -n '/## Targets/,/## By source/p' "$W/heldout/auto_eval.md" | head -40
left=$(( ${LIM_ALL:-580} - (SECONDS - t0) ))
if [ $left -gt 90 ]; then
  timeout --kill-after=5 $((left - 60)) python3 -m bench.decoder_block --tokens 1 256 --budget-s $((left - 90)) \
    --out "$W/block" > "$W/block.log" 2>&1
  echo "[$((SECONDS - t0))s] block rc=$?"
  grep -B2 -A16 "call" "$W/block/decoder_block.md" | head -40
fi
left=$(( ${LIM_ALL:-580} - (SECONDS - t0) ))
if [ $left -gt 40 ]; then
  timeout --kill-after=5 $((left - 10)) python3 -m bench.hf_model --model llama --layers 2 --variants bf16 fp8_static fp8_dynamic \
    --modes eager --no-decode --prefill 512 --host-rounds 5 --host-profile --check-tokens 0 --rounds 3 \
    --out "$W/eager" > "$W/eager.log" 2>&1
  echo "[$((SECONDS - t0))s] eager rc=$?"
  grep -A12 "host" "$W/eager/hf_model_llama.md" | head -30
fi
tar czf "$OUT/call2.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
