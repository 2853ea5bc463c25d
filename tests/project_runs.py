"""Running the project as a user does: a fresh project copy and `kedro run` through KedroSession."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["01_raw", "02_intermediate", "03_primary", "04_feature", "05_model_input", "06_models",
          "07_model_output", "08_reporting"]


def make_project_copy(root: Path) -> Path:
    """A fresh project folder: conf and pyproject copied, empty data layers (the package is installed)."""
    shutil.copytree(REPO / "conf", root / "conf", ignore=shutil.ignore_patterns("credentials*", "*.db"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "src").mkdir()  # Kedro wants the source folder; the package itself is installed
    for layer in LAYERS:
        (root / "data" / layer).mkdir(parents=True)
    return root


def run_kedro(root: Path, pipeline: str, params: dict | None = None) -> None:
    """`kedro run --pipeline <name>` through KedroSession, from the project folder."""
    import mlflow
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    def end_active_runs() -> None:  # one process runs several sessions here; a user's CLI run does not
        while mlflow.active_run() is not None:
            mlflow.end_run()

    end_active_runs()
    previous = os.getcwd()
    os.chdir(root)
    try:
        bootstrap_project(root)
        with KedroSession.create(project_path=root, runtime_params=params or {}) as session:
            session.run(pipeline_name=pipeline)
    finally:
        os.chdir(previous)
        end_active_runs()
