"""File digests shared by the layers above (checkpoint manifests, the training data a registered version read)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path | str) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (checkpoint shards and training tables are large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
