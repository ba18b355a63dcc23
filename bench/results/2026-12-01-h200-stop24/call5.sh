#!/usr/bin/env bash
# stop 24 call 5: the GPU tests of the compiled paths with the traced plan (test_convert: the compiled and graphed
# quantized model against the reference; test_layers; test_traced_plan on the GPU host), then bench.compiled_host at
# prefill sizes, alone (host µs of one compiled Fp8Linear per provider, the traced plan now)
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
(timeout 170 python3 -m fp8_backends.build cutlass > "$W/build.log" 2>&1) &
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_convert.py tests/test_traced_plan.py > "$W/t_convert.log" 2>&1 &
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_layers.py > "$W/t_layers.log" 2>&1 &
wait
echo "[$((SECONDS - t0))s] tests done"
tail -3 "$W/t_convert.log" "$W/t_layers.log"
grep -E "FAILED|Error" "$W/t_convert.log" "$W/t_layers.log" | head -10
timeout --kill-after=5 100 python3 -m bench.compiled_host --out "$W/ch" --shapes 4096x4096 4096x14336 --ms 512 \
  --providers triton torch_scaled_mm flashinfer_bmm --rounds 4 > "$W/ch.log" 2>&1
echo "[$((SECONDS - t0))s] compiled_host rc=$?"
grep -A14 "^| " "$W"/ch/compiled_host_*.md | head -30
echo "done at $((SECONDS - t0))s"
