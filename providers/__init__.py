"""Built-in providers (installed as ``fp8_backends.providers``), one module per provider.

They register through this distribution's own entry points (see pyproject.toml), exactly as a third
party does. Modules here stay import-light: torch and kernel libraries are imported inside methods.
"""
