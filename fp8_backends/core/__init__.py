"""Floor 0 of the library: the provider contract and what every floor shares.

Problem and result types, the error classes, the selection objective, the ``FP8_*`` settings, capabilities, input
validation, the output contract, the reference implementation, the provider base classes, the op library, the
per-provider M-bucket tables and the text-table helper. Modules here import only each other (and the registry
lazily, inside functions), so the registry (``fp8_backends.registry``), the providers (``fp8_backends.providers``)
and the engine layer and tools (the rest of ``fp8_backends``) all build on them. Importing this package imports none
of its modules.
"""
