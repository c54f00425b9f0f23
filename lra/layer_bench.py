"""``python -m lra.layer_bench``: one attention layer of each mixer, timed beside the public packages of the same
methods. A thin entry: the command is ``lra.bench.layer_bench.main`` (``--help`` lists its options)."""
from lra.bench.layer_bench import main

if __name__ == "__main__":
    main()
