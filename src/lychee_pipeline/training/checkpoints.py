"""Atomic, checksummed training checkpoints: a half-written or corrupted one is never resumed from."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from lychee_pipeline.runtime.files import sha256_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "checkpoint-"


def staging_dir(root: Path, step: int) -> Path:
    """Where a checkpoint is written before it is published (never matched by `find_resumable`)."""
    return root / f".{PREFIX}{step}.partial"


def file_digests(folder: Path, skip: str | None = MANIFEST) -> dict[str, str]:
    """sha256 of every file under `folder` (relative names), the manifest itself excepted."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != skip)
    return {str(p.relative_to(folder)): sha256_file(p) for p in files}


def verify_files(folder: Path, recorded: dict[str, str]) -> str | None:
    """None if every recorded file is there with its checksum, else the first problem."""
    if not recorded:
        return "empty manifest"
    for name, digest in recorded.items():
        path = folder / name
        if not path.is_file():
            return f"missing file {name}"
        if sha256_file(path) != digest:
            return f"checksum mismatch in {name}"
    return None


def write_folder_manifest(folder: Path, manifest: Path) -> None:
    """Record the checksums of a finished output folder (the adapter) in `manifest`, atomically."""
    tmp = manifest.with_name(manifest.name + ".tmp")
    tmp.write_text(json.dumps({"folder": folder.name, "files": file_digests(folder, skip=None)}, indent=1))
    os.replace(tmp, manifest)


def verify_folder(folder: Path, manifest: Path) -> str | None:
    """None if `folder` matches the checksums in `manifest`, else why it cannot be reused."""
    if not manifest.is_file():
        return f"no manifest {manifest.name}"
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest {manifest.name}: {exc}"
    return verify_files(folder, recorded)


def publish(root: Path, step: int, state: dict) -> Path:
    """Write the manifest (checksums + trainer state) and rename the staging folder into place."""
    tmp = staging_dir(root, step)
    files = file_digests(tmp)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "state": state, "files": files}, indent=1))
    final = root / f"{PREFIX}{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def verify(checkpoint: Path) -> str | None:
    """None if every file matches its recorded checksum, else the reason it is unusable."""
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return "no manifest (write interrupted)"
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest: {exc}"
    return verify_files(checkpoint, recorded)


def _step_of(path: Path) -> int:
    try:
        return int(path.name[len(PREFIX) :])
    except ValueError:
        return -1


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and _step_of(p) >= 0]
    return sorted(found, key=_step_of, reverse=True)


def find_resumable(root: Path) -> tuple[Path | None, dict, list[str]]:
    """The newest intact checkpoint, its trainer state, and a note for each newer one that was skipped."""
    skipped: list[str] = []
    for checkpoint in list_checkpoints(root):
        problem = verify(checkpoint)
        if problem is None:
            state = json.loads((checkpoint / MANIFEST).read_text())["state"]
            return checkpoint, state, skipped
        skipped.append(f"{checkpoint.name}: {problem}")
    return None, {}, skipped


def resume_note(root: Path) -> str:
    """What `training.resume: true` will do with the checkpoints under `root`, in one phrase (without reading
    them: the stage's processes verify them and say in launch.log which one they resumed from)."""
    found = list_checkpoints(root)
    if not found:
        return f"training.resume: no checkpoint found under {root}, starting from step 0"
    return (f"training.resume: resuming from the newest intact of {len(found)} checkpoint(s) under {root} "
            f"(newest {found[0].name})")


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` published checkpoints; drop stale staging folders."""
    for old in list_checkpoints(root)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob(f".{PREFIX}*.partial"):
        shutil.rmtree(partial, ignore_errors=True)
