"""``python -m lra.peers``: the public packages of the methods, their pins and how to install them. A thin entry: the
command is ``lra.bench.peers.main`` (``--help`` lists its options)."""
from lra.bench.peers import main

if __name__ == "__main__":
    main()
