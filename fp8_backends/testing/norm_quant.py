"""The fused RMSNorm + FP8-quant provider contract: subclass :class:`NormQuantProviderContract`.

::

    from fp8_backends.testing import NormQuantProviderContract
    from my_fp8_kernels.provider import MyNormQuant


    class TestMyNormQuant(NormQuantProviderContract):
        def make_provider(self):
            return MyNormQuant()

It checks, for what the provider declares (:class:`~fp8_backends.NormQuantCapabilities`): ``rmsnorm_quant``
and ``fused_add_rmsnorm_quant`` match :mod:`fp8_backends.core.reference` (FP8 codes within one step, at most 0.5 %
of them off; the residual updated in place exactly: see :mod:`fp8_backends.testing.compare`) for every
declared input dtype over 0, 1 and odd token counts and odd hidden sizes, scales from saturation to
subnormals, every per-tensor scale shape, eps; writes stay inside ``out`` and ``residual``; undeclared dtypes,
hidden sizes, the residual variant and devices are refused before any kernel; malformed inputs raise the
library's errors; import cost, entry point, fake-tensor shapes, ``torch.compile(fullgraph=True)``; and,
marked ``gpu``, CUDA-graph replay, Inductor and no host syncs. Where the provider declares the dynamic modes
(``per_token``, ``per_token_group`` in each declared group size), both calls in those modes against
:func:`fp8_backends.core.reference.rmsnorm_quant_dynamic`: codes as above, scales within a few fp32 ulps in the
layout asked for (each :class:`~fp8_backends.core.types.ScaleLayout`), NaN where the reference has NaN, the residual
exact; the modes and group sizes it does not declare are refused before any kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from fp8_backends.core import group_scales
from fp8_backends.core.capabilities import NormQuantCapabilities
from fp8_backends.core.padding import round_up
from fp8_backends.core.types import (
    ActScale,
    DeviceKind,
    NormQuantProblem,
    OutDtype,
    QuantizedActivation,
    ScaleLayout,
)

from ._base import ContractBase, _cuda_visible, expect_refusal, no_kernel_runs, platform_for
from .compare import CODES_MAX_FRACTION, assert_codes_close, assert_residual_close, assert_scales_close

_HOOKS = ("rmsnorm_quant_impl", "fused_add_rmsnorm_quant_impl", "rmsnorm_quant_dynamic_impl")
#: group sizes the refusal test asks of a provider that does not declare them
_GROUP_SIZES = (64, 128)
_DTYPE_ORDER = (OutDtype.BF16, OutDtype.FP16, OutDtype.FP32)


def norm_inputs(t: int, h: int, dtype: OutDtype, device: str, seed: int = 0, amplitude: float = 1.0
                ) -> tuple[Any, Any, Any]:
    """``x, residual: [T, H]`` from N(0, amplitude²) and ``weight: [H]`` from 1 + N(0, 0.25²), in ``dtype``,
    drawn on the CPU with a seeded generator and moved to ``device``."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + t * 7 + h)
    td = dtype.torch_dtype()
    x = (torch.randn(t, h, generator=g) * amplitude).to(td)
    r = (torch.randn(t, h, generator=g) * amplitude).to(td)
    w = (1 + 0.25 * torch.randn(h, generator=g)).to(td)
    return x.to(device), r.to(device), w.to(device)


def _scale(value: float, device: str, shape: tuple[int, ...] = (1,)) -> Any:
    import torch

    return torch.full(shape, value, dtype=torch.float32, device=device)


class NormQuantProviderContract(ContractBase):
    """Conformance tests for a fused RMSNorm + static FP8 quant provider
    (:class:`~fp8_backends.NormQuantBackend`). Subclass it (as ``Test...``) and define
    :meth:`make_provider` (or set :attr:`provider_spec`)."""

    kind: ClassVar[str] = "norm_quant"
    #: token counts of the reference comparison (0, 1 and odd)
    token_values: ClassVar[tuple[int, ...]] = (0, 1, 3, 17)
    #: hidden sizes of the reference comparison (rounded up to ``hidden_align``; odd ones mask a tail)
    hidden_sizes: ClassVar[tuple[int, ...]] = (33, 256, 1000, 4096)
    #: at most this fraction of FP8 codes may differ (by one step) from the reference
    max_code_fraction: ClassVar[float] = CODES_MAX_FRACTION
    #: the updated residual may differ from the reference by this many units in the last place
    residual_max_ulps: ClassVar[int] = 0
    #: compiled calls (Inductor, CUDA) must give the eager bits exactly (opaque ops: set True)
    compiled_matches_eager_exactly: ClassVar[bool] = False
    #: hidden sizes x token counts run under the ``gpu`` marker
    gpu_hidden_sizes: ClassVar[tuple[int, ...]] = (4096, 5120, 8192)
    gpu_token_values: ClassVar[tuple[int, ...]] = (1, 32, 4096)
    #: hidden sizes of the CUDA-graph test (64 tokens each)
    gpu_graph_hidden_sizes: ClassVar[tuple[int, ...]] = (1024, 4096)
    #: token counts and hidden sizes of the dynamic modes' comparison (ragged last groups among them)
    dynamic_token_values: ClassVar[tuple[int, ...]] = (0, 1, 17)
    dynamic_hidden_sizes: ClassVar[tuple[int, ...]] = (33, 200, 1000)

    # ------------------------------------------------------------------ parametrization
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        provider, error = self._collected_provider()
        caps = provider.capabilities if error is None else None
        gpu = metafunc.definition.get_closest_marker("gpu") is not None
        if "device" in metafunc.fixturenames:
            devices = self.device_params(gpu_only=gpu)
            metafunc.parametrize("device", devices)
            if not any(d.values[0] is not None for d in devices):  # skipped anyway: one test, one reason
                for name in ("dtype", "tokens", "hidden", "residual", "bad"):
                    if name in metafunc.fixturenames:
                        metafunc.parametrize(name, [None], ids=["-"])
                return
        if "dtype" in metafunc.fixturenames:
            dtypes = [d for d in _DTYPE_ORDER if caps is None or d in caps.in_dtypes]
            metafunc.parametrize("dtype", dtypes, ids=[d.value for d in dtypes])
        if "tokens" in metafunc.fixturenames:
            metafunc.parametrize("tokens", self.token_values, ids=[f"T{t}" for t in self.token_values])
        if "hidden" in metafunc.fixturenames:
            align = caps.hidden_align if isinstance(caps, NormQuantCapabilities) else 1
            sizes = sorted({round_up(h, align) for h in self.hidden_sizes})
            metafunc.parametrize("hidden", sizes, ids=[f"H{h}" for h in sizes])
        if "residual" in metafunc.fixturenames:
            with_residual = caps is None or caps.residual
            metafunc.parametrize("residual", [False, True] if with_residual else [False],
                                 ids=["plain", "residual"] if with_residual else ["plain"])
        if "refusal" in metafunc.fixturenames:
            refusals = self._refusals(provider) if error is None else []
            metafunc.parametrize("refusal", refusals or [pytest.param(None, marks=pytest.mark.skip(
                reason="the provider declares every case this kit knows"))], ids=[r[0] for r in refusals] or ["none"])
        if "bad" in metafunc.fixturenames:
            metafunc.parametrize("bad", list(_BAD_INPUTS))
        if "dynamic" in metafunc.fixturenames:
            modes = dynamic_modes(caps) if isinstance(caps, NormQuantCapabilities) else []
            metafunc.parametrize("dynamic", modes or [pytest.param(None, marks=pytest.mark.skip(
                reason="the provider declares no dynamic mode (per_token, per_token_group)"))],
                ids=[m.id for m in modes] or ["none"])

    def _hidden(self, caps: NormQuantCapabilities, h: int = 256) -> int:
        return round_up(h, caps.hidden_align)

    def _refusals(self, provider: Any) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, device, how) for everything undeclared that can be asked here."""
        caps: NormQuantCapabilities = provider.capabilities
        run = [p.values[0] for p in self.device_params() if p.values[0] not in (None, "error")]
        out: list[tuple[str, str, dict[str, Any]]] = []
        if run:
            here = run[0]
            for dt in _DTYPE_ORDER:
                if dt not in caps.in_dtypes:
                    out.append((f"in-{dt.value}", here, {"in_dtype": dt}))
            if caps.hidden_align > 1:
                bad_hidden = caps.hidden_align * 3 + max(1, caps.hidden_align // 2)
                out.append(("hidden-misaligned", here, {"hidden": bad_hidden}))
            if not caps.residual:
                out.append(("residual", here, {"residual": True}))
            if ActScale.PER_TOKEN not in caps.act_scales:
                out.append(("dynamic-per_token", here, {"act_scale": ActScale.PER_TOKEN}))
            for group in _GROUP_SIZES:
                if ActScale.PER_TOKEN_GROUP not in caps.act_scales or group not in caps.group_sizes:
                    out.append((f"dynamic-per_token_group-{group}", here,
                                {"act_scale": ActScale.PER_TOKEN_GROUP, "group_size": group}))
        declared = [d.value for d in caps.devices]
        for dev in ("cpu", "cuda"):
            if dev not in declared and (dev == "cpu" or _cuda_visible()):
                out.append((f"device-{dev}", dev, {"device": DeviceKind(dev)}))
        return out

    # ------------------------------------------------------------------ declaration and packaging
    def test_declaration(self) -> None:
        """Identity, options, capability record and an ``availability()`` classmethod that answers."""
        from fp8_backends.core.backend import NormQuantBackend

        provider = self.check_identity(NormQuantBackend, NormQuantCapabilities)
        caps = provider.capabilities
        assert caps.in_dtypes and caps.out_fp8, "capabilities.in_dtypes / out_fp8 must not be empty"
        assert isinstance(caps.hidden_align, int) and caps.hidden_align > 0
        assert isinstance(caps.residual, bool)

    # ------------------------------------------------------------------ numerics
    def test_rmsnorm_quant_matches_reference(self, device: str, dtype: OutDtype, tokens: int, hidden: int) -> None:
        """``rmsnorm_quant`` returns a typed activation whose codes match the reference."""
        from fp8_backends.core import reference

        provider = self._serving(device, dtype, hidden)
        x, _, w = norm_inputs(tokens, hidden, dtype, device)
        x_before = x.clone()
        s = _scale(0.004, device)  # |rmsnorm| up to ~4 / 0.004: the tails saturate at ±448
        qa = provider.rmsnorm_quant(x, w, s, 1e-6)
        self._check_activation(qa, s, x, dtype)
        assert_codes_close(qa.data, reference.rmsnorm_quant(x, w, s, 1e-6), self.max_code_fraction,
                           f"{dtype.value} T={tokens} H={hidden}")
        assert _equal(x, x_before), "rmsnorm_quant modified x"

    def test_fused_add_matches_reference(self, device: str, dtype: OutDtype, tokens: int, hidden: int) -> None:
        """``fused_add_rmsnorm_quant`` writes ``x + residual`` into ``residual`` in place and quantizes the
        RMSNorm of the fp32 sum."""
        from fp8_backends.core import reference

        provider = self._serving(device, dtype, hidden, residual=True)
        x, r, w = norm_inputs(tokens, hidden, dtype, device, seed=1)
        s = _scale(0.02, device)
        ref_q, ref_r = reference.fused_add_rmsnorm_quant(x, r, w, s, 1e-6)
        x_before = x.clone()
        qa, r_out = provider.fused_add_rmsnorm_quant(x, r, w, s, 1e-6)
        assert r_out is r, "fused_add_rmsnorm_quant must return the residual tensor it was given (updated in place)"
        self._check_activation(qa, s, x, dtype)
        assert_residual_close(r, ref_r, self.residual_max_ulps, f"{dtype.value} T={tokens} H={hidden}")
        assert _equal(x, x_before), "fused_add_rmsnorm_quant modified x"
        assert_codes_close(qa.data, ref_q, self.max_code_fraction, f"{dtype.value} T={tokens} H={hidden}")

    @pytest.mark.parametrize("scale", [1e-3, 0.05, 1.0, 300.0])
    def test_scale_magnitudes(self, device: str, residual: bool, scale: float) -> None:
        """From heavy saturation (1e-3: most codes at ±448) to values deep in e4m3's subnormals (300)."""
        from fp8_backends.core import reference

        dtype = _first_dtype(self.make_provider().capabilities)
        provider = self._serving(device, dtype, self._hidden(self.make_provider().capabilities, 96), residual)
        h = self._hidden(provider.capabilities, 96)
        x, r, w = norm_inputs(5, h, dtype, device, seed=2, amplitude=3.0)
        s = _scale(scale, device)
        if residual:
            ref_q, ref_r = reference.fused_add_rmsnorm_quant(x, r, w, s)
            qa, _ = provider.fused_add_rmsnorm_quant(x, r, w, s)
            assert_residual_close(r, ref_r, self.residual_max_ulps)
        else:
            ref_q = reference.rmsnorm_quant(x, w, s)
            qa = provider.rmsnorm_quant(x, w, s)
        assert_codes_close(qa.data, ref_q, self.max_code_fraction, f"scale {scale}")
        if scale == 1e-3:
            assert (qa.data.float().abs() == 448).float().mean() > 0.5, "most values saturate at this scale"

    @pytest.mark.parametrize("scale_shape", [(), (1,), (1, 1)], ids=["0d", "1", "1x1"])
    def test_scale_shapes_and_eps(self, device: str, scale_shape: tuple[int, ...]) -> None:
        """Every per-tensor scale shape; ``eps`` is honoured (inputs so small that mean(x²) ~ eps)."""
        from fp8_backends.core import reference

        caps = self.make_provider().capabilities
        dtype = OutDtype.FP16 if OutDtype.FP16 in caps.in_dtypes else _first_dtype(caps)
        h = self._hidden(caps, 64)
        provider = self._serving(device, dtype, h)
        x, _, w = norm_inputs(4, h, dtype, device, seed=3, amplitude=1e-3)
        s = _scale(0.01, device, scale_shape)
        for eps in (1e-5, 1e-6):
            qa = provider.rmsnorm_quant(x, w, s, eps=eps)
            assert_codes_close(qa.data, reference.rmsnorm_quant(x, w, s, eps), self.max_code_fraction, f"eps {eps}")

    def test_writes_stay_inside_out_and_residual(self, device: str) -> None:
        """``out`` and ``residual`` given as views at the start of larger buffers: the result lands in
        ``out`` and the words after both views stay untouched (an unmasked tail or row would write there)."""
        import torch

        from fp8_backends.core import reference

        caps = self.make_provider().capabilities
        dtype = _first_dtype(caps)
        for t, h0 in ((3, 33), (17, 100), (2, 3000)):
            h = self._hidden(caps, h0)
            provider = self._serving(device, dtype, h)
            x, r, w = norm_inputs(t, h, dtype, device, seed=5)
            pad = 4096
            out_buf = torch.full((t * h + pad,), 0x7E, dtype=torch.uint8, device=device)
            out = out_buf[: t * h].view(torch.float8_e4m3fn).view(t, h)
            s = _scale(0.02, device)
            qa = provider.rmsnorm_quant(x, w, s, out=out)
            assert qa.data.data_ptr() == out.data_ptr(), "rmsnorm_quant(out=...) must return out"
            assert bool(torch.all(out_buf[t * h:] == 0x7E)), f"T={t} H={h}: rmsnorm_quant wrote past out"
            assert_codes_close(out, reference.rmsnorm_quant(x, w, s), self.max_code_fraction)
            if not caps.residual:
                continue
            r_buf = torch.full((t * h + pad,), 7.0, dtype=dtype.torch_dtype(), device=device)
            r_buf[: t * h] = r.flatten()
            residual = r_buf[: t * h].view(t, h)
            ref_q, ref_r = reference.fused_add_rmsnorm_quant(x, r, w, s)
            out_buf.fill_(0x7E)
            qa, _ = provider.fused_add_rmsnorm_quant(x, residual, w, s, out=out)
            assert qa.data.data_ptr() == out.data_ptr()
            assert bool(torch.all(out_buf[t * h:] == 0x7E)), f"T={t} H={h}: fused_add_rmsnorm_quant wrote past out"
            assert bool(torch.all(r_buf[t * h:] == 7.0)), f"T={t} H={h}: fused_add_rmsnorm_quant wrote past residual"
            assert_residual_close(residual, ref_r, self.residual_max_ulps)
            assert_codes_close(out, ref_q, self.max_code_fraction)

    def test_strided_weight_and_zero_rows(self, device: str) -> None:
        """A weight viewed with stride 2 (accepted by the API) and an all-zero row (rsqrt(eps) · 0 = 0)."""
        import torch

        from fp8_backends.core import reference

        caps = self.make_provider().capabilities
        dtype = _first_dtype(caps)
        h = self._hidden(caps, 128)
        provider = self._serving(device, dtype, h)
        x, _, w2 = norm_inputs(4, h, dtype, device, seed=6)
        w = torch.stack([w2, w2], 1).flatten()[::2]
        assert w.stride() == (2,) and _equal(w, w2)
        x[1] = 0
        s = _scale(0.01, device)
        qa = provider.rmsnorm_quant(x, w, s)
        assert_codes_close(qa.data, reference.rmsnorm_quant(x, w2, s), self.max_code_fraction)
        assert bool(torch.all(qa.data[1].float() == 0)), "an all-zero row must quantize to zeros"

    def test_strided_inputs(self, device: str) -> None:
        """``x`` as the views a model hands over: a row-strided ``x[:, :H]`` of a wider buffer (row stride 3H + 1,
        what ``capabilities.strided_rows`` providers read as it is), a transposed view, a column slice with a column
        stride and broadcast rows (stride 0); with and without the residual add. Each gives the codes of its
        row-major copy (the residual updated in place as for that copy), and ``x`` is left unchanged."""
        import torch

        caps = self.make_provider().capabilities
        dtype = _first_dtype(caps)
        h = self._hidden(caps, 96)
        provider = self._serving(device, dtype, h)
        x, r, w = norm_inputs(7, h, dtype, device, seed=8)
        wide = torch.zeros(7, 3 * h + 1, dtype=x.dtype, device=device)
        wide[:, :h] = x
        twice = torch.zeros(7, 2 * h, dtype=x.dtype, device=device)
        twice[:, ::2] = x
        views = {"row-strided": wide[:, :h], "transposed": x.t().contiguous().t(), "column-strided": twice[:, ::2],
                 "broadcast-rows": x[:1].expand(7, h)}
        s = _scale(0.02, device)
        for name, view in views.items():
            before = view.clone()
            want = provider.rmsnorm_quant(view.contiguous(), w, s)
            got = provider.rmsnorm_quant(view, w, s)
            assert got.data.is_contiguous() and _equal(got.data, want.data), f"{name}: codes differ from a copy's"
            assert _equal(view, before), f"{name}: x was written"
            if caps.residual:
                r1, r2 = r.clone(), r.clone()
                want, r1 = provider.fused_add_rmsnorm_quant(view.contiguous(), r1, w, s)
                got, r2 = provider.fused_add_rmsnorm_quant(view, r2, w, s)
                assert _equal(got.data, want.data), f"{name}: codes with the residual add differ from a copy's"
                assert _equal(r2, r1), f"{name}: the updated residual differs from a copy's"

    # ------------------------------------------------------------------ refusals
    def test_undeclared_is_refused_before_any_kernel(self, refusal: tuple[str, str, dict[str, Any]]) -> None:
        """``supports()`` gives reasons and the call raises InvalidInputError before any ``*_impl`` hook."""
        rid, device, how = refusal
        provider = self.provider()
        caps = provider.capabilities
        problem = {"hidden": self._hidden(caps), "tokens": 4, "device": DeviceKind(device), **how}
        reasons = provider.supports(NormQuantProblem(**problem), platform_for(device))
        assert reasons and all(isinstance(r, str) and r for r in reasons), (rid, reasons)
        dtype = how.get("in_dtype", _first_dtype(caps))
        x, r, w = norm_inputs(4, problem["hidden"], dtype, device)
        s = _scale(0.02, device)
        with no_kernel_runs(provider, _HOOKS) as calls:
            if "act_scale" in how:  # a dynamic mode: no scale given
                kw = {"act_scale": how["act_scale"], "group_size": how.get("group_size", 128)}
                expect_refusal(lambda: provider.rmsnorm_quant(x, w, None, **kw), calls, None, rid)
                if caps.residual:
                    expect_refusal(lambda: provider.fused_add_rmsnorm_quant(x, r, w, None, **kw), calls, None, rid)
            elif how.get("residual"):
                expect_refusal(lambda: provider.fused_add_rmsnorm_quant(x, r, w, s), calls, "residual", rid)
            else:
                expect_refusal(lambda: provider.rmsnorm_quant(x, w, s), calls, None, rid)
                if caps.residual:
                    expect_refusal(lambda: provider.fused_add_rmsnorm_quant(x, r, w, s), calls, None, rid)

    def test_bad_inputs_raise_library_errors(self, device: str, bad: str) -> None:
        """Malformed inputs raise :class:`~fp8_backends.InvalidInputError` naming the argument, before any kernel."""
        caps = self.make_provider().capabilities
        need, build, match = _BAD_INPUTS[bad]
        if not need(caps, device):
            pytest.skip(f"{bad}: not applicable to this provider on {device}")
        dtype = _first_dtype(caps)
        h = self._hidden(caps, 64)
        provider = self._serving(device, dtype, h)
        x, r, w = norm_inputs(4, h, dtype, device)
        ctx = {"p": provider, "x": x, "r": r, "w": w, "s": _scale(0.1, device), "device": device}
        with no_kernel_runs(provider, _HOOKS) as calls:
            expect_refusal(build(ctx), calls, match, bad)

    # ------------------------------------------------------------------ dynamic modes
    def test_dynamic_matches_reference(self, device: str, dynamic: DynamicMode) -> None:
        """Both calls in a declared dynamic mode over :attr:`dynamic_token_values` x :attr:`dynamic_hidden_sizes`
        (every declared input dtype at one size): a typed activation of that mode whose codes, scales (in the layout
        asked for) and updated residual match the reference."""
        import torch

        caps = self.make_provider().capabilities
        sizes = [(t, round_up(h, caps.hidden_align), _first_dtype(caps)) for t in self.dynamic_token_values
                 for h in self.dynamic_hidden_sizes]
        sizes += [(3, round_up(384, caps.hidden_align), d) for d in _DTYPE_ORDER if d in caps.in_dtypes]
        for t, h, dtype in sizes:
            for residual in (False, True) if caps.residual else (False,):
                provider = self._serving(device, dtype, h, residual)
                x, r, w = norm_inputs(t, h, dtype, device, seed=5, amplitude=2.0)
                x[:, ::7] *= 8  # loud columns: the groups' scales differ
                ref_q, ref_s, ref_r = self._reference(x, w, r if residual else None, dynamic)
                what = f"{dynamic.id} {dtype.value} T={t} H={h}" + (" +residual" if residual else "")
                kw = {"act_scale": dynamic.mode, "group_size": dynamic.group_size, "scale_layout": dynamic.layout}
                if residual:
                    qa, r_out = provider.fused_add_rmsnorm_quant(x, r, w, None, 1e-6, **kw)
                    assert r_out is r, f"{what}: the residual tensor given must come back, updated in place"
                    assert_residual_close(r, ref_r, self.residual_max_ulps, what)
                else:
                    qa = provider.rmsnorm_quant(x, w, None, 1e-6, **kw)
                assert isinstance(qa, QuantizedActivation) and qa.mode is dynamic.mode, f"{what}: {qa!r}"
                assert qa.orig_dtype == dtype.torch_dtype() and qa.data.dtype == torch.float8_e4m3fn, what
                assert_scales_close(qa.scale, ref_s, what)
                if dynamic.mode is ActScale.PER_TOKEN_GROUP and t > 1:
                    assert group_scales.is_layout(qa.scale, dynamic.layout), f"{what}: scale strides " \
                        f"{qa.scale.stride()} are not {dynamic.layout.value}"
                assert_codes_close(qa.data, ref_q, self.max_code_fraction, what)

    @staticmethod
    def _reference(x: Any, w: Any, r: Any, dynamic: DynamicMode) -> tuple[Any, Any, Any]:
        from fp8_backends.core import reference

        return reference.rmsnorm_quant_dynamic(x, w, 1e-6, act_scale=dynamic.mode, group_size=dynamic.group_size,
                                               residual=r)

    # ------------------------------------------------------------------ tracing
    def test_fake_tensor_shapes(self, device: str) -> None:
        """Under ``FakeTensorMode`` both calls return ``[T, H]`` float8_e4m3fn activations (and the residual)."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        caps = self.make_provider().capabilities
        h = self._hidden(caps, 64)
        for dtype in (d for d in _DTYPE_ORDER if d in caps.in_dtypes):
            provider = self._serving(device, dtype, h)
            provider.ensure_preloaded()  # load time: define ops eagerly, as the registry does
            x, r, w = norm_inputs(6, h, dtype, device)
            s = _scale(0.05, device)
            mode = FakeTensorMode()
            fx, fr, fw, fs = (mode.from_tensor(t) for t in (x, r, w, s))
            with mode:
                qa = provider.rmsnorm_quant(fx, fw, fs)
                results = [qa] + ([provider.fused_add_rmsnorm_quant(fx, fr, fw, fs)[0]] if caps.residual else [])
            for q in results:
                assert tuple(q.data.shape) == (6, h), tuple(q.data.shape)
                assert q.data.dtype == torch.float8_e4m3fn, q.data.dtype
                assert q.data.device == x.device and q.orig_dtype == dtype.torch_dtype()

    def test_torch_compile_fullgraph(self, device: str) -> None:
        """``torch.compile(fullgraph=True)`` (AOT eager backend) traces both calls; the in-place residual update
        survives and the codes match eager."""
        import torch

        caps = self.make_provider().capabilities
        dtype = _first_dtype(caps)
        h = self._hidden(caps, 64)
        provider = self._serving(device, dtype, h)
        x, r, w = norm_inputs(4, h, dtype, device, seed=10)
        s = _scale(0.02, device)

        def f(x: Any, r: Any, w: Any, s: Any) -> Any:
            if caps.residual:
                qa, r2 = provider.fused_add_rmsnorm_quant(x, r, w, s)
                return qa.data, provider.rmsnorm_quant(r2, w, s).data
            return provider.rmsnorm_quant(x, w, s).data, provider.rmsnorm_quant(r, w, s).data

        r_eager = r.clone()
        expected = f(x, r_eager, w, s)
        torch._dynamo.reset()
        try:
            r_compiled = r.clone()
            got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r_compiled, w, s)
        finally:
            torch._dynamo.reset()
        assert_residual_close(r_compiled, r_eager, 0, "residual after torch.compile")
        for a, b in zip(got, expected):
            assert_codes_close(a, b, self.max_code_fraction, "compiled vs eager")

    # ------------------------------------------------------------------ GPU
    @pytest.mark.gpu
    def test_gpu_matches_reference_at_model_sizes(self, device: str) -> None:
        """:attr:`gpu_hidden_sizes` x :attr:`gpu_token_values`, both calls, every declared dtype."""
        from fp8_backends.core import reference

        caps = self.make_provider().capabilities
        for dtype in (d for d in _DTYPE_ORDER if d in caps.in_dtypes):
            for h0 in self.gpu_hidden_sizes:
                h = self._hidden(caps, h0)
                provider = self._serving(device, dtype, h)
                for t in self.gpu_token_values:
                    x, r, w = norm_inputs(t, h, dtype, device, seed=11)
                    s = _scale(0.01, device)
                    what = f"{dtype.value} T={t} H={h}"
                    assert_codes_close(provider.rmsnorm_quant(x, w, s).data, reference.rmsnorm_quant(x, w, s),
                                       min(self.max_code_fraction, 1e-3), what)
                    if caps.residual:
                        ref_q, ref_r = reference.fused_add_rmsnorm_quant(x, r, w, s)
                        qa, _ = provider.fused_add_rmsnorm_quant(x, r, w, s)
                        assert_residual_close(r, ref_r, self.residual_max_ulps, what)
                        assert_codes_close(qa.data, ref_q, min(self.max_code_fraction, 1e-3), what)

    @pytest.mark.gpu
    def test_gpu_cuda_graph_replay_equals_eager(self, device: str) -> None:
        """Captured after a warm-up, replays give the eager bits and read new values of the captured inputs."""
        import torch

        caps = self.make_provider().capabilities
        dtype = _first_dtype(caps)
        for h0 in self.gpu_graph_hidden_sizes:
            h = self._hidden(caps, h0)
            provider = self._serving(device, dtype, h)
            x, r, w = norm_inputs(64, h, dtype, device, seed=14)
            s = _scale(0.05, device)

            def calls(x: Any, res: Any, provider: Any = provider, w: Any = w, s: Any = s) -> list[Any]:
                out = [provider.rmsnorm_quant(x, w, s).data]
                if caps.residual:
                    out.append(provider.fused_add_rmsnorm_quant(x, res, w, s)[0].data)
                return out

            res_eager = r.clone()
            eager = [q.clone() for q in calls(x, res_eager)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                calls(x, r.clone())
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            res_graph = r.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = calls(x, res_graph)
            res_graph.copy_(r)
            graph.replay()
            torch.cuda.synchronize()
            for got, want in zip(captured, eager):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"H={h}: replay differs from eager"
            assert torch.equal(res_graph, res_eager)
            x.mul_(2)
            res_graph.copy_(r)
            graph.replay()
            res_check = r.clone()
            check = calls(x, res_check)
            torch.cuda.synchronize()
            for got, want in zip(captured, check):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"H={h}: replay ignored new x"
            assert torch.equal(res_graph, res_check)

    @pytest.mark.gpu
    def test_gpu_torch_compile_inductor(self, device: str) -> None:
        """``torch.compile(fullgraph=True)`` with Inductor: the residual update survives; codes match eager
        (exactly when :attr:`compiled_matches_eager_exactly`)."""
        import torch
        import torch._inductor.config

        caps = self.make_provider().capabilities
        dtype = _first_dtype(caps)
        h = self._hidden(caps, 4096)
        provider = self._serving(device, dtype, h)
        x, r, w = norm_inputs(48, h, dtype, device, seed=15)
        s = _scale(0.05, device)

        def f(x: Any, r: Any, w: Any, s: Any) -> Any:
            if caps.residual:
                qa, r2 = provider.fused_add_rmsnorm_quant(x, r, w, s)
                return qa.data, provider.rmsnorm_quant(r2, w, s).data
            return (provider.rmsnorm_quant(x, w, s).data,)

        res_eager = r.clone()
        expected = f(x, res_eager, w, s)
        torch._dynamo.reset()
        # Inductor drops a round trip through a narrower dtype between ops unless told to emulate it: without this,
        # the second call reads the fp32 sum where eager reads its bf16 rounding (the new residual), and ~1% of a
        # Python-visible provider's codes move by one step. That is the compiler's numerics, not the provider's.
        try:
            res_c = r.clone()
            with torch._inductor.config.patch(emulate_precision_casts=True):
                got = torch.compile(f, fullgraph=True)(x, res_c, w, s)
        finally:
            torch._dynamo.reset()
        assert_residual_close(res_c, res_eager, self.residual_max_ulps, "residual after Inductor")
        for a, b in zip(got, expected):
            if self.compiled_matches_eager_exactly:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "Inductor changed the codes"
            else:
                assert_codes_close(a, b, self.max_code_fraction, "Inductor vs eager")

    @pytest.mark.gpu
    def test_gpu_no_host_sync(self, device: str) -> None:
        """After a warm-up, neither call synchronizes with the host."""
        import torch

        caps = self.make_provider().capabilities
        dtype = _first_dtype(caps)
        h = self._hidden(caps, 4096)
        provider = self._serving(device, dtype, h)
        x, r, w = norm_inputs(32, h, dtype, device, seed=16)
        s = _scale(0.05, device)
        for _ in range(2):
            torch.cuda.synchronize()
            if _ == 1:
                torch.cuda.set_sync_debug_mode("error")
            try:
                provider.rmsnorm_quant(x, w, s)
                if caps.residual:
                    provider.fused_add_rmsnorm_quant(x, r, w, s)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ helpers
    def _serving(self, device: str, dtype: OutDtype, hidden: int, residual: bool = False) -> Any:
        """A fresh provider that says it serves this case here (else the test is skipped with its reasons)."""
        provider = self.provider()
        problem = NormQuantProblem(hidden=hidden, in_dtype=dtype, residual=residual, device=DeviceKind(device))
        reasons = provider.supports(problem, platform_for(device))
        assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons), reasons
        if reasons:
            pytest.skip(f"{provider.label} refuses {problem.describe()}: {'; '.join(reasons)}")
        return provider

    @staticmethod
    def _check_activation(qa: Any, s: Any, x: Any, dtype: OutDtype) -> None:
        import torch

        assert isinstance(qa, QuantizedActivation), f"returned {type(qa).__name__}, not a QuantizedActivation"
        assert qa.scale is s, "the activation must carry the scale it was quantized with"
        assert qa.orig_dtype == dtype.torch_dtype() and qa.mode is ActScale.PER_TENSOR_STATIC
        assert qa.data.dtype == torch.float8_e4m3fn and qa.data.shape == x.shape and qa.data.device == x.device


@dataclass(frozen=True)
class DynamicMode:
    """A dynamic norm-quant mode the provider declares: per token, or per token group of ``group_size`` with the
    scales asked for in ``layout``."""

    mode: ActScale
    group_size: int = 128
    layout: ScaleLayout = ScaleLayout.ROW_MAJOR

    @property
    def id(self) -> str:
        if self.mode is ActScale.PER_TOKEN:
            return "per_token"
        return f"per_token_group{self.group_size}-{self.layout.value}"


def dynamic_modes(caps: NormQuantCapabilities) -> list[DynamicMode]:
    """Per token where declared; per token group in each declared group size, the scale layout rotating through
    :class:`~fp8_backends.core.types.ScaleLayout` (every layout at least once)."""
    out = [DynamicMode(ActScale.PER_TOKEN)] if ActScale.PER_TOKEN in caps.act_scales else []
    if ActScale.PER_TOKEN_GROUP in caps.act_scales and caps.group_sizes:
        groups, layouts = sorted(caps.group_sizes), list(ScaleLayout)
        out += [DynamicMode(ActScale.PER_TOKEN_GROUP, groups[i % len(groups)], layout)
                for i, layout in enumerate(layouts)]
        out += [DynamicMode(ActScale.PER_TOKEN_GROUP, g, ScaleLayout.ROW_MAJOR) for g in groups[len(layouts):]]
    return out


def _first_dtype(caps: NormQuantCapabilities) -> OutDtype:
    return next(d for d in _DTYPE_ORDER if d in caps.in_dtypes)


def _equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _always(caps: NormQuantCapabilities, device: str) -> bool:
    return True


def _has_residual(caps: NormQuantCapabilities, device: str) -> bool:
    return caps.residual


def _other_device(device: str) -> str | None:
    if device == "cuda":
        return "cpu"
    return "cuda" if _cuda_visible() else None


def _fp8(t: Any) -> Any:
    import torch

    return t.to(torch.float8_e4m3fn)


def _other_float(t: Any) -> Any:
    import torch

    return t.to(torch.float16 if t.dtype != torch.float16 else torch.bfloat16)


def _empty_fp8(like: Any, transposed: bool = False, dtype: Any = None) -> Any:
    import torch

    if transposed:
        return torch.empty(like.shape[1], like.shape[0], dtype=torch.float8_e4m3fn, device=like.device).t()
    return torch.empty(like.shape, dtype=dtype or torch.bfloat16, device=like.device)


# name -> (applies(caps, device), build(ctx) -> the failing call, message pattern)
_BAD_INPUTS: dict[str, tuple[Any, Any, str]] = {
    "x-fp8": (_always, lambda c: lambda: c["p"].rmsnorm_quant(_fp8(c["x"]), c["w"], c["s"]),
              "x must be bfloat16, float16 or float32"),
    "x-not-a-tensor": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"].tolist(), c["w"], c["s"]),
                       "x must be a torch.Tensor"),
    "x-1d": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"][0], c["w"], c["s"]), "x must be 2-D"),
    "weight-wrong-shape": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"][:-1], c["s"]),
                           r"weight must have shape \[H\]"),
    "weight-wrong-dtype": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], _other_float(c["w"]), c["s"]),
                           "weight must have x's dtype"),
    "scale-two-values": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"], c["s"].repeat(2)),
                         "scale must hold one value"),
    "scale-fp64": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"], c["s"].double()),
                   "scale must be a float32 tensor"),
    "scale-python-float": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"], 0.1),
                           "scale must be a torch.Tensor"),
    "scale-inf-on-cpu": (lambda caps, dev: dev == "cpu", lambda c: lambda: c["p"].rmsnorm_quant(
        c["x"], c["w"], c["s"] * float("inf")), "scale must be finite and > 0"),
    "scale-other-device": (lambda caps, dev: _other_device(dev) is not None, lambda c: lambda: c["p"].rmsnorm_quant(
        c["x"], c["w"], c["s"].to(_other_device(c["device"]))), "scale is on .* but the operands are on"),
    "eps-zero": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"], c["s"], 0.0),
                 "eps must be a positive float"),
    "eps-not-a-number": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"], c["s"], "1e-6"),
                         "eps must be a positive float"),
    "out-wrong-dtype": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"], c["s"],
                                                                        out=_empty_fp8(c["x"])),
                        "out must be float8_e4m3fn"),
    "out-column-major": (_always, lambda c: lambda: c["p"].rmsnorm_quant(c["x"], c["w"], c["s"],
                                                                         out=_empty_fp8(c["x"], transposed=True)),
                         "out must be row-major contiguous"),
    "residual-wrong-dtype": (_has_residual, lambda c: lambda: c["p"].fused_add_rmsnorm_quant(
        c["x"], _other_float(c["r"]), c["w"], c["s"]), "residual must match x"),
    "residual-wrong-shape": (_has_residual, lambda c: lambda: c["p"].fused_add_rmsnorm_quant(
        c["x"], c["r"][:1].contiguous(), c["w"], c["s"]), "residual must match x"),
    "residual-column-major": (_has_residual, lambda c: lambda: c["p"].fused_add_rmsnorm_quant(
        c["x"], c["r"].t().contiguous().t(), c["w"], c["s"]), "residual must be row-major contiguous"),
}


__all__ = ["NormQuantProviderContract", "norm_inputs"]
