"""The tuner and what it measures with (``python -m fp8_backends.tune`` is its command line).

- :mod:`.engine`: measure the candidates of each problem and M bucket, pick the winners, merge them into the lockfile;
- :mod:`.timing`: timers (CUDA graphs, inputs rotated past L2, interleaved rounds) shared with ``bench/``;
- :mod:`.workloads`: a problem's inputs and each provider's candidates (option combinations, pins);
- :mod:`.models`: the linear shapes of known models at a tensor-parallel degree;
- :mod:`.plan`: what one run covers (problems, labels, M buckets, pins, shards, resumption);
- :mod:`.grid`: the grid of the shipped selection data and its time estimate;
- :mod:`.provenance`: where, with what and by which command shipped selection data was measured.

Importing this package imports nothing heavy: torch loads when something is measured.
"""
