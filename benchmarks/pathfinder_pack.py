"""Move a generated Pathfinder folder between machines in a few tens of MB instead of 200,000 small files.

    python benchmarks/pathfinder_pack.py pack DIFFICULTY_FOLDER OUT.tar.xz
    python benchmarks/pathfinder_pack.py unpack IN.tar.xz DIFFICULTY_FOLDER

``pack`` stores the metadata files verbatim, the generator's manifest, and every listed image's pixels in
one uint8 array (metadata order), xz-compressed (200,000 32x32 images: about 34 MB, against about 100 MB of
PNG files). ``unpack`` writes the same ``lra_release`` layout back (PNG is lossless: the loader decodes the
same pixels). A device call that generated the data packs it into $OUT; the next machine carries the
archive and unpacks it in seconds instead of generating for minutes.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image

from lra.data.pathfinder import read_metadata


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def pack(folder: Path, out: Path) -> None:
    paths, _, meta = read_metadata(folder)  # the loader's parser: same order, same format checks
    pixels = np.stack([np.asarray(Image.open(folder / p).convert("L")) for p in paths])  # (n, res, res)
    buf = io.BytesIO()
    np.save(buf, pixels)
    with tarfile.open(out, "w:xz") as tar:
        for m in meta:
            _add(tar, f"metadata/{m.name}", m.read_bytes())
        manifest = folder / "pathfinder_gen.json"
        if manifest.exists():
            _add(tar, manifest.name, manifest.read_bytes())
        _add(tar, "paths.json", json.dumps(paths).encode())
        _add(tar, "pixels.npy", buf.getvalue())
    print(f"packed {len(paths)} images from {folder} into {out} ({out.stat().st_size / 2**20:.1f} MiB)")


def unpack(archive: Path, folder: Path) -> None:
    with tarfile.open(archive, "r:xz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    paths = json.loads(files.pop("paths.json"))
    pixels = np.load(io.BytesIO(files.pop("pixels.npy")))
    if len(paths) != len(pixels):
        raise SystemExit(f"{archive}: {len(paths)} paths but {len(pixels)} images")
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    for d in sorted({str(Path(p).parent) for p in paths}):
        (folder / d).mkdir(parents=True, exist_ok=True)
    chunks = [(folder, paths[i:i + 2000], pixels[i:i + 2000]) for i in range(0, len(paths), 2000)]
    with Pool(min(len(chunks), os.cpu_count() or 1, 16)) as pool:  # PNG encoding is the slow part
        pool.map(_write_pngs, chunks)
    print(f"unpacked {len(paths)} images into {folder}")


def _write_pngs(job: tuple[Path, list[str], np.ndarray]) -> None:
    folder, paths, pixels = job
    for p, px in zip(paths, pixels):
        Image.fromarray(px, mode="L").save(folder / p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("folder", type=Path)
    p.add_argument("out", type=Path)
    u = sub.add_parser("unpack")
    u.add_argument("archive", type=Path)
    u.add_argument("folder", type=Path)
    args = parser.parse_args()
    pack(args.folder, args.out) if args.cmd == "pack" else unpack(args.archive, args.folder)


if __name__ == "__main__":
    main()
