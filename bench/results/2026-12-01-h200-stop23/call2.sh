#!/usr/bin/env bash
# stop 23 call 2 (issue 15): auto measured without a lockfile on points of the shipped grid (in-grid), then on four
# models left out of the data (.device/data/heldout.json: `python -m fp8_backends.selection_data pack
# fp8_backends/data/selection/sm90-nvidia-h200.json --partial --exclude-model gemma3-12b mistral-nemo-12b qwen2.5-3b
# phi3-mini`), the same held-out set as stop 13
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
timeout 60 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "[$((SECONDS - t0))s] build rc=$? (cached: a few s)"
timeout --kill-after=5 ${LIM_IN:-270} bash bench/auto_eval.sh "$W/ingrid" --model llama3-8b qwen2-7b llama3-70b llama3.2-1b \
  --tp 1 2 4 8 --limit-seconds $(( ${LIM_IN:-270} - 40 )) > "$W/ingrid.log" 2>&1
echo "[$((SECONDS - t0))s] ingrid rc=$?"
sed -n '/## Targets/,/## By source/p' "$W/ingrid/auto_eval.md" | head -30
timeout --kill-after=5 ${LIM_HO:-260} bash bench/auto_eval.sh "$W/heldout" --data .device/data/heldout.json \
  --model gemma3-12b mistral-nemo-12b qwen2.5-3b phi3-mini --limit-seconds $(( ${LIM_HO:-260} - 40 )) > "$W/heldout.log" 2>&1
echo "[$((SECONDS - t0))s] heldout rc=$?"
sed -n '/## Targets/,/## By source/p' "$W/heldout/auto_eval.md" | head -40
grep -A5 "## By source" "$W/heldout/auto_eval.md"
tar czf "$OUT/call2.tar.gz" -C "$W" .
echo "done at $((SECONDS - t0))s"
