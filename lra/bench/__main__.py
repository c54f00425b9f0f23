"""``python -m lra.bench [key=value ...]``: LRA Table 2's speed and memory sweep (``lra.bench.bench``)."""
from lra.bench.bench import main

if __name__ == "__main__":
    main()
