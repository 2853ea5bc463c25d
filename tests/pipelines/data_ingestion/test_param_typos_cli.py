"""Issue 32 item 2: a mistyped nested key on the command line fails before anything runs, in one line naming
the key it meant (the typed parameter blocks refuse unknown keys)."""

from __future__ import annotations

import os
import subprocess
import sys

from project_runs import make_cli_project


def test_mistyped_nested_params_fail_naming_the_key_meant(tmp_path):
    project = make_cli_project(tmp_path / "project")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env.update(KEDRO_DISABLE_TELEMETRY="1", MLFLOW_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "kedro", "run", "--pipelines", "data",
         "--params", "data.raw_pth=/nonexistent,data_processing.split.sed=7"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600)
    out = " ".join((proc.stdout + proc.stderr).split())  # the console wraps long lines
    assert proc.returncode != 0, out[-4000:]
    assert "invalid parameter data.raw_pth: Extra inputs are not permitted (got '/nonexistent'); " \
           "did you mean data.raw_path?" in out, out[-4000:]
    assert "invalid parameter data_processing.split.sed: Extra inputs are not permitted (got 7); " \
           "did you mean data_processing.split.seed?" in out, out[-4000:]
    # refused before the first node: no demo data generated, nothing ingested
    assert not any((project / "data").rglob("*.*")), sorted((project / "data").rglob("*.*"))
