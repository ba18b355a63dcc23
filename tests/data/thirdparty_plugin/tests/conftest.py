pytest_plugins = ["fp8_backends.testing.plugin"]  # the kit's `gpu` marker
