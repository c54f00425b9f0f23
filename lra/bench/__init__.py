"""Benchmarks: whole training steps under LRA Table 2's protocol (``bench``, ``python -m lra.bench``), one
attention layer of each mixer (``layer_bench``) beside the public packages of the same methods (``peers``)."""
