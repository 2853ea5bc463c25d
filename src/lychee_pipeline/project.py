"""The project root: every relative path the project writes or stores is relative to it.

`kedro run` may start in a subfolder (`notebooks/`) and a project may be copied or moved. So:

- a run works in the project root (`ProjectRootHooks` changes into it before anything is resolved), so the
  tracking URI, `data/06_models/...`, the tiny model cache and the stage folders land in the project;
- image paths under the project root are stored relative to it (`stored_path`), so a moved project reuses its
  image manifest and its finished stages;
- an MLflow sqlite store whose artifact locations still point into the folder it was copied from is
  relocated into this project (`relocate_mlflow_store`), so a copy never writes into the original.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

_ROOT: Path | None = None


def set_project_root(path: str | os.PathLike) -> Path:
    global _ROOT
    _ROOT = Path(path).resolve()
    return _ROOT


def find_project_root(start: str | os.PathLike | None = None) -> Path | None:
    """The nearest folder at or above `start` (default: cwd) whose pyproject.toml has a [tool.kedro] table."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        pyproject = folder / "pyproject.toml"
        try:
            if pyproject.is_file() and "[tool.kedro]" in pyproject.read_text(encoding="utf-8"):
                return folder
        except OSError:
            continue
    return None


def project_root() -> Path:
    """The root of the running project: set by the hook, else found above cwd, else cwd."""
    return _ROOT or find_project_root() or Path.cwd().resolve()


def stored_path(path: str | os.PathLike) -> str:
    """`path` relative to the project root (posix) when it lies inside it, else unchanged."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    root = project_root()
    try:
        return p.relative_to(root).as_posix()
    except ValueError:
        return str(p)


def enter_project_root(project_path: str | os.PathLike) -> tuple[Path, Path | None]:
    """Make `project_path` the project root and the working folder; returns (root, folder left or None)."""
    root = set_project_root(project_path)
    cwd = Path.cwd().resolve()
    if cwd == root:
        return root, None
    os.chdir(root)
    return root, cwd


def _local_path(uri: str) -> str | None:
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if "://" in uri or ":" in uri.split("/")[0]:
        return None  # s3://, http://, mlflow-artifacts:, ...: not a folder of a copied project
    return uri


def relocate_mlflow_store(tracking_uri: str, experiment_name: str, root: str | os.PathLike) -> str | None:
    """Point the experiment's artifact locations into `root/mlruns` when a copied store points elsewhere.

    MLflow stores an experiment's artifact location (and each run's artifact URI) as an absolute path when it
    creates them; in a copied or moved project they still point into the original clone. For a sqlite store in
    `root` whose experiment `experiment_name` has its artifacts in `<old root>/mlruns/<id>`, every path that
    starts with `<old root>/mlruns/` is rewritten to `<root>/mlruns/`. Returns the old root when it moved.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):])
    if not db.is_file():
        return None
    root = Path(root).resolve()
    new_prefix = (root / "mlruns").as_posix() + "/"
    with sqlite3.connect(db, timeout=30) as conn:
        try:
            row = conn.execute("SELECT experiment_id, artifact_location FROM experiments WHERE name = ?",
                               (experiment_name,)).fetchone()
        except sqlite3.Error:
            return None
        if row is None or not row[1]:
            return None
        experiment_id, location = row
        path = _local_path(location)
        suffix = f"/mlruns/{experiment_id}"
        if path is None or not path.rstrip("/").endswith(suffix):
            return None  # a location the user chose (another folder, a server): left alone
        old_root = path.rstrip("/")[: -len(suffix)]
        if Path(old_root) == root:
            return None
        scheme = "file://" if location.startswith("file://") else ""
        old_prefix = f"{scheme}{old_root}/mlruns/"
        columns = [("experiments", "artifact_location"), ("runs", "artifact_uri"),
                   ("logged_models", "artifact_location"), ("model_versions", "storage_location")]
        for table, column in columns:
            try:
                conn.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE substr({column}, 1, ?) = ?",
                    (scheme + new_prefix, len(old_prefix) + 1, len(old_prefix), old_prefix),
                )
            except sqlite3.OperationalError:  # a table or column this MLflow version does not have
                continue
    return old_root
