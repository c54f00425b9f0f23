"""Training: ``run(cfg)``, the loop (``run``); the one step, precision, compilation, timing and peak memory shared
with the bench (``engine``); the encoder around the mixer (``encoder``); a run's files (``checkpoint``);
data-parallel ranks (``distributed``); several examples per row (``packing``)."""
