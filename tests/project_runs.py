"""Running the project as a user does: a fresh project copy and `kedro run` through KedroSession."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def mlflow_tracking_restored(fresh: bool = False) -> Iterator[None]:
    """This process's MLflow tracking state as it was, after the block: the URI MLflow was told (None when unset;
    `mlflow.get_tracking_uri()` would give the resolved default, and setting that back writes it into
    MLFLOW_TRACKING_URI for every later test of the worker), the variable itself, and the URIs the project took for
    the user's. ``fresh``: the block starts from a new process's state."""
    import mlflow

    from lychee_pipeline import tracking

    saved = tracking._uri_set_by_mlflow(), os.environ.get(tracking.ENV_TRACKING_URI), set(tracking._user_uris)
    if fresh:
        mlflow.set_tracking_uri(None)
        os.environ.pop(tracking.ENV_TRACKING_URI, None)  # MLflow unsets it only when its own URI was set
        tracking._user_uris.clear()
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved[0])
        if saved[1] is None:
            os.environ.pop(tracking.ENV_TRACKING_URI, None)
        else:
            os.environ[tracking.ENV_TRACKING_URI] = saved[1]
        tracking._user_uris.clear()
        tracking._user_uris.update(saved[2])


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
    # A user's `kedro run` starts a fresh process: no tracking URI that an earlier test of this process left in
    # MLflow or in MLFLOW_TRACKING_URI (it would be taken for the user's and the run would log to that store)
    with mlflow_tracking_restored(fresh=True):
        os.chdir(root)
        try:
            bootstrap_project(root)
            with KedroSession.create(project_path=root, runtime_params=params or {}) as session:
                session.run(pipeline_name=pipeline)
        finally:
            os.chdir(previous)
            end_active_runs()


def make_cli_project(root: Path) -> Path:
    """A project copy for the real `kedro` CLI: kedro puts <project>/src first on sys.path, so the copy carries
    this checkout's source, and a notebooks/ folder to start commands from."""
    project = make_project_copy(root)
    shutil.rmtree(project / "src")
    shutil.copytree(REPO / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (project / "notebooks").mkdir()
    shutil.copy2(REPO / "notebooks" / "01_explore_data_and_results.ipynb", project / "notebooks")
    return project


def kedro_run(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """`kedro run ARGS` as a user types it, from `cwd` (with `env` added to this process's environment); returns
    its log (stdout + stderr), asserting exit 0."""
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env.update(KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", **extra)
    proc = subprocess.run([sys.executable, "-m", "kedro", "run", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"kedro run {' '.join(args)} failed ({proc.returncode}):\n{out[-8000:]}"
    return out
