"""Files written whole or not at all, inter-process locks and file hashes: what the data cache, the run folders and
the results CSVs share. A leaf: it imports nothing of the project."""
from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import torch
from filelock import FileLock


def temporary_name(path: Path) -> Path:
    """A sibling name no other process or thread writes (for write-then-rename publishing)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def atomic_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary sibling, then rename: a reader sees the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def lock_for(path: Path) -> FileLock:
    """An inter-process lock beside ``path`` (``<path>.lock``); held while ``path`` is built or generated."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock")
