#!/usr/bin/env bash
# Tune the grid of the shipped selection data on this machine's GPU(s), resumably; when the grid is complete, pack
# the file that ships, evaluate the nearest-shape model on it, and pack a held-out copy for bench.auto_eval.
#
#   bash bench/shipped_data.sh OUTDIR SECONDS
#
# OUTDIR/selection.lock.json is the tuner's lockfile: a partial one from an earlier chunk (SHIPPED_FROM=path, copied
# there when OUTDIR has none) is resumed, never re-measured. SECONDS bounds the tuning: no problem is started that
# would end later (python -m fp8_backends.tune --limit-seconds). SHIPPED_SHARDS=N runs N tuners, shard i on GPU i-1,
# merging into the one lockfile. SHIPPED_ARGS adds tuner arguments. Outputs in OUTDIR when the grid is complete:
#   sm<SM>-<gpu>.json   the data to commit under fp8_backends/data/selection/
#   loo.md, loo.json    leave-one-model-out evaluation of the nearest-shape model on that data (no GPU)
#   heldout.json        the data without HELDOUT_MODELS, for: python -m bench.auto_eval --data heldout.json
# Exit status: the tuners' (3: time limit reached with problems left: run again with SHIPPED_FROM).
set -uo pipefail
out=$1
limit=$2
shards=${SHIPPED_SHARDS:-1}
heldout=${HELDOUT_MODELS:-gemma3-12b mistral-nemo-12b qwen2.5-3b phi3-mini}
mkdir -p "$out"
lock=$out/selection.lock.json
if [ -n "${SHIPPED_FROM:-}" ] && [ ! -f "$lock" ]; then
  cp "$SHIPPED_FROM" "$lock" || exit 1
fi
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
for i in $(seq 1 "$shards"); do
  gpu_env=()
  [ "$shards" -gt 1 ] && gpu_env=(env CUDA_VISIBLE_DEVICES=$((i - 1)))
  # shellcheck disable=SC2086
  ${gpu_env[@]+"${gpu_env[@]}"} python3 -m fp8_backends.tune --shipped-grid --lockfile "$lock" --limit-seconds "$limit" \
    --shard "$i/$shards" --report "$out/tune-report-$i.json" ${SHIPPED_ARGS:-} >"$out/tune-$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || rc=$?
done
for i in $(seq 1 "$shards"); do
  echo "-- tuner $i/$shards:"
  grep -E "problems got a choice|already in|stopped|lockfile:|nothing to do" "$out/tune-$i.log"
done
if python3 -m fp8_backends.selection_data pack "$lock" --out "$out/"; then
  python3 -m fp8_backends.selection_data check "$out"/sm*.json
  python3 -m fp8_backends.selection_data loo "$out"/sm*.json --json "$out/loo.json" >"$out/loo.md" && head -n 30 "$out/loo.md"
  # shellcheck disable=SC2086
  python3 -m fp8_backends.selection_data pack "$lock" --exclude-model $heldout --out "$out/heldout.json"
fi
exit "$rc"
