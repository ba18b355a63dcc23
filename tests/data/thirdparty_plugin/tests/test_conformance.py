"""The plugin's own conformance tests, as a provider author writes them: one subclass per provider."""

from fp8_backends.testing import GemmProviderContract, NormQuantProviderContract


class TestToyGemm(GemmProviderContract):
    def make_provider(self):
        from fp8_backends_testplugin.toy import ToyGemmBackend

        return ToyGemmBackend()


class TestToySpicyGemm(GemmProviderContract):
    """The same provider with a non-default option, built from the registry by DIST:NAME@options."""

    provider_spec = "fp8-backends-testplugin:toy@flavour=spicy"


class TestToyNormQuant(NormQuantProviderContract):
    def make_provider(self):
        from fp8_backends_testplugin.toy import ToyNormQuantBackend

        return ToyNormQuantBackend()
