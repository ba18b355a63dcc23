"""``python -m bench.block_kernels_sm90``: compile the block-wise Triton kernels for sm_90a without a GPU and report
what each variant takes: registers, local-memory spills, shared memory, and whether it lowered to what it is meant
to (wgmma for the tensor-core families, cp.async or TMA loads for the pipelines, griddepcontrol for PDL).

    python -m bench.block_kernels_sm90            # every shipped GEMM config (even and ragged K), group quant, norm
    python -m bench.block_kernels_sm90 --quick    # one variant per kernel (what the CPU test runs)

Triton's interpreter (the CPU tests) runs the kernels' semantics but never lowers them: a register spill, a load
that lost its vector width or a kernel that no longer compiles for the device only shows here (or on the GPU).
Exit status 1 when a variant fails to compile or spills. Compiling for a GPU target needs ``TRITON_INTERPRET``
unset (the JIT functions are defined differently under the interpreter): the module refuses to run otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

TARGET = ("cuda", 90, 32)
P8 = "*fp8e4nv"
GEMM_TYPES = dict(x_ptr=P8, w_ptr=P8, out_ptr="*bf16", xs_ptr="*fp32", ws_ptr="*fp32", bias_ptr="*bf16",
                  part_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", kb_per_split="i32", num_progs="i32",
                  **{s: "i32" for s in ("stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_om", "stride_on",
                                        "stride_xsm", "stride_xsk", "stride_wsn", "stride_wsk", "stride_b")})
GEMM_POINTERS = ("x_ptr", "w_ptr", "out_ptr", "xs_ptr", "ws_ptr", "bias_ptr", "part_ptr", "cnt_ptr")


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """``(registers, stack bytes)`` of a cubin, from the cuobjdump Triton ships."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def compile_variant(fn: Any, types: dict[str, str], consts: dict[str, Any], aligned: list[str], warps: int,
                    stages: int) -> dict[str, Any]:
    """Compile one specialization for sm_90a: ``consts`` are the constexprs (and the ints specialized to 1),
    ``aligned`` the arguments Triton would see as 16-divisible."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = [p.name for p in fn.params]
    signature = {p: ("constexpr" if p in consts else types[p]) for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in aligned if p in params and p not in consts}
    src = ASTSource(fn, signature, constexprs={(params.index(k),): v for k, v in consts.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget(*TARGET), options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    regs, stack = _resources(compiled.asm["cubin"])
    return {"regs": regs, "stack": stack, "shared": compiled.metadata.shared,
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "mma_sync": len(re.findall(r"mma\.sync\.aligned", ptx)),
            "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
            "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)), "pdl": "griddepcontrol" in ptx,
            "l2_prefetch": len(re.findall(r"cp\.async\.bulk\.prefetch\.L2", ptx))}


def gemm_variant(cfg: Any, even: bool = True, align: int = 16, split: int | None = None,
                 x_quant: bool = False) -> tuple[str, dict]:
    """One specialization of ``cfg``'s kernel; ``x_quant`` (GEMV): the fused launch, a bf16 activation quantized in
    the kernel."""
    from fp8_backends.providers.triton import block_gemm_kernels as K
    from fp8_backends.providers.triton.block_gemm_args import prefetch_chunks

    common = dict(GROUP_K=128, WBN=128, WBK=128, HAS_BIAS=True, USE_PDL=True)
    if cfg.family != "tma":
        common["PREFETCH"] = prefetch_chunks(cfg, True, 1)
    unit = dict(stride_xk=1, stride_wk=1, stride_on=1, stride_b=1)
    aligned = [*GEMM_POINTERS, "N", "stride_om", "stride_xsk"] + (["K", "stride_xm", "stride_wn"] if align == 16
                                                                  else [])
    name = f"{cfg.name} even_k={even} row_align={align}" + (" fused" if x_quant else "")
    if cfg.family == "gemv":
        consts = dict(common, BLOCK_N=cfg.block_n, GROUPS=cfg.groups, EVEN_K=even, ROW_ALIGN=align, **unit,
                      stride_xsk=1, stride_wsk=1, X_QUANT=x_quant, FMAX=448.0)
        types = dict(GEMM_TYPES, x_ptr="*bf16") if x_quant else GEMM_TYPES
        info = compile_variant(K.block_gemv_kernel, types, consts, aligned, cfg.warps, cfg.stages)
        info["want_prefetch"] = bool(consts["PREFETCH"])
        return name, info
    if cfg.family == "tma":
        types = dict(GEMM_TYPES, x_desc=f"tensordesc<fp8e4nv[{cfg.block_m}, 128]>",
                     w_desc=f"tensordesc<fp8e4nv[{cfg.block_n}, 128]>")
        consts = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, stride_on=1, stride_b=1,
                      stride_xsm=1)
        return name, compile_variant(K.block_gemm_tma_kernel, types, consts, aligned, cfg.warps, cfg.stages)
    sk = split if split is not None else (cfg.split_k or 4)
    consts = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=sk, EVEN_K=even, ROW_ALIGN=align, **unit,
                  stride_xsm=1)
    if cfg.family == "mm":
        consts["GROUP_M"] = cfg.group_m
    fn = K.block_gemm_swap_kernel if cfg.family == "swap" else K.block_gemm_mm_kernel
    info = compile_variant(fn, GEMM_TYPES, consts, aligned, cfg.warps, cfg.stages)
    info["want_prefetch"] = bool(consts["PREFETCH"])
    info["mma_rows"] = cfg.block_n if cfg.family == "swap" else cfg.block_m  # the MMA's M side
    return f"{name} split={sk}", info


def quant_variant(k: int, group: int) -> tuple[str, dict]:
    from fp8_backends.providers.triton import group_quant_kernels as gq

    cfg = gq.group_config(k, group)
    types = dict(x_ptr="*bf16", q_ptr=P8, s_ptr="*fp32", M="i32", K="i32", stride_xm="i32", stride_xk="i32",
                 stride_qm="i32", stride_sm="i32", stride_sg="i32")
    consts = dict(FMAX=448.0, ROWS=cfg.rows, GROUPS=cfg.groups, G=group, USE_PDL=True, stride_xk=1, stride_sg=1)
    return (f"group_quant K={k} G={group} rows={cfg.rows} groups={cfg.groups}",
            compile_variant(gq._group_quant_kernel, types, consts, ["x_ptr", "q_ptr", "s_ptr", "K", "stride_xm",
                                                                    "stride_qm"], cfg.num_warps, 3))


def norm_variant(t: int, h: int, add: bool, per_token: bool, cfg: Any = None) -> tuple[str, dict]:
    """The fused norm's kernel for ``[t, h]`` rows at :func:`dyn_config`'s launch (or ``cfg``)."""
    from fp8_backends.providers.triton import norm_dynamic_kernels as nd

    cfg = cfg or nd.dyn_config(t, h, add, 128, per_token)
    types = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", q_ptr=P8, s_ptr="*fp32", T="i32", H="i32",
                 stride_x="i32", stride_r="i32", stride_q="i32", stride_w="i32", stride_sm="i32", stride_sg="i32",
                 eps="fp32")
    common = dict(FMAX=448.0, ADD=add, USE_PDL=True, stride_w=1, stride_sg=1)
    if cfg.path == "loop":
        fn, consts = nd._norm_dyn_loop_kernel, dict(common, NGC=cfg.ng, G=cfg.gb, PER_TOKEN=per_token)
    elif cfg.path == "packed":
        fn = nd._norm_dyn_packed_kernel
        consts = dict(common, ROWS=cfg.rows, ROWS_P2=1 << (cfg.rows - 1).bit_length(), NGR=cfg.ng,
                      SLOTS=1 << (cfg.rows * cfg.ng - 1).bit_length(), GB=cfg.gb, PER_TOKEN=per_token)
    elif cfg.path == "parts":
        p0, p1, p2 = nd.row_parts(cfg.ng)
        fn, consts = nd._norm_dyn_parts_kernel, dict(common, P0=p0, P1=p1, P2=p2, GB=cfg.gb, PER_TOKEN=per_token)
    else:
        fn, consts = nd._norm_dyn_block_kernel, dict(common, ROWS=cfg.rows, NG=cfg.ng, GB=cfg.gb)
    name = f"norm T={t} H={h} add={add} per_token={per_token} {cfg.path} rows={cfg.rows} ng={cfg.ng} gb={cfg.gb}"
    return name, compile_variant(fn, types, consts, ["x_ptr", "r_ptr", "w_ptr", "q_ptr", "s_ptr", "H", "stride_x",
                                                     "stride_r", "stride_q"], cfg.num_warps, 3)


def variants(quick: bool) -> list[tuple[str, Any]]:
    """``(family, thunk)`` of every variant to compile (``quick``: one per kernel)."""
    from fp8_backends.providers.triton import block_gemm_configs as bc

    out: list[tuple[str, Any]] = []
    if quick:
        picks = {"gemv": "gemv_n2_g8_w2", "swap": "swap_n64_m16_s8_w4_sk0", "mm": "mm_n128_m64_s4_w4_g8_sk0",
                 "tma": "tma_n128_m64_s4_w4_g8_p2"}
        for family, name in picks.items():
            out.append((family, lambda cfg=bc.CONFIGS[name]: gemm_variant(cfg)))
        out.append(("swap", lambda: gemm_variant(bc.CONFIGS[picks["swap"]], even=False, align=8)))
        out.append(("gemv", lambda: gemm_variant(bc.CONFIGS[bc.FUSED_GEMV], x_quant=True)))
        for name in ("gemv_n8_g8_w4_pf", "swap_n64_m16_s8_w4_sk0_pf"):  # the weight prefetched ahead of the wait
            out.append((name.split("_")[0], lambda name=name: gemm_variant(bc.BlockTileConfig.from_name(name),
                                                                            even=False, align=8)))
        out.append(("quant", lambda: quant_variant(7168, 128)))
        out.append(("norm", lambda: norm_variant(4096, 7168, True, False)))
        out.append(("norm", lambda: norm_variant(16384, 5120, False, False)))  # the packed kernel
        out.append(("norm", lambda: norm_variant(16384, 5120, True, False, _parts(5120))))
        return out
    for cfg in bc.CONFIG_LIST:
        out.append((cfg.family, lambda cfg=cfg: gemm_variant(cfg)))
        if cfg.family != "tma":
            out.append((cfg.family, lambda cfg=cfg: gemm_variant(cfg, even=False, align=8)))
        if cfg.split_k == 0:
            out.append((cfg.family, lambda cfg=cfg: gemm_variant(cfg, split=1)))
        if cfg.family == "gemv":  # the fused launch too
            out.append((cfg.family, lambda cfg=cfg: gemm_variant(cfg, x_quant=True)))
            out.append((cfg.family, lambda cfg=cfg: gemm_variant(cfg, even=False, align=8, x_quant=True)))
    for k in (7168, 4096, 6840, 200):
        for group in (128, 64):
            out.append(("quant", lambda k=k, group=group: quant_variant(k, group)))
    for t, h in ((1, 7168), (4096, 7168), (4096, 4096), (16384, 5120), (64, 512), (8, 65536)):
        for add in (False, True):
            for per_token in (False, True):
                out.append(("norm", lambda t=t, h=h, add=add, per_token=per_token: norm_variant(t, h, add,
                                                                                                 per_token)))
    for h in (5120, 7168):  # the parts kernel (a candidate launch, not dyn_config's yet)
        for add in (False, True):
            for per_token in (False, True):
                out.append(("norm", lambda h=h, add=add, per_token=per_token: norm_variant(16384, h, add, per_token,
                                                                                           _parts(h))))
    return out


def _parts(h: int) -> Any:
    """The parts launch of a ``[T, h]`` norm (one row per program, 4 warps)."""
    from fp8_backends.providers.triton import norm_dynamic_kernels as nd

    return nd.DynConfig("parts", 1, -(-h // 128), 128, 4)


def problems(family: str, info: dict[str, Any]) -> list[str]:
    """What is wrong with a compiled variant (empty: nothing)."""
    bad = []
    if info["stack"]:
        bad.append(f"{info['stack']} bytes of stack (register spills)")
    # a warpgroup MMA covers 64 rows: a tile with fewer on the MMA's M side (mm's 32-row tiles) takes mma.sync
    small_tile = info.get("mma_rows", 64) < 64 and info["mma_sync"]
    if family in ("swap", "mm", "tma") and not info["wgmma"] and not small_tile:
        bad.append("no wgmma")
    if family in ("swap", "mm") and not info["cp_async"]:
        bad.append("no cp.async pipelining")
    if info.get("want_prefetch") and not info["l2_prefetch"]:
        bad.append("no L2 bulk prefetch")
    if family == "tma" and not info["tma"]:
        bad.append("no TMA loads")
    if not info["pdl"]:
        bad.append("no griddepcontrol (PDL)")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.block_kernels_sm90", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one variant per kernel")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0"):
        print("unset TRITON_INTERPRET: the kernels must be defined for compilation, not for the interpreter",
              file=sys.stderr)
        return 2
    failures = 0
    for family, thunk in variants(args.quick):
        try:
            name, info = thunk()
        except Exception as exc:
            failures += 1
            print(f"FAIL {family}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            continue
        bad = problems(family, info)
        failures += bool(bad)
        print(f"{'FAIL' if bad else 'ok  '} {name}: regs {info['regs']}, stack {info['stack']}, shared "
              f"{info['shared']}, wgmma {info['wgmma']}, cp.async {info['cp_async']}, tma {info['tma']}, pdl "
              f"{info['pdl']}, l2 prefetch {info['l2_prefetch']}" + (f" -- {'; '.join(bad)}" if bad else ""),
              flush=True)
    print(f"{failures} failing variant(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
