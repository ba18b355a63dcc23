"""Provider discovery, platform detection and backend resolution (installed as ``fp8_backends.registry``).

- :mod:`.platform`: what GPU (or CPU) a problem runs on, real or simulated.
- :mod:`.discovery`: stevedore entry points -> :class:`~.discovery.ProviderEntry` records, never raising.
- :mod:`.resolution`: explicit names, aliases, env vars and ``auto`` -> a provider instance.
- :mod:`.policy`: the selection-policy contract of ``auto`` (``pick``, ``buckets``) and its ranked register; the
  built-in policies are :mod:`.lockfile_policy`, :mod:`.shipped` and :mod:`.defaults`.
- :mod:`.per_m`: one weight's composite provider per M bucket (what a layer or ``fp8_linear`` runs).
- :mod:`.host_aware`: the ``host`` selection objective's rule, shared by the measuring policies.
- the environment variables it reads are in :mod:`fp8_backends.core.settings`.
"""
