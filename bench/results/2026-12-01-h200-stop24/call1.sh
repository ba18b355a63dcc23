#!/usr/bin/env bash
# stop 24 call 1 (issue 14): the traced plan (fp8_backends/traced_plan.py) against the general path it replaces under
# torch.compile (+plan=general), whole-model compiled prefill at T = 512 and one-token decode, compiled and in CUDA
# graphs; one process per variant (--parallel-compile). The CUTLASS build runs beside it for the next call.
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
(timeout 400 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1; echo "build rc=$?" >> "$W/build.log") &
timeout --kill-after=5 ${LIM:-540} python3 -m bench.hf_model --model llama --layers 8 --parallel-compile \
  --variants bf16 fp8_static fp8_static+plan=general --prefill 512 --modes compiled graph \
  --host-rounds 0 --check-tokens 0 --rounds 7 --out "$W/hf" > "$W/hf.log" 2>&1
echo "[$((SECONDS - t0))s] hf rc=$?"
tail -5 "$W/hf.log"
cat "$W"/hf/*.md 2>/dev/null | head -60
wait
tail -2 "$W/build.log"
echo "done at $((SECONDS - t0))s"
