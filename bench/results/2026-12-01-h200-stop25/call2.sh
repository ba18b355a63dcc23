#!/usr/bin/env bash
# stop 25 call 2 (issue 14): host µs of one compiled Fp8Linear per provider at prefill M (bench.compiled_host), to
# price the triton provider's persistent TMA configs, which stay an opaque op under torch.compile (their Python body
# builds the tensor descriptors and launches through Triton's JIT); call 1's T = 1024 step was slower with triton in
# the q/o M <= 1024 bucket
source .device/setup.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
set -u
export PYTHONUNBUFFERED=1
W=$OUT/w; mkdir -p "$W"
git log --oneline -1 2>/dev/null | tee "$W/commit.txt"
t0=$SECONDS
python3 - <<'PY' | tee "$W/families.txt"
from fp8_backends.providers.triton import gemm_configs as G
for n, k in ((4096, 4096), (4096, 14336), (14336, 4096), (1024, 4096)):
    print(n, k, [(m, G.CONFIGS[G.active_table().pick(m, n, k)].family) for m in (64, 256, 512, 1024, 2048, 4096)])
PY
timeout --kill-after=5 ${LIM:-420} python3 -m bench.compiled_host --out "$W/ch" --shapes 4096x4096 4096x14336 \
  --ms 512 1024 4096 --providers triton torch_scaled_mm flashinfer_bmm --rounds 5 > "$W/ch.log" 2>&1
echo "[$((SECONDS - t0))s] compiled_host rc=$?"
tail -3 "$W/ch.log"
cat "$W"/ch/compiled_host_*.md | head -60
echo "done at $((SECONDS - t0))s"
