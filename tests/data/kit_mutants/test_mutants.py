"""The conformance kit run against deliberately broken providers (tests/test_testing_kit.py runs this file
in a subprocess and checks that each class fails exactly where EXPECTED_FAILURES says)."""

from heavy_provider import HeavyImport
from mutant_providers import (
    AcceptsUndeclared,
    BlockDecodeFirstBlockScale,
    BlockFirstGroupScale,
    BlockIgnoresWeightScale,
    BlockLargeMFirstGroupScale,
    DropsBias,
    DynamicResidualNotWritten,
    DynamicScaleDoubled,
    FirstRowScaleOnly,
    GoodBlockGemm,
    GoodBlockOnlyGemm,
    GoodDynamicNorm,
    GoodGemm,
    GoodNorm,
    IgnoresEps,
    IgnoresWeightScale,
    InstanceAvailability,
    LosesLastRow,
    MultipliesByScale,
    NegativeHostCost,
    NormIgnoresWeight,
    NotRegistered,
    ReadsScaleOnHost,
    ResidualNotWritten,
    SkipsValidation,
    WritesPastOut,
)

from fp8_backends.testing import GemmProviderContract, NormQuantProviderContract

#: test class -> the kit tests that must fail for it (every other test of the class must pass or skip)
EXPECTED_FAILURES = {
    "TestGoodGemm": set(),
    "TestGoodBlockGemm": set(),
    "TestGoodBlockOnlyGemm": set(),
    "TestBlockIgnoresWeightScale": {"test_matches_reference", "test_edge_shapes", "test_scales_are_applied"},
    "TestBlockFirstGroupScale": {"test_matches_reference", "test_edge_shapes"},
    "TestBlockDecodeFirstBlockScale": {"test_edge_shapes"},
    "TestBlockLargeMFirstGroupScale": {"test_edge_shapes"},
    "TestIgnoresWeightScale": {"test_matches_reference", "test_edge_shapes", "test_scales_are_applied",
                               "test_torch_compile_fullgraph"},
    "TestDropsBias": {"test_matches_reference", "test_edge_shapes", "test_torch_compile_fullgraph"},
    "TestLosesLastRow": {"test_edge_shapes", "test_matches_reference", "test_torch_compile_fullgraph"},
    "TestFirstRowScaleOnly": {"test_matches_reference", "test_edge_shapes"},
    "TestSkipsValidation": {"test_bad_inputs_raise_library_errors", "test_undeclared_is_refused_before_any_kernel"},
    "TestAcceptsUndeclared": {"test_undeclared_is_refused_before_any_kernel", "test_bad_inputs_raise_library_errors"},
    "TestReadsScaleOnHost": {"test_fake_tensor_shapes", "test_torch_compile_fullgraph"},
    "TestInstanceAvailability": {"test_declaration"},
    "TestNegativeHostCost": {"test_declaration"},
    "TestNotRegistered": {"test_registered_under_its_name"},
    "TestHeavyImport": {"test_module_is_import_light"},
    "TestGoodNorm": set(),
    "TestGoodDynamicNorm": set(),
    "TestDynamicScaleDoubled": {"test_dynamic_matches_reference"},
    "TestDynamicResidualNotWritten": {"test_dynamic_matches_reference"},
    "TestNormIgnoresWeight": {"test_rmsnorm_quant_matches_reference", "test_scale_magnitudes",
                              "test_scale_shapes_and_eps", "test_writes_stay_inside_out_and_residual",
                              "test_strided_weight_and_zero_rows"},
    "TestResidualNotWritten": {"test_fused_add_matches_reference", "test_scale_magnitudes",
                               "test_writes_stay_inside_out_and_residual"},
    "TestWritesPastOut": {"test_writes_stay_inside_out_and_residual", "test_torch_compile_fullgraph"},
    "TestIgnoresEps": {"test_scale_shapes_and_eps"},
    "TestMultipliesByScale": {"test_rmsnorm_quant_matches_reference", "test_scale_magnitudes",
                              "test_scale_shapes_and_eps", "test_writes_stay_inside_out_and_residual",
                              "test_strided_weight_and_zero_rows"},
}


def _gemm(cls, check_registration=False):
    class Contract(GemmProviderContract):
        registered = check_registration

        def make_provider(self):
            return cls()

    Contract.__name__ = Contract.__qualname__ = f"Test{cls.__name__}"
    return Contract


def _norm(cls):
    class Contract(NormQuantProviderContract):
        registered = False

        def make_provider(self):
            return cls()

    Contract.__name__ = Contract.__qualname__ = f"Test{cls.__name__}"
    return Contract


for _cls in (GoodGemm, IgnoresWeightScale, DropsBias, LosesLastRow, FirstRowScaleOnly, SkipsValidation,
             AcceptsUndeclared, ReadsScaleOnHost, InstanceAvailability, NegativeHostCost, HeavyImport, GoodBlockGemm,
             GoodBlockOnlyGemm,
    GoodDynamicNorm, BlockIgnoresWeightScale, BlockFirstGroupScale, BlockDecodeFirstBlockScale,
    BlockLargeMFirstGroupScale):
    globals()[f"Test{_cls.__name__}"] = _gemm(_cls)
globals()["TestNotRegistered"] = _gemm(NotRegistered, check_registration=True)
for _cls in (GoodNorm, NormIgnoresWeight, ResidualNotWritten, WritesPastOut, IgnoresEps, MultipliesByScale,
             GoodDynamicNorm, DynamicScaleDoubled, DynamicResidualNotWritten):
    globals()[f"Test{_cls.__name__}"] = _norm(_cls)
