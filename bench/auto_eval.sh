#!/usr/bin/env bash
# bench.auto_eval on this machine's GPU(s): with EVAL_SHARDS=N, N processes (shard i on GPU i-1) measure the shards
# of the grid in parallel into OUTDIR/shard-i, and one merged report lands in OUTDIR.
#
#   bash bench/auto_eval.sh OUTDIR [bench.auto_eval arguments ...]
set -uo pipefail
out=$1
shift
shards=${EVAL_SHARDS:-1}
if [ "$shards" -le 1 ]; then
  exec python3 -m bench.auto_eval --out "$out" --no-progress "$@"
fi
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
dirs=()
for i in $(seq 1 "$shards"); do
  mkdir -p "$out/shard-$i"
  CUDA_VISIBLE_DEVICES=$((i - 1)) python3 -m bench.auto_eval --out "$out/shard-$i" --no-progress --shard "$i/$shards" \
    "$@" >"$out/shard-$i/log.txt" 2>&1 &
  pids+=($!)
  dirs+=("$out/shard-$i")
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || rc=$?
done
python3 -m bench.auto_eval --merge "${dirs[@]}" --out "$out" | head -n 40
exit "$rc"
