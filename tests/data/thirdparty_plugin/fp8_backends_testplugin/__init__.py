"""Test plugin for fp8-backends (installed only by the test-suite)."""
