"""`kedro` starts without MLflow's type-hint notice: the project's `kedro.init` entry point (pyproject.toml) drops
it from the log before kedro-mlflow's pyfunc class (no type hints on its `predict`) is imported."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEFINE_A_MODEL_WITHOUT_HINTS = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
logging.captureWarnings(True)  # as Kedro's log handler does
if sys.argv[1] == "quiet":
    from lychee_pipeline.hooks import quiet_kedro_startup
    quiet_kedro_startup()
import mlflow.pyfunc

class NoHints(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        return []
print("defined", flush=True)
"""


def _define(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DEFINE_A_MODEL_WITHOUT_HINTS, mode], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_the_kedro_init_entry_point_drops_mlflows_type_hint_notice():
    from kedro.framework.cli.utils import ENTRY_POINT_GROUPS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared[ENTRY_POINT_GROUPS["init"]] == {"lychee_pipeline": "lychee_pipeline.hooks:quiet_kedro_startup"}
    loud, quiet = _define("loud"), _define("quiet")
    assert "defined" in loud.stdout and "defined" in quiet.stdout, loud.stderr + quiet.stderr
    assert "Add type hints to the `predict` method" in loud.stderr  # what MLflow prints without the filter
    assert "Add type hints" not in quiet.stderr, quiet.stderr


def test_the_projects_own_model_has_type_hints():
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr); logging.captureWarnings(True)\n"
            "import lychee_pipeline.mlflow_model\nprint('imported', flush=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "imported" in done.stdout and "Add type hints" not in done.stderr, done.stderr
