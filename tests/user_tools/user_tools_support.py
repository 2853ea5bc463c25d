"""Helpers of the user-tool tests: a throw-away copy of the project and the CLI run inside it.

The tests meet the tools the way a user does (``kedro viz build``, ``mlflow server``, the notebook), so
they need a real project folder. They never write into the checkout: the copy holds ``conf/`` (with an
empty ``conf/local``), ``pyproject.toml``, ``src/``, ``notebooks/`` and empty ``data/`` layer folders.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYER_DIRS = ("01_raw", "02_intermediate", "03_primary", "04_feature", "05_model_input", "06_models",
              "07_model_output", "08_reporting")
QUIET_ENV = {"KEDRO_DISABLE_TELEMETRY": "1", "MLFLOW_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
             "TOKENIZERS_PARALLELISM": "false"}
# Small demo catalogue for the tests: enough records for every task type and a few images.
DATA_PARAMS = "demo_data.n_products=80,demo_data.n_records=400,data_processing.ingestion.workers=1,data_processing.image_check.workers=1"


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: telemetry off, MLflow pointed nowhere by default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env.update(QUIET_ENV)
    env.update(extra)
    return env


def make_project_copy(dst: Path) -> Path:
    """A fresh-clone-like copy of the project at ``dst`` (no local config, no outputs)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".ipynb_checkpoints")
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "conf", dst / "conf", ignore=shutil.ignore_patterns("local"))
    (dst / "conf" / "local").mkdir()
    shutil.copytree(REPO / "src", dst / "src", ignore=ignore)  # kedro wants src/ inside the project
    if (REPO / "notebooks").is_dir():
        shutil.copytree(REPO / "notebooks", dst / "notebooks", ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")
    for layer in LAYER_DIRS:
        (dst / "data" / layer).mkdir(parents=True)
    return dst


def kedro(project: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the ``kedro`` CLI of this interpreter in ``project``; fail the test with its output on error."""
    proc = subprocess.run([sys.executable, "-m", "kedro", *args], cwd=project, env=user_env(COLUMNS="200"),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"kedro {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc
