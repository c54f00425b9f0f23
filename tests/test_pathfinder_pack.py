"""benchmarks/pathfinder_pack.py: a generated Pathfinder folder survives pack + unpack pixel for pixel."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from lra.data.pathfinder_gen import generate

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pathfinder_pack.py"


def test_pack_unpack_roundtrip(tmp_path):
    src = generate(tmp_path / "gen", resolution=32, difficulty="hard", n=12, seed=1, batch_size=5, workers=1,
                   progress=False)
    archive, dst = tmp_path / "pf.tar.xz", tmp_path / "copy" / "folder"
    # this checkout's lra, whichever one is installed (a script's sys.path starts at benchmarks/, not the root)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for args in (["pack", src, archive], ["unpack", archive, dst]):
        subprocess.run([sys.executable, SCRIPT, *map(str, args)], check=True, capture_output=True, env=env)
    before = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    assert before == sorted(p.relative_to(dst) for p in dst.rglob("*") if p.is_file())
    assert len([p for p in before if p.suffix == ".png"]) == 12
    for rel in before:
        if rel.suffix == ".png":
            assert np.array_equal(np.asarray(Image.open(src / rel)), np.asarray(Image.open(dst / rel)))
        else:
            assert (src / rel).read_bytes() == (dst / rel).read_bytes()
