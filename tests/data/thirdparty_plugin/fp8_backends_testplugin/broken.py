"""A provider module whose import fails, as a plugin with a missing dependency would."""

import fp8_backends_testplugin_missing_dependency  # noqa: F401  (does not exist on purpose)
